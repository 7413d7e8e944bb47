//! Zero-filled anonymous buffers asked to be backed by transparent huge pages, and an [`Arena`]
//! that carves many small buffers out of shared ones.
//!
//! Decode streams every weight once per token; on 4 KiB pages that walk needs a page-table
//! lookup every 4 KiB, and in a virtual machine (two-level paging) each costs several memory
//! reads. On the development VM a streaming read on 2 MiB pages measured 10-25% more bandwidth
//! than on 4 KiB pages, and Qwen's decode 3-4% more with its x8 Q4_K copy on them. Repacked
//! weights and the bandwidth probe live in these buffers so the kernel can back them with 2 MiB
//! pages (`madvise(MADV_HUGEPAGE)`, which also works where THP is in `madvise` mode). The advice
//! is a hint: with THP off the buffer is an ordinary zeroed mapping. A buffer of its own gets no
//! huge page under 2 MiB, nor for its unaligned tail; the weights' copies therefore come from an
//! [`Arena`] of shared slabs.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use memmap2::{Advice, MmapMut};

/// A zeroed, writable byte buffer in its own anonymous mapping (an empty one needs no mapping).
pub struct HugeBuf {
    map: Option<MmapMut>,
}

impl HugeBuf {
    /// `len` zero bytes, advised `MADV_HUGEPAGE` before any page is touched.
    pub fn zeroed(len: usize) -> HugeBuf {
        if len == 0 {
            return HugeBuf { map: None };
        }
        let buf = Self::small_pages(len);
        buf.advise_huge();
        buf
    }

    /// `len` zero bytes on ordinary pages until [`Self::advise_huge`]: a page costs only when
    /// first touched, 4 KiB of zeroing rather than 2 MiB.
    pub fn small_pages(len: usize) -> HugeBuf {
        if len == 0 {
            return HugeBuf { map: None };
        }
        let map = MmapMut::map_anon(len).expect("anonymous mapping for repacked weights");
        HugeBuf { map: Some(map) }
    }

    /// Asks for huge pages from now on (`MADV_HUGEPAGE`): 2 MiB ranges not touched yet fault in
    /// as huge pages, touched ones wait for the kernel's `khugepaged`. Only a hint: an error (THP
    /// compiled out) leaves ordinary pages.
    pub fn advise_huge(&self) {
        if let Some(map) = &self.map {
            let _ = map.advise(Advice::HugePage);
        }
    }
}

impl Deref for HugeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}

impl DerefMut for HugeBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.map.as_deref_mut().unwrap_or(&mut [])
    }
}

/// Buffers carved out of shared huge-page slabs, so that matrices under 2 MiB sit on huge pages
/// too (a buffer of their own would get none: a 1.3 MiB Q4_K matrix decoded at 21 GB/s against
/// 26.5 GB/s for the 7.7 MiB ones on 2 MiB pages, same kernel and row length).
///
/// Invariant: the bump offset of the current slab only grows, so every byte range is handed to
/// exactly one [`Region`], written once by its `fill` and only read after.
#[derive(Default)]
pub struct Arena {
    /// The slab being filled and how many of its bytes are handed out.
    current: Mutex<Option<(Arc<Slab>, usize)>>,
}

/// One mapping of an [`Arena`] and the address of its first byte (stable: the mapping never moves).
struct Slab {
    ptr: *mut u8,
    len: usize,
    _buf: HugeBuf,
}

// SAFETY: a `Slab` is memory that `Arena::alloc` hands out in disjoint ranges, each written once by
// its filler before any `Region` exposes it as shared `&[u8]`; nothing writes a range after that,
// so sharing and sending the raw pointer across threads is as safe as sharing `&[u8]`.
unsafe impl Send for Slab {}
// SAFETY: see `Send` above.
unsafe impl Sync for Slab {}

/// The bytes of one buffer in an [`Arena`] slab (read-only once filled).
pub struct Region {
    slab: Arc<Slab>,
    off: usize,
    len: usize,
}

impl Deref for Region {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `off..off + len` lies inside the slab (checked in `alloc`), whose mapping lives
        // as long as this `Arc`; the range was filled before this `Region` existed and is never
        // written again (the arena's invariant), so a shared slice of it is sound.
        unsafe { std::slice::from_raw_parts(self.slab.ptr.add(self.off), self.len) }
    }
}

impl Arena {
    /// Bytes of one slab; a buffer larger than half of it gets a mapping of its own.
    pub const SLAB: usize = 64 << 20;

    /// A buffer of `len` bytes, zeroed, handed to `fill` to write, then returned read-only.
    /// Buffers start on 4 KiB boundaries.
    pub fn alloc(&self, len: usize, fill: impl FnOnce(&mut [u8])) -> Region {
        let new_slab = |size: usize| {
            let mut buf = HugeBuf::zeroed(size);
            let (ptr, len) = (buf.as_mut_ptr(), buf.len());
            Arc::new(Slab {
                ptr,
                len,
                _buf: buf,
            })
        };
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let (slab, off) = if len > Self::SLAB / 2 {
            (new_slab(len), 0)
        } else {
            let need = len.next_multiple_of(4096);
            let fits = matches!(&*cur, Some((s, used)) if used + need <= s.len);
            if !fits {
                *cur = Some((new_slab(Self::SLAB), 0));
            }
            let (s, used) = cur.as_mut().expect("a current slab");
            let off = *used;
            *used += need;
            (Arc::clone(s), off)
        };
        assert!(off + len <= slab.len, "a buffer inside its slab");
        // SAFETY: `off..off + len` lies inside the slab's mapping (asserted above) and was never
        // handed out before: the bump offset only grows and a
        // dedicated slab holds this buffer alone. No `Region` for it exists yet, so this is the
        // only reference to those bytes while `fill` runs.
        let dst = unsafe { std::slice::from_raw_parts_mut(slab.ptr.wrapping_add(off), len) };
        fill(dst);
        Region { slab, off, len }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_writable_and_empty() {
        let mut b = HugeBuf::zeroed(3 << 20);
        assert_eq!(b.len(), 3 << 20);
        assert!(b.iter().all(|&x| x == 0));
        b[(3 << 20) - 1] = 7;
        assert_eq!(b[(3 << 20) - 1], 7);
        let e = HugeBuf::zeroed(0);
        assert!(e.is_empty());
    }

    #[test]
    fn arena_regions_are_disjoint_and_keep_their_bytes() {
        let arena = Arena::default();
        let sizes = [
            100,
            5000,
            1 << 20,
            Arena::SLAB / 2 + 1,
            0,
            30 << 20,
            30 << 20,
            7,
        ];
        let regions: Vec<Region> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                arena.alloc(n, |b| {
                    assert!(b.iter().all(|&x| x == 0), "fresh bytes are zero");
                    b.fill(i as u8 + 1);
                })
            })
            .collect();
        for (i, (r, &n)) in regions.iter().zip(&sizes).enumerate() {
            assert_eq!(r.len(), n);
            assert!(r.iter().all(|&x| x == i as u8 + 1), "region {i}");
            assert_eq!(r.as_ptr() as usize % 4096, 0, "region {i} page-aligned");
        }
    }
}
