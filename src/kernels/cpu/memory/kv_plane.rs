//! One plane (K or V) of the paged f16 KV cache: every layer's slots in one anonymous mapping,
//! from a 2 MiB boundary on, on 4 KiB pages until a sequence reaches [`HUGE_FROM_SLOT`], then
//! advised onto transparent huge pages ([`HugeBuf`]).
//!
//! Why not huge pages from the start: the first write to each layer would fault in a whole 2 MiB
//! page, and the kernel zeroes it. A 5-token prompt then zeroed 36 such pages for Gemma-3 270M
//! and 56 for Qwen2.5-1.5B (72 and 112 MiB), on the development VM at about 1 GB/s (fresh
//! guest memory), which made the KV writes of the first forward tens to hundreds of milliseconds
//! of the time to the first token. On small pages the same prompt touches one 4 KiB page a layer.
//!
//! Decode's attention reads a few hundred bytes from each of many cache slots, spread over many
//! pages, while the weights stream through the caches; on 4 KiB pages a page's first slot is a
//! TLB miss, and in a virtual machine each miss walks two levels of page tables. On the
//! development VM, in the state where its two cores read memory over separate paths, Qwen2.5-1.5B's
//! attention once took 13.7-14.3 µs a layer per thread on 4 KiB pages and 7.2-7.7 µs on 2 MiB
//! pages (contexts 4-132; in the other state 6.6-7.4 and 6.4-6.6), and its decode step was 1.8%
//! shorter (paired, two copies of the model alternated in one process). In that state an hour
//! later the step was the same either way (0.998-1.006 in eight runs, both models).
//!
//! Invariant: layer `l` is values `l * per_layer .. (l + 1) * per_layer` of the plane, all zero
//! until written. Untouched pages (layers a GPU holds, slots no sequence reached) take no memory;
//! once advised, a touched one may take 2 MiB, so a plane holds at most one partly used huge page
//! per layer beyond the slots written.

use std::ops::{Index, IndexMut};

use half::f16;

use crate::kernels::cpu::memory::hugebuf::HugeBuf;

/// Huge page size: the plane's first value sits on such a boundary.
const HUGE: usize = 2 << 20;

/// The first cache slot whose write moves the planes onto huge pages ([`KvPlane::advise_huge`]):
/// below it attention reads at most 256 slots a layer, a few dozen 4 KiB pages.
pub const HUGE_FROM_SLOT: usize = 256;

/// `layers` layers of `per_layer` f16 values each.
pub struct KvPlane {
    buf: HugeBuf,
    /// Byte offset of the first value in `buf`: its first 2 MiB boundary.
    off: usize,
    per_layer: usize,
    layers: usize,
}

impl KvPlane {
    /// A zeroed plane (no mapping at all when it holds no values).
    pub fn zeroed(layers: usize, per_layer: usize) -> KvPlane {
        let bytes = layers
            .checked_mul(per_layer)
            .and_then(|n| n.checked_mul(2))
            .expect("KV plane size fits in memory");
        // The mapping starts on a 4 KiB boundary: room to move the first value to the next 2 MiB
        // one (slack that is never touched, so address space only).
        let buf = HugeBuf::small_pages(if bytes == 0 { 0 } else { bytes + HUGE });
        let base = buf.as_ptr() as usize;
        let off = if bytes == 0 {
            0
        } else {
            base.next_multiple_of(HUGE) - base
        };
        KvPlane {
            buf,
            off,
            per_layer,
            layers,
        }
    }

    /// Moves the plane onto huge pages from now on (see the module comment).
    pub fn advise_huge(&self) {
        self.buf.advise_huge();
    }

    /// Layers in the plane.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Byte range of layer `l` in `buf`.
    fn range(&self, l: usize) -> std::ops::Range<usize> {
        assert!(
            l < self.layers,
            "layer {l} of a {}-layer KV plane",
            self.layers
        );
        let start = self.off + 2 * l * self.per_layer;
        start..start + 2 * self.per_layer
    }
}

impl Index<usize> for KvPlane {
    type Output = [f16];
    fn index(&self, l: usize) -> &[f16] {
        let bytes = &self.buf[self.range(l)];
        // SAFETY: `bytes` starts at a 2 MiB boundary plus a multiple of 2 (aligned for f16) and
        // holds 2 * per_layer bytes; f16 is a plain 2-byte value for which every bit pattern is
        // valid, and the slice borrows `self` as `bytes` did.
        unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f16>(), self.per_layer) }
    }
}

impl IndexMut<usize> for KvPlane {
    fn index_mut(&mut self, l: usize) -> &mut [f16] {
        let (range, n) = (self.range(l), self.per_layer);
        let bytes = &mut self.buf[range];
        // SAFETY: as in `index`; the slice borrows `self` mutably as `bytes` did.
        unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<f16>(), n) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_disjoint_zeroed_and_start_on_huge_pages() {
        let mut p = KvPlane::zeroed(3, 1000);
        assert_eq!(p.layers(), 3);
        assert_eq!(
            p[0].as_ptr() as usize % HUGE,
            0,
            "first value on a 2 MiB boundary"
        );
        for l in 0..3 {
            assert_eq!(p[l].len(), 1000);
            assert!(p[l].iter().all(|x| x.to_bits() == 0), "layer {l} zeroed");
            p[l].fill(f16::from_f32(l as f32 + 1.0));
        }
        for l in 0..3 {
            assert!(
                p[l].iter().all(|x| x.to_f32() == l as f32 + 1.0),
                "layer {l} kept"
            );
        }
        let empty = KvPlane::zeroed(0, 0);
        assert_eq!(empty.layers(), 0);
    }

    #[test]
    #[should_panic(expected = "layer 2 of a 2-layer KV plane")]
    fn a_layer_past_the_end_panics() {
        let p = KvPlane::zeroed(2, 8);
        let _ = &p[2];
    }
}
