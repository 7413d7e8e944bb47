//! The repacked copies of a model's weights kept on disk between runs, so that a process starts
//! without repacking: the first run of a model writes every copy it packs into a pack file
//! (`DIR/<model file name>-<key>.pack`); later runs map that file and read the copies from it,
//! while a background thread ([`Deferred`]) moves them onto huge pages matrix by matrix, and
//! makes the plain huge-page copies of the other matmul weights (which reads take from the mapped
//! model until then), so that decode soon reads what it reads after an eager load.
//!
//! Layout: the copies at 4 KiB-aligned offsets from the start, then a JSON table of
//! `[tensor index, offset in the tensor's data, length, offset in the file]`, then the table's
//! length (u64 LE), the key (u64 LE) and the magic `INFERPK1`.
//!
//! Invariants:
//! - A pack file holds exactly the bytes the packing functions produce for its key: the key
//!   hashes the model file (path, size, modification time, inode, [`Gguf::fingerprint`]), the
//!   sources that decide the layouts' bytes (`INFER_LAYOUT_HASH`, from `build.rs`) and the SIMD
//!   level (which picks the layouts). A file whose footer or table does not match is ignored and
//!   replaced, so the output is byte-identical whichever copy a matrix is read from.
//! - A pack file is written as `NAME.tmp-PID`, synced, and renamed, so a file under the final
//!   name is complete; it is never written in place after, so its mapping stays valid while other
//!   processes replace it.
//! - A copy moved to huge pages is published through a `OnceLock` before the mapped pages are
//!   released; a reader holding the mapped slice keeps reading the same bytes (released pages map
//!   back from the page cache).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use crate::format::Gguf;
use crate::kernels::cpu::memory::hugebuf::{Arena, Region};

const MAGIC: &[u8; 8] = b"INFERPK1";
const FOOTER: usize = 24;
const ALIGN: u64 = 4096;

/// Models with fewer packed bytes than this are repacked at load and never written (too quick to
/// gain from a file; this keeps the tests' tiny models out of the cache). `$INFER_PACK_MIN_BYTES`
/// overrides it (tests).
pub const MIN_PACKED_BYTES: u64 = 32 << 20;

fn min_packed_bytes() -> u64 {
    std::env::var("INFER_PACK_MIN_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(MIN_PACKED_BYTES)
}

/// A weight's copies on the CPU: the packed one (built at load, read from a pack file, or moved
/// from there to huge pages) and the plain one on huge pages.
#[derive(Default)]
pub struct Copies {
    /// The packed copy on huge pages.
    pub packed: OnceLock<Region>,
    /// The packed copy in a mapped pack file, until `packed` is set.
    pub mapped: Option<MappedRange>,
    /// A plain copy of the matrix on huge pages, which reads use instead of the model file.
    pub resident: OnceLock<Region>,
    /// Set while the background thread makes a plain copy of at least [`HOLD_BYTES`]: reads
    /// wait for it ([`Copies::resident_or_wait`]) instead of mapping the file's pages back.
    pub moving: AtomicBool,
}

/// Plain copies at least this large hold their readers while they are made (see
/// [`Copies::moving`]): otherwise a decode step reads the whole matrix from the file while the
/// copy grows, and the process holds it twice (Gemma-3 270M: its 178 MB embedding and output
/// head put the peak resident set 170 MB over the file's size).
pub const HOLD_BYTES: usize = 32 << 20;

impl Copies {
    /// The plain copy when there is one; while the background thread is making it, waits for it
    /// (polling, so that a copy that fails, which clears `moving`, frees its readers too).
    pub fn resident_or_wait(&self) -> Option<&Region> {
        while self.resident.get().is_none() && self.moving.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_micros(100));
        }
        self.resident.get()
    }

    /// The packed copy: on huge pages when moved there, else in the pack file, else `None`.
    pub fn packed(&self) -> Option<&[u8]> {
        self.packed
            .get()
            .map(|r| &r[..])
            .or_else(|| self.mapped.as_ref().map(|m| m.bytes()))
    }
}

/// A byte range of a mapped pack file.
pub struct MappedRange {
    map: Arc<memmap2::Mmap>,
    start: usize,
    len: usize,
}

impl MappedRange {
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }

    /// Drops the pages wholly inside `part` (a slice of [`Self::bytes`]) from the process's
    /// resident set (see [`Gguf::release`]).
    fn release_part(&self, part: &[u8]) {
        const PAGE: usize = 4096;
        let Some(start) = (part.as_ptr() as usize).checked_sub(self.map.as_ptr() as usize) else {
            return;
        };
        let end = start + part.len();
        if end > self.map.len() {
            return;
        }
        let (lo, hi) = (start.div_ceil(PAGE) * PAGE, end / PAGE * PAGE);
        if lo < hi {
            // SAFETY: `MADV_DONTNEED` on a read-only file mapping only drops this process's page
            // mappings; nothing writes a pack file after its rename (module invariant), so a later
            // read maps the same bytes back and no live slice sees different contents.
            let _ = unsafe {
                self.map
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, lo, hi - lo)
            };
        }
    }
}

/// Copies a load leaves for later: made on huge pages by a background thread ([`Deferred::start`])
/// once the first forward pass has computed its logits ([`Deferred::open`]), or [`GATE_TIMEOUT`]
/// after the load, while reads use the pack file or the model file. Waiting for the first
/// logits keeps the copies (page faults and zeroing of fresh huge pages, about 1 ms a MB on the
/// development VM) off the two cores the first token needs.
#[derive(Default)]
pub struct Deferred {
    jobs: Mutex<Vec<Job>>,
    /// Fast check of `state.0`.
    opened: AtomicBool,
    /// (the gate is open, the copies are done)
    state: Mutex<(bool, bool)>,
    changed: Condvar,
}

/// How long the copies wait for the first logits before they start anyway (a server that loads
/// and waits for requests).
pub const GATE_TIMEOUT: Duration = Duration::from_secs(1);

impl Deferred {
    /// Lets the copies start (the first forward pass is done). Cheap after the first call.
    pub fn open(&self) {
        if self.opened.swap(true, Ordering::AcqRel) {
            return;
        }
        self.state.lock().unwrap_or_else(|e| e.into_inner()).0 = true;
        self.changed.notify_all();
    }

    /// Opens the gate and waits until every deferred copy is made (a benchmark's steady state).
    pub fn wait(&self) {
        self.open();
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while !st.1 {
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn done(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.changed.notify_all();
    }

    /// Move `copies`' packed copy from the pack file to huge pages.
    pub fn packed(&self, copies: Arc<Copies>) {
        self.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Job::Packed(copies));
    }

    /// Make `copies`' plain copy of the `len` bytes at `offset` of tensor `index`'s data.
    pub fn resident(
        &self,
        copies: Arc<Copies>,
        file: Arc<Gguf>,
        index: usize,
        offset: usize,
        len: usize,
    ) {
        self.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Job::Resident {
                copies,
                file,
                index,
                offset,
                len,
            });
    }

    /// Starts the thread that makes the copies, in the order they were deferred (layer order),
    /// once the gate opens.
    pub fn start(self: &Arc<Self>, arena: Arc<Arena>) {
        let jobs = std::mem::take(&mut *self.jobs.lock().unwrap_or_else(|e| e.into_inner()));
        if jobs.is_empty() {
            self.done();
            return;
        }
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("infer-copies".into())
            .spawn(move || {
                {
                    let st = me.state.lock().unwrap_or_else(|e| e.into_inner());
                    let _ = me.changed.wait_timeout_while(st, GATE_TIMEOUT, |st| !st.0);
                }
                crate::trace::mark("copies start");
                // A failed copy (no memory for a mapping) leaves its matrix read from the file;
                // `done` must still come, or a benchmark's `wait` would wait for ever.
                let promoted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    promote(jobs, &arena)
                }));
                drop(promoted);
                crate::trace::mark("copies done");
                me.done();
            });
        // Without a thread the reads keep using the mapped files: slower, the same bytes.
        if spawned.is_err() {
            self.done();
        }
    }
}

enum Job {
    /// The packed copy from the pack file to huge pages.
    Packed(Arc<Copies>),
    /// A plain copy of `len` bytes at `offset` of tensor `index`'s data.
    Resident {
        copies: Arc<Copies>,
        file: Arc<Gguf>,
        index: usize,
        offset: usize,
        len: usize,
    },
}

enum State {
    /// No pack file for this load (disabled, too small, or the writer failed).
    Off,
    Reading {
        map: Arc<memmap2::Mmap>,
        table: HashMap<(usize, usize), (usize, usize)>,
    },
    /// No valid file: the copies packed at load, written out by [`PackFile::finish`].
    Writing {
        copies: Vec<(usize, usize, Arc<Copies>)>,
    },
}

/// The pack file of one model load (shared by the CPU backend and the loader).
pub struct PackFile {
    path: PathBuf,
    key: u64,
    state: Mutex<State>,
}

/// The key of a model file for this build's layouts and this CPU (see the module invariants).
fn key(model: &Path, g: &Gguf) -> Option<u64> {
    let mut s = String::new();
    let meta = |p: &Path, s: &mut String| -> Option<()> {
        let md = std::fs::metadata(p).ok()?;
        let mtime = md
            .modified()
            .ok()?
            .duration_since(std::time::UNIX_EPOCH)
            .ok()?;
        #[cfg(unix)]
        let ino = std::os::unix::fs::MetadataExt::ino(&md);
        #[cfg(not(unix))]
        let ino = 0u64;
        let abs = std::fs::canonicalize(p).ok()?;
        s.push_str(&format!(
            "{}|{}|{}|{}|",
            abs.display(),
            md.len(),
            mtime.as_nanos(),
            ino
        ));
        Some(())
    };
    meta(model, &mut s)?;
    s.push_str(&format!(
        "{:x}|{:?}|{}",
        g.fingerprint(),
        crate::kernels::cpu::simd::current(),
        env!("INFER_LAYOUT_HASH")
    ));
    Some(crate::format::checksum(s.as_bytes()))
}

impl PackFile {
    /// The pack file of `model` (already opened as `g`) under `dir`: mapped when a valid one is
    /// there, else a new one to write while the weights are packed. `None` where there is no
    /// key (unreadable metadata) or `dir` cannot be created.
    pub fn open(dir: &Path, model: &Path, g: &Gguf) -> Option<Arc<PackFile>> {
        let key = key(model, g)?;
        let name = model.file_name()?.to_string_lossy().into_owned();
        let path = dir.join(format!("{name}-{key:016x}.pack"));
        if let Some(state) = Self::read(&path, key) {
            return Some(Arc::new(PackFile {
                path,
                key,
                state: Mutex::new(state),
            }));
        }
        Some(Arc::new(PackFile {
            path,
            key,
            state: Mutex::new(State::Writing { copies: Vec::new() }),
        }))
    }

    /// Maps `path` and checks its footer and table against `key`.
    fn read(path: &Path, key: u64) -> Option<State> {
        let file = File::open(path).ok()?;
        // SAFETY: pack files are never written after their rename (module invariant), so the
        // mapped bytes do not change while mapped; every read below is bounds-checked.
        let map = unsafe { memmap2::Mmap::map(&file) }.ok()?;
        let n = map.len();
        if n < FOOTER || &map[n - 8..] != MAGIC {
            return None;
        }
        let word = |at: usize| u64::from_le_bytes(map[at..at + 8].try_into().expect("8 bytes"));
        if word(n - 16) != key {
            return None;
        }
        let table_len = usize::try_from(word(n - 24)).ok()?;
        let table_at = (n - FOOTER).checked_sub(table_len)?;
        let rows: Vec<[u64; 4]> = serde_json::from_slice(&map[table_at..n - FOOTER]).ok()?;
        let mut table = HashMap::with_capacity(rows.len());
        for [index, offset, len, at] in rows {
            let (len, at) = (usize::try_from(len).ok()?, usize::try_from(at).ok()?);
            if at.checked_add(len)? > table_at {
                return None;
            }
            table.insert((index as usize, offset as usize), (at, len));
        }
        Some(State::Reading {
            map: Arc::new(map),
            table,
        })
    }

    /// The packed copy of the `len` bytes at `offset` of tensor `index` in the mapped file, if
    /// it is there; it is moved to huge pages after the load ([`Self::finish`]).
    pub fn lookup(&self, index: usize, offset: usize, len: usize) -> Option<MappedRange> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let State::Reading { map, table, .. } = &*st else {
            return None;
        };
        let &(start, l) = table.get(&(index, offset))?;
        (l == len).then(|| MappedRange {
            map: Arc::clone(map),
            start,
            len,
        })
    }

    /// Whether the copies are read from a mapped pack file (so the plain ones can wait too).
    pub fn reading(&self) -> bool {
        matches!(
            *self.state.lock().unwrap_or_else(|e| e.into_inner()),
            State::Reading { .. }
        )
    }

    /// Notes the packed copy of `copies` (the matrix at `offset` of tensor `index`) for the file
    /// written once the load is done.
    pub fn record(&self, index: usize, offset: usize, copies: Arc<Copies>) {
        if let State::Writing { copies: all } =
            &mut *self.state.lock().unwrap_or_else(|e| e.into_inner())
        {
            all.push((index, offset, copies));
        }
    }

    /// Once every weight is loaded: writes the file when there is one to write and the model
    /// packs at least [`MIN_PACKED_BYTES`]. Returns what happened, for a note.
    pub fn finish(&self) -> Option<String> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let State::Writing { copies } = std::mem::replace(&mut *st, State::Off) else {
            return None;
        };
        let total: u64 = copies
            .iter()
            .filter_map(|(_, _, c)| c.packed())
            .map(|p| p.len() as u64)
            .sum();
        if total < min_packed_bytes() {
            return None;
        }
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = dir.join(format!("{name}.tmp-{}", std::process::id()));
        match self.write(dir, &tmp, &copies) {
            Ok(()) => {
                self.remove_stale();
                Some(format!(
                    "wrote the repacked weights to {} for the next start",
                    self.path.display()
                ))
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Some(format!("could not write {}: {e}", self.path.display()))
            }
        }
    }

    /// Writes `copies` and the footer to `tmp`, syncs it and renames it to the final name.
    fn write(
        &self,
        dir: &Path,
        tmp: &Path,
        copies: &[(usize, usize, Arc<Copies>)],
    ) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut out = BufWriter::with_capacity(1 << 22, File::create(tmp)?);
        let (mut pos, mut table) = (0u64, Vec::with_capacity(copies.len()));
        for (index, offset, c) in copies {
            let Some(bytes) = c.packed() else { continue };
            let pad = pos.next_multiple_of(ALIGN) - pos;
            out.write_all(&vec![0u8; pad as usize])?;
            out.write_all(bytes)?;
            let at = pos + pad;
            table.push([*index as u64, *offset as u64, bytes.len() as u64, at]);
            pos = at + bytes.len() as u64;
        }
        let json = serde_json::to_vec(&table)?;
        out.write_all(&json)?;
        out.write_all(&(json.len() as u64).to_le_bytes())?;
        out.write_all(&self.key.to_le_bytes())?;
        out.write_all(MAGIC)?;
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        std::fs::rename(tmp, &self.path)
    }

    /// Deletes the other pack files of the same model file name (older keys).
    fn remove_stale(&self) {
        let name = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let model = name.rsplit_once('-').map_or("", |(m, _)| m);
        remove_packs(
            self.path.parent().unwrap_or(Path::new(".")),
            model,
            Some(&self.path),
        );
    }
}

/// Deletes the pack files of model file name `model` in `dir` (but `keep`); returns how many.
pub fn remove_packs(dir: &Path, model: &str, keep: Option<&Path>) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        let ours = name
            .strip_prefix(model)
            .and_then(|r| r.strip_prefix('-'))
            .is_some_and(|r| {
                r.len() >= 16
                    && r[..16].bytes().all(|b| b.is_ascii_hexdigit())
                    && r[16..].starts_with(".pack")
            });
        if ours && Some(p.as_path()) != keep && std::fs::remove_file(&p).is_ok() {
            n += 1;
        }
    }
    n
}

/// Bytes copied between two releases of the source's pages: the resident set grows by about
/// this much, not by a whole matrix (Qwen2.5-1.5B's output matrix is 191 MB).
const PIECE: usize = 8 << 20;

/// Copies `src` to a new huge-page region piece by piece, releasing each piece's source pages
/// (`release`) once copied.
pub(crate) fn copy_releasing(arena: &Arena, src: &[u8], release: impl Fn(&[u8])) -> Region {
    arena.alloc(src.len(), |out| {
        for (o, i) in out.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
            o.copy_from_slice(i);
            release(i);
        }
    })
}

/// Moves each deferred copy onto huge pages, publishing it before releasing (again: a reader may
/// have mapped pages back while it was copied) the pages it was read from.
fn promote(jobs: Vec<Job>, arena: &Arena) {
    for job in jobs {
        match job {
            Job::Packed(c) => {
                let Some(m) = &c.mapped else { continue };
                let region = copy_releasing(arena, m.bytes(), |piece| m.release_part(piece));
                let _ = c.packed.set(region);
                m.release_part(m.bytes());
            }
            Job::Resident {
                copies,
                file,
                index,
                offset,
                len,
            } => {
                let src = &file.tensor_data(&file.tensors[index])[offset..offset + len];
                /// Clears `moving` however the copy ends (a panic included).
                struct Moving<'a>(&'a AtomicBool);
                impl Drop for Moving<'_> {
                    fn drop(&mut self) {
                        self.0.store(false, Ordering::Release);
                    }
                }
                let _moving = (len >= HOLD_BYTES).then(|| {
                    copies.moving.store(true, Ordering::Release);
                    Moving(&copies.moving)
                });
                let region = copy_releasing(arena, src, |piece| file.release(piece));
                let _ = copies.resident.set(region);
                file.release(src);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_packs_are_matched_by_model_name_only() {
        let dir = std::env::temp_dir().join(format!("infer-packs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let names = [
            "m.gguf-0123456789abcdef.pack",
            "m.gguf-fedcba9876543210.pack",
            "m.gguf-fedcba9876543210.pack.tmp-12",
            "mm.gguf-0123456789abcdef.pack",
            "m.gguf",
        ];
        for n in names {
            std::fs::write(dir.join(n), b"x").unwrap();
        }
        let keep = dir.join(names[0]);
        assert_eq!(remove_packs(&dir, "m.gguf", Some(&keep)), 2);
        assert!(keep.exists() && dir.join(names[3]).exists() && dir.join(names[4]).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
