//! The CPU implementation of `model::Backend`. Weights stay zero-copy views into the memory-mapped
//! file; activations are plain `Vec<f32>`; the KV cache is paged f16 storage on huge pages
//! ([`KvPlane`]; f32 for models computed in f32, see `attention::f32_cache`; Q8_0/Q4_0 blocks with
//! `--cache-type-k/v`, see `attention::quant_cache`). Every op that touches a matrix
//! splits its output rows across the persistent thread pool; no op allocates per row.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Result};
use half::slice::HalfFloatSliceExt;

use crate::format::{GgmlType, Gguf};
use crate::kernels::cpu::attention;
use crate::kernels::cpu::attention::f32_cache::{self, KvF32};
use crate::kernels::cpu::attention::quant_cache::{self, KvQuant};
use crate::kernels::cpu::fused;
use crate::kernels::cpu::fused::ffn;
use crate::kernels::cpu::layouts::pack_file::{copy_releasing, Copies, Deferred, PackFile};
use crate::kernels::cpu::layouts::q4_k_x8;
use crate::kernels::cpu::layouts::q5_0_x16;
use crate::kernels::cpu::layouts::q6_k_x16;
use crate::kernels::cpu::layouts::q6_k_x4;
use crate::kernels::cpu::layouts::q8_0_x16;
use crate::kernels::cpu::matmul;
use crate::kernels::cpu::memory::hugebuf::{Arena, Region};
use crate::kernels::cpu::memory::kv_plane::{self, KvPlane};
use crate::kernels::cpu::ops;
use crate::kernels::cpu::ops::rope::RopeTables;
use crate::kernels::cpu::threads::pool::ThreadPool;
use crate::model::backend::{
    attention_block_steps, ffn_dense_steps, then_join, AttnBatch, AttnBlock, AttnQuery,
    AttnScratch, AttnShape, Backend, HeadCopy, Join, KvType, MatmulJob, Rope, WeightSource,
};
use crate::model::config::Activation;

/// A weight matrix: its bytes in the mapped file, and the copy on huge pages the matmuls read (see
/// `load_matrix`).
pub struct CpuWeight {
    file: Arc<Gguf>,
    index: usize,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    /// Where the matrix starts in the tensor's data (a row range of a fused or stacked tensor).
    offset: usize,
    /// The repacked copy a matmul reads instead of the file's bytes: the x8 layout of a Q4_K
    /// matrix (`q4_k_x8`, every matmul), the x16 or x4 layout of a Q6_K one (`q6_k_x16`,
    /// `q6_k_x4`: decode and GEMM) or the x16 layout of a Q5_0 one (`q5_0_x16`: decode only, next
    /// to the plain copy), built at load, read from a pack file (`pack_file`) or built on first
    /// use; and, for the matmul weights that have no repacked copy, a plain copy of the matrix on
    /// huge pages that every read uses instead of the file once it is there. Embedding lookups
    /// always read the file.
    copies: Arc<Copies>,
    /// Where the copies live (shared by all the backend's weights).
    arena: Arc<Arena>,
}

impl CpuWeight {
    /// The matrix in the file's layout: the plain huge-page copy where there is one, else the
    /// mapped file's bytes.
    pub fn bytes(&self) -> &[u8] {
        if let Some(r) = self.copies.resident_or_wait() {
            return r;
        }
        let data = self.file.tensor_data(&self.file.tensors[self.index]);
        &data[self.offset..self.offset + self.rows * self.row_bytes]
    }

    /// Drops the file's pages of a matrix that has a packed copy from the resident set, after a
    /// matmul read the file instead (a prompt under eight tokens or a row-invariant verify reads
    /// Q6_K rows from the file): the next such read maps them back from the page cache, and
    /// meanwhile the process holds the matrix once, not twice (Qwen2.5-1.5B: its Q6_K matrices
    /// are about 300 MB). A no-op for other matrices.
    pub fn release_file_pages(&self) {
        if self.copies.resident.get().is_none() && self.copies.packed().is_some() {
            let data = self.file.tensor_data(&self.file.tensors[self.index]);
            self.file
                .release(&data[self.offset..self.offset + self.rows * self.row_bytes]);
        }
    }

    /// The packed copy where there is one already (huge pages, else a pack file), else `pack`'s,
    /// kept on huge pages.
    fn packed_or(&self, pack: impl FnOnce() -> Region) -> &[u8] {
        if let Some(p) = self.copies.packed() {
            return p;
        }
        self.copies.packed.get_or_init(pack)
    }

    /// The x8-packed Q4_K bytes, packing on first use; `None` for other types and shapes.
    pub fn packed_q4k(&self, pool: &ThreadPool) -> Option<&[u8]> {
        if self.ty != GgmlType::Q4K || !q4_k_x8::packable(self.rows, self.cols) {
            return None;
        }
        Some(self.packed_or(|| {
            self.arena.alloc(self.bytes().len(), |out| {
                q4_k_x8::pack_into(pool, self.bytes(), self.rows, self.cols, out)
            })
        }))
    }

    /// The x16-packed Q5_0 bytes for decode (`q5_0_x16`, next to the plain copy that prefill
    /// reads), packing on first use; `None` for other types and shapes and below the AVX-512 level.
    pub fn packed_q5_0(&self, pool: &ThreadPool) -> Option<&[u8]> {
        if self.ty != GgmlType::Q5_0 || !q5_0_x16::applies(self.rows, self.cols) {
            return None;
        }
        Some(self.packed_or(|| {
            self.arena.alloc(self.bytes().len(), |out| {
                q5_0_x16::pack_into(pool, self.bytes(), self.rows, self.cols, out)
            })
        }))
    }

    /// The x16-packed Q8_0 bytes for decode (`q8_0_x16`, instead of a plain copy: prefill and
    /// embedding lookups read the mapped file), packing on first use; `None` for other types and
    /// shapes and below the AVX-512 level.
    pub fn packed_q8_0(&self, pool: &ThreadPool) -> Option<&[u8]> {
        if self.ty != GgmlType::Q8_0 || !q8_0_x16::applies(self.rows, self.cols) {
            return None;
        }
        Some(self.packed_or(|| {
            self.arena.alloc(self.bytes().len(), |out| {
                q8_0_x16::pack_into(pool, self.bytes(), self.rows, self.cols, out)
            })
        }))
    }

    /// Where this matrix's Q6_K decode copy keeps its blocks ([`q6_k_x16::Layout::File`]: no
    /// copy, for other types and shapes and where this CPU has no x4 or x16 kernel).
    pub fn q6k_layout(&self) -> q6_k_x16::Layout {
        use q6_k_x16::Layout;
        if self.ty != GgmlType::Q6K {
            Layout::File
        } else if q6_k_x16::applies(self.rows, self.cols) {
            Layout::X16
        } else if q6_k_x4::packable(self.rows, self.cols)
            && crate::kernels::cpu::simd::dot_x4(self.ty).is_some()
        {
            Layout::X4
        } else {
            Layout::File
        }
    }

    /// The packed Q6_K bytes for decode (x16 units at the AVX-512 level, else x4 groups; see
    /// [`Self::q6k_layout`]), packing on first use; `None` where there is no copy.
    pub fn packed_q6k(&self, pool: &ThreadPool) -> Option<&[u8]> {
        let layout = self.q6k_layout();
        if layout == q6_k_x16::Layout::File {
            return None;
        }
        Some(self.packed_or(|| {
            self.arena.alloc(self.bytes().len(), |out| {
                let (src, rows, cols) = (self.bytes(), self.rows, self.cols);
                if layout == q6_k_x16::Layout::X16 {
                    q6_k_x16::pack_into(pool, src, rows, cols, out)
                } else {
                    q6_k_x4::pack_into(pool, src, rows, cols, out)
                }
            })
        }))
    }
}

/// Row-major activation matrix.
#[derive(Clone, Debug, Default)]
pub struct CpuAct {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl CpuAct {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }
}

/// Paged KV storage: per layer, `n_blocks * block_size` slots of `kv_dim` f16 values for K and V.
pub struct CpuKv {
    pub k: KvPlane, // (n_layer, n_blocks * block_size * kv_dim)
    pub v: KvPlane, // (n_layer, n_blocks * block_size * kv_dim)
    pub block_size: usize,
    pub kv_dim: usize,
    /// The f32 storage instead (`k` and `v` are then empty), for `KvType::F32`.
    pub f32: Option<KvF32>,
    /// The quantized storage instead (`k` and `v` are then empty), for `KvType::Quant`.
    pub quant: Option<KvQuant>,
    /// Whether `k` and `v` were advised onto huge pages ([`KvPlane::advise_huge`]).
    pub huge: bool,
}

impl CpuKv {
    /// Moves the f16 planes onto huge pages once a write reaches [`kv_plane::HUGE_FROM_SLOT`].
    pub fn note_slots(&mut self, slots: &[usize]) {
        if !self.huge && slots.iter().any(|&s| s >= kv_plane::HUGE_FROM_SLOT) {
            self.k.advise_huge();
            self.v.advise_huge();
            self.huge = true;
        }
    }

    /// Copies whole blocks (`(from, to)` pairs) in `layers` of the f16 planes, or in every layer
    /// of the f32 storage.
    pub fn copy_blocks(&mut self, pairs: &[(u32, u32)], layers: std::ops::Range<usize>) {
        let n = self.block_size * self.kv_dim;
        for &(from, to) in pairs {
            let (from, to) = (from as usize * n, to as usize * n);
            if let Some(kv32) = &mut self.f32 {
                kv32.copy(from, to, n);
                continue;
            }
            if let Some(kq) = &mut self.quant {
                let bs = self.block_size;
                kq.copy(from / n * bs, to / n * bs, bs);
                continue;
            }
            for l in layers.clone() {
                self.k[l].copy_within(from..from + n, to);
                self.v[l].copy_within(from..from + n, to);
            }
        }
    }
}

impl CpuKv {
    /// Values per block in one layer's K (or V).
    fn block_values(&self) -> usize {
        self.block_size * self.kv_dim
    }

    /// Bytes of one block: every layer's K and V.
    fn block_bytes(&self) -> usize {
        if let Some(kq) = &self.quant {
            return kq.layers() * self.block_size * (kq.k_row + kq.v_row);
        }
        let (layers, width) = match &self.f32 {
            Some(k32) => (k32.k.len(), 4),
            None => (self.k.layers(), 2),
        };
        2 * layers * self.block_values() * width
    }

    /// [`Backend::kv_export`]: per block, per layer, K's values then V's, little-endian.
    pub fn export(&self, blocks: &[u32]) -> Vec<u8> {
        let n = self.block_values();
        let mut out = Vec::with_capacity(blocks.len() * self.block_bytes());
        for &b in blocks {
            if let Some(kq) = &self.quant {
                let bs = self.block_size;
                let (kr, vr) = (kq.k_row * bs, kq.v_row * bs);
                for (k, v) in kq.k.iter().zip(&kq.v) {
                    out.extend_from_slice(&k[b as usize * kr..(b as usize + 1) * kr]);
                    out.extend_from_slice(&v[b as usize * vr..(b as usize + 1) * vr]);
                }
                continue;
            }
            let r = b as usize * n..(b as usize + 1) * n;
            match &self.f32 {
                Some(k32) => {
                    for (k, v) in k32.k.iter().zip(&k32.v) {
                        for x in k[r.clone()].iter().chain(&v[r.clone()]) {
                            out.extend_from_slice(&x.to_le_bytes());
                        }
                    }
                }
                None => {
                    for l in 0..self.k.layers() {
                        for x in self.k[l][r.clone()].iter().chain(&self.v[l][r.clone()]) {
                            out.extend_from_slice(&x.to_le_bytes());
                        }
                    }
                }
            }
        }
        out
    }

    /// [`Backend::kv_shift`]: each key of `slots` in `layer` rotated by `-delta` positions, head
    /// by head, through f32 (an f16 cache is rounded once more; a quantized one is dequantized,
    /// rotated and quantized again, its blocks' rounding redone once).
    pub fn shift_keys(
        &mut self,
        layer: usize,
        slots: &[usize],
        delta: u32,
        rope: Rope,
        ff: Option<&[f32]>,
    ) {
        let hd = rope.head_dim;
        let mut table = vec![0f32; hd];
        match ff {
            Some(ff) => ops::rope_cache_scaled(delta, rope.base, hd, ff, &mut table),
            None => ops::rope_cache(delta, rope.base, hd, &mut table),
        }
        // cos(-a) = cos(a), sin(-a) = -sin(a)
        table.iter_mut().skip(1).step_by(2).for_each(|s| *s = -*s);
        let d = self.kv_dim;
        let mut row = vec![0f32; d];
        for &slot in slots {
            if let Some(kq) = &mut self.quant {
                kq.key(layer, slot, &mut row);
                for head in row.chunks_exact_mut(hd) {
                    ops::rope_head(head, &table, rope.style);
                }
                kq.set_key(layer, slot, &row);
                continue;
            }
            let r = slot * d..(slot + 1) * d;
            match &mut self.f32 {
                Some(k32) => {
                    for head in k32.k[layer][r].chunks_exact_mut(hd) {
                        ops::rope_head(head, &table, rope.style);
                    }
                }
                None => {
                    let keys = &mut self.k[layer][r];
                    keys.convert_to_f32_slice(&mut row);
                    for head in row.chunks_exact_mut(hd) {
                        ops::rope_head(head, &table, rope.style);
                    }
                    keys.convert_from_f32_slice(&row);
                }
            }
        }
    }

    /// [`Backend::kv_import`]: the inverse of [`CpuKv::export`] for the same blocks count.
    pub fn import(&mut self, blocks: &[u32], bytes: &[u8]) -> Result<()> {
        let per_block = self.block_bytes();
        if bytes.len() != blocks.len() * per_block {
            bail!(
                "saved KV has {} bytes, {} blocks of this cache take {}",
                bytes.len(),
                blocks.len(),
                blocks.len() * per_block
            );
        }
        let n = self.block_values();
        for (&b, src) in blocks.iter().zip(bytes.chunks_exact(per_block)) {
            if let Some(kq) = &mut self.quant {
                let bs = self.block_size;
                let (kr, vr) = (kq.k_row * bs, kq.v_row * bs);
                let mut at = 0;
                for (k, v) in kq.k.iter_mut().zip(kq.v.iter_mut()) {
                    k[b as usize * kr..(b as usize + 1) * kr].copy_from_slice(&src[at..at + kr]);
                    at += kr;
                    v[b as usize * vr..(b as usize + 1) * vr].copy_from_slice(&src[at..at + vr]);
                    at += vr;
                }
                continue;
            }
            let r = b as usize * n..(b as usize + 1) * n;
            match &mut self.f32 {
                Some(k32) => {
                    let mut vals = src
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                    for (k, v) in k32.k.iter_mut().zip(k32.v.iter_mut()) {
                        for x in k[r.clone()].iter_mut().chain(v[r.clone()].iter_mut()) {
                            *x = vals.next().expect("sized above");
                        }
                    }
                }
                None => {
                    let mut vals = src
                        .chunks_exact(2)
                        .map(|c| half::f16::from_le_bytes([c[0], c[1]]));
                    for l in 0..self.k.layers() {
                        for x in self.k[l][r.clone()].iter_mut() {
                            *x = vals.next().expect("sized above");
                        }
                        for x in self.v[l][r.clone()].iter_mut() {
                            *x = vals.next().expect("sized above");
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// A raw pointer to f32 data shared across the pool's threads, each writing disjoint elements.
#[derive(Clone, Copy)]
struct SharedF32(*mut f32);
// SAFETY: users write disjoint ranges and the pool joins before the data is read again.
unsafe impl Sync for SharedF32 {}
unsafe impl Send for SharedF32 {}
impl SharedF32 {
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

pub struct CpuBackend {
    pub pool: ThreadPool,
    /// See `Backend::set_row_invariant`.
    row_invariant: AtomicBool,
    /// The huge-page slabs that hold the weights' packed and plain copies.
    arena: Arc<Arena>,
    /// RoPE cos/sin tables shared by the layers of a pass.
    pub(super) rope_tables: RopeTables,
    /// Vectors given back by `recycle`, for `act_for_overwrite` (at most [`SPARE_BUFFERS`]).
    spare: Mutex<Vec<Vec<f32>>>,
    /// The pack file the weights' packed copies are read from or written to, if any.
    pack_file: Option<Arc<PackFile>>,
    /// With a pack file: the copies left to a background thread after the load.
    deferred: Option<Arc<Deferred>>,
}

/// Recycled vectors kept at once (a decode loop gives back one logits row per step).
const SPARE_BUFFERS: usize = 2;

/// Elements per piece of the element-wise ops when they are split across threads.
const ELEMWISE_CHUNK: usize = 4096;
/// Below this many elements an element-wise or row-wise op runs on the calling thread alone (a
/// dispatch costs more than it saves; this keeps decode's small ops serial).
const PAR_MIN: usize = 16 * 1024;

impl CpuBackend {
    pub fn new(n_threads: usize) -> CpuBackend {
        CpuBackend {
            pool: ThreadPool::new(n_threads.max(1)),
            row_invariant: AtomicBool::new(false),
            arena: Arc::new(Arena::default()),
            rope_tables: RopeTables::default(),
            spare: Mutex::new(Vec::new()),
            pack_file: None,
            deferred: None,
        }
    }

    /// Waits until the copies deferred at load are made (benchmarks measure the steady state).
    pub fn wait_copies(&self) {
        if let Some(d) = &self.deferred {
            d.wait();
        }
    }

    /// Fast start: loads the weights' packed copies from `pf` where it has them (writing those it
    /// packs to it), and leaves the huge-page copies that can wait to a background thread; the
    /// caller calls [`PackFile::finish`] and [`Deferred::start`] (on the returned handle, with
    /// [`Self::arena`]) once the weights are loaded.
    pub fn set_pack_file(&mut self, pf: Arc<PackFile>) -> Arc<Deferred> {
        self.pack_file = Some(pf);
        let d = Arc::new(Deferred::default());
        self.deferred = Some(Arc::clone(&d));
        d
    }

    /// The huge-page arena the weights' copies live in.
    pub fn arena(&self) -> Arc<Arena> {
        Arc::clone(&self.arena)
    }

    /// Runs `f(i, piece)` for every piece `i` of `data` cut into `chunk`-element pieces (the last
    /// may be shorter), across the pool when `data` is large enough. Each piece is handed to
    /// exactly one call.
    fn par_chunks(&self, data: &mut [f32], chunk: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
        let len = data.len();
        let pieces = len.div_ceil(chunk.max(1));
        if len < PAR_MIN || pieces < 2 {
            data.chunks_mut(chunk.max(1))
                .enumerate()
                .for_each(|(i, c)| f(i, c));
            return;
        }
        let p = SharedF32(data.as_mut_ptr());
        self.pool.for_range(pieces, 1, |range| {
            for i in range {
                let (lo, hi) = (i * chunk, ((i + 1) * chunk).min(len));
                // SAFETY: piece i is elements lo..hi of `data`, disjoint from every other piece
                // and handed to one call only; the pool joins before `data` is used again.
                let c = unsafe { std::slice::from_raw_parts_mut(p.ptr().add(lo), hi - lo) };
                f(i, c);
            }
        });
    }
}

impl Backend for CpuBackend {
    type Weight = CpuWeight;
    type Vector = Vec<f32>;
    type Act = CpuAct;
    type Kv = CpuKv;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn set_row_invariant(&self, on: bool) {
        self.row_invariant.store(on, Ordering::Relaxed);
    }

    fn load_weight(&self, src: &WeightSource<'_>) -> Result<CpuWeight> {
        if !matmul::supported(src.ty) {
            bail!(
                "tensor type {} is not supported by the CPU backend yet",
                src.ty.name()
            );
        }
        let Some(row_bytes) = src.ty.row_bytes(src.cols) else {
            bail!(
                "row length {} is not a multiple of the {} block size {}",
                src.cols,
                src.ty.name(),
                src.ty.block_size()
            );
        };
        if row_bytes * src.rows != src.bytes.len() {
            bail!(
                "{} bytes for a {}x{} {} matrix, expected {}",
                src.bytes.len(),
                src.rows,
                src.cols,
                src.ty.name(),
                row_bytes * src.rows
            );
        }
        let data = src.file.tensor_data(&src.file.tensors[src.index]);
        let Some(offset) = (src.bytes.as_ptr() as usize)
            .checked_sub(data.as_ptr() as usize)
            .filter(|o| data.len().checked_sub(*o) >= Some(src.bytes.len()))
        else {
            bail!(
                "the bytes of `{}` are not inside its tensor's data",
                src.name
            );
        };
        let copies = Arc::new(Copies {
            mapped: self
                .pack_file
                .as_ref()
                .and_then(|pf| pf.lookup(src.index, offset, src.bytes.len())),
            ..Copies::default()
        });
        let w = CpuWeight {
            file: Arc::clone(src.file),
            index: src.index,
            ty: src.ty,
            rows: src.rows,
            cols: src.cols,
            row_bytes,
            offset,
            copies,
            arena: Arc::clone(&self.arena),
        };
        // Repack now, so that the cost shows in the load time rather than in the first prompt;
        // an embedding table only where it is also the output head (no `output.weight`). With a
        // pack file the copies come from it instead, and move to huge pages in the background.
        let lookup_only =
            src.name == "token_embd.weight" && src.file.tensor("output.weight").is_some();
        let pf = self.pack_file.as_deref();
        if !lookup_only {
            // Q4_K: every matmul reads the x8 copy. Q6_K: decode and the prefill GEMM read the x4
            // copy; the file's pages come back only for a row-invariant verify, a prompt under
            // eight tokens or a ragged last group. Q8_0 (at the AVX-512 level): decode reads the
            // x16 copy, prefill and embedding lookups the file's pages. Other types: a plain copy
            // on huge pages, which every read then uses (Gemma-3 270M decode, Q8_0/Q5_0: 80 -> 90
            // t/s).
            let keep = |_: &[u8]| match (pf, &self.deferred) {
                (Some(_), Some(d)) if w.copies.mapped.is_some() => d.packed(Arc::clone(&w.copies)),
                (Some(pf), _) => pf.record(w.index, w.offset, Arc::clone(&w.copies)),
                _ => {}
            };
            if let Some(p) = w
                .packed_q4k(&self.pool)
                .or_else(|| w.packed_q6k(&self.pool))
                .or_else(|| w.packed_q8_0(&self.pool))
            {
                keep(p);
                w.file.release(w.bytes());
            } else if let Some(d) = self.deferred.as_ref() {
                // With a pack file (read or being written): Q5_0's x16 copy from it (or packed
                // now from the file's bytes, the same as the plain copy's), the plain copy in the
                // background once the first logits are out (`Deferred`). Made now, Gemma-3 270M's
                // plain copies (230 MB on AVX2) took 0.15-0.30 s of its first token on the
                // development VM; made in the background from the load on, they competed with
                // the first forward pass for the two cores (0.40 s to the first token against
                // 0.32).
                if let Some(p) = w.packed_q5_0(&self.pool) {
                    keep(p);
                }
                d.resident(
                    Arc::clone(&w.copies),
                    Arc::clone(&w.file),
                    w.index,
                    w.offset,
                    w.bytes().len(),
                );
            } else {
                // Piece by piece, releasing the file's pages behind: the process holds the matrix
                // about once, not twice (Gemma-3's 178 MB embedding and output head).
                let copy = copy_releasing(&self.arena, w.bytes(), |piece| w.file.release(piece));
                w.file.release(w.bytes());
                let _ = w.copies.resident.set(copy);
                // Q5_0 decode reads an x16 copy besides (from the plain one).
                if let Some(p) = w.packed_q5_0(&self.pool) {
                    keep(p);
                }
            }
        }
        Ok(w)
    }

    fn load_vector(&self, data: &[f32]) -> Result<Vec<f32>> {
        Ok(data.to_vec())
    }

    fn alloc_kv(
        &self,
        n_layer: usize,
        n_blocks: usize,
        block_size: usize,
        kv_dim: usize,
        head_dim: usize,
        kv_type: KvType,
    ) -> Result<CpuKv> {
        let per_layer = n_blocks
            .checked_mul(block_size)
            .and_then(|v| v.checked_mul(kv_dim))
            .ok_or_else(|| anyhow::anyhow!("KV cache size overflows"))?;
        let empty = || CpuKv {
            k: KvPlane::zeroed(0, 0),
            v: KvPlane::zeroed(0, 0),
            block_size,
            kv_dim,
            f32: None,
            quant: None,
            huge: false,
        };
        match kv_type {
            KvType::F32 => Ok(CpuKv {
                f32: Some(KvF32::new(n_layer, per_layer)),
                ..empty()
            }),
            KvType::Quant { k, v } => Ok(CpuKv {
                quant: Some(KvQuant::new(
                    n_layer,
                    n_blocks * block_size,
                    kv_dim,
                    head_dim,
                    k,
                    v,
                )?),
                ..empty()
            }),
            KvType::F16 => Ok(CpuKv {
                k: KvPlane::zeroed(n_layer, per_layer),
                v: KvPlane::zeroed(n_layer, per_layer),
                ..empty()
            }),
        }
    }

    fn act(&self, rows: usize, cols: usize) -> CpuAct {
        CpuAct {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        }
    }

    fn rows(&self, x: &CpuAct) -> usize {
        x.rows
    }

    fn embed(&self, table: &CpuWeight, tokens: &[u32], scale: f32, out: &mut CpuAct) {
        let bytes = table.bytes();
        for (i, &t) in tokens.iter().enumerate() {
            let row = &bytes[t as usize * table.row_bytes..(t as usize + 1) * table.row_bytes];
            let dst = &mut out.data[i * out.cols..(i + 1) * out.cols];
            crate::quant::dequantize_row(table.ty, row, dst)
                .expect("embedding type checked at load");
            if scale != 1.0 {
                dst.iter_mut().for_each(|v| *v *= scale);
            }
        }
    }

    fn rms_norm(&self, x: &CpuAct, w: &Vec<f32>, eps: f32, out: &mut CpuAct) {
        let n = w.len();
        self.par_chunks(&mut out.data, n, |i, ys| {
            ops::rms_norm(&x.data[i * n..(i + 1) * n], w, eps, ys)
        });
    }

    fn rms_norm_inplace(&self, x: &mut CpuAct, w: &Vec<f32>, eps: f32) {
        let n = w.len();
        self.par_chunks(&mut x.data, n, |_, xs| ops::rms_norm_inplace(xs, w, eps));
    }

    fn matmul(&self, w: &CpuWeight, x: &CpuAct, bias: Option<&Vec<f32>>, out: &mut CpuAct) {
        self.matmul_many(x, &mut [(w, bias, out)]);
    }

    fn matmul_many(&self, x: &CpuAct, jobs: &mut [MatmulJob<'_, Self>]) {
        let inv = self.row_invariant.load(Ordering::Relaxed);
        fn b<'a>(b: &Option<&'a Vec<f32>>) -> Option<&'a [f32]> {
            b.map(Vec::as_slice)
        }
        // Up to three jobs (Q/K/V) on the stack: a decode step calls this between two parallel
        // regions, where an allocation's lines come cold from memory.
        match jobs {
            [(w, b0, o)] => {
                matmul::matmul_many(&self.pool, x, &mut [(*w, &mut **o)], &[b(b0)], inv);
            }
            [(w0, b0, o0), (w1, b1, o1)] => {
                let mut mm = [(*w0, &mut **o0), (*w1, &mut **o1)];
                matmul::matmul_many(&self.pool, x, &mut mm, &[b(b0), b(b1)], inv);
            }
            [(w0, b0, o0), (w1, b1, o1), (w2, b2, o2)] => {
                let mut mm = [(*w0, &mut **o0), (*w1, &mut **o1), (*w2, &mut **o2)];
                matmul::matmul_many(&self.pool, x, &mut mm, &[b(b0), b(b1), b(b2)], inv);
            }
            _ => {
                let biases: Vec<Option<&[f32]>> = jobs.iter().map(|(_, bj, _)| b(bj)).collect();
                let mut mm: Vec<(&CpuWeight, &mut CpuAct)> =
                    jobs.iter_mut().map(|(w, _, o)| (*w, &mut **o)).collect();
                matmul::matmul_many(&self.pool, x, &mut mm, &biases, inv);
            }
        }
    }

    fn rope(&self, x: &mut CpuAct, positions: &[u32], rope: Rope, ff: Option<&Vec<f32>>) {
        let (cols, hd) = (x.cols, rope.head_dim);
        let ff = ff.map(Vec::as_slice);
        let table = self
            .rope_tables
            .get(&self.pool, positions, rope.base, hd, ff);
        self.par_chunks(&mut x.data, cols, |i, row| {
            let cache = &table[i * hd..(i + 1) * hd];
            for head in row.chunks_exact_mut(hd) {
                ops::rope_head(head, cache, rope.style);
            }
        });
    }

    fn scale(&self, x: &mut CpuAct, s: f32) {
        self.par_chunks(&mut x.data, ELEMWISE_CHUNK, |_, c| {
            c.iter_mut().for_each(|v| *v *= s)
        });
    }

    fn add(&self, x: &mut CpuAct, y: &CpuAct) {
        assert_eq!(x.data.len(), y.data.len(), "add: shapes differ");
        self.par_chunks(&mut x.data, ELEMWISE_CHUNK, |i, c| {
            let ys = &y.data[i * ELEMWISE_CHUNK..i * ELEMWISE_CHUNK + c.len()];
            c.iter_mut().zip(ys).for_each(|(a, b)| *a += b)
        });
    }

    fn glu(&self, gate: &mut CpuAct, up: &CpuAct, act: Activation) {
        // Row by row: ggml's vectorised GLU handles each row's tail (past the last multiple of 16)
        // separately, so a row is split across threads only at multiples of 16.
        let c = gate.cols;
        let piece = if gate.rows == 1 {
            c.div_ceil(64) * 16
        } else {
            c
        };
        let per_row = c.div_ceil(piece);
        let g = SharedF32(gate.data.as_mut_ptr());
        self.pool.for_range(gate.rows * per_row, 1, |range| {
            for i in range {
                let (r, k) = (i / per_row, i % per_row);
                let (lo, hi) = (r * c + k * piece, r * c + ((k + 1) * piece).min(c));
                // SAFETY: piece i covers elements lo..hi of row r, inside `gate.data` and disjoint
                // from every other piece; the pool joins before `gate` is used again.
                let gs = unsafe { std::slice::from_raw_parts_mut(g.ptr().add(lo), hi - lo) };
                ops::glu(gs, &up.data[lo..hi], act);
            }
        });
    }

    fn ffn_dense(
        &self,
        h: &CpuAct,
        ws: (&CpuWeight, &CpuWeight, &CpuWeight),
        act: Activation,
        gate: &mut CpuAct,
        up: &mut CpuAct,
        out: &mut CpuAct,
        join: Option<Join<'_, Self>>,
    ) {
        if !ffn::decode(&self.pool, h, ws, act, gate, up, out) {
            ffn_dense_steps(self, h, ws, act, gate, up, out);
        }
        then_join(self, join, out)
    }

    fn kv_copy_blocks(&self, kv: &mut CpuKv, pairs: &[(u32, u32)]) {
        let layers = 0..kv.k.layers();
        kv.copy_blocks(pairs, layers);
    }

    fn kv_export(&self, kv: &CpuKv, blocks: &[u32]) -> Result<Vec<u8>> {
        Ok(kv.export(blocks))
    }

    fn kv_import(&self, kv: &mut CpuKv, blocks: &[u32], bytes: &[u8]) -> Result<()> {
        kv.import(blocks, bytes)
    }

    fn kv_shift(
        &self,
        kv: &mut CpuKv,
        layer: usize,
        slots: &[usize],
        delta: u32,
        rope: Rope,
        ff: Option<&Vec<f32>>,
    ) -> Result<()> {
        kv.shift_keys(layer, slots, delta, rope, ff.map(Vec::as_slice));
        Ok(())
    }

    fn kv_write(&self, kv: &mut CpuKv, layer: usize, k: &CpuAct, v: &CpuAct, slots: &[usize]) {
        if let Some(kv32) = &mut kv.f32 {
            return kv32.write(layer, k, v, slots);
        }
        if let Some(kq) = &mut kv.quant {
            return kq.write(layer, k, v, slots);
        }
        kv.note_slots(slots);
        let d = kv.kv_dim;
        for (i, &slot) in slots.iter().enumerate() {
            kv.k[layer][slot * d..(slot + 1) * d].convert_from_f32_slice(k.row(i));
            kv.v[layer][slot * d..(slot + 1) * d].convert_from_f32_slice(v.row(i));
        }
    }

    fn attention_block(
        &self,
        h: &CpuAct,
        blk: &AttnBlock<'_, Self>,
        kv: &mut CpuKv,
        layer: usize,
        batch: &AttnBatch<'_, '_>,
        s: AttnScratch<'_, Self>,
        out: &mut CpuAct,
        join: Option<Join<'_, Self>>,
    ) {
        kv.note_slots(batch.slots);
        if let Err(s) = fused::attention::decode(self, h, blk, kv, layer, batch, s, out) {
            attention_block_steps(self, h, blk, kv, layer, batch, s, out);
        }
        then_join(self, join, out)
    }

    fn attention(
        &self,
        q: &CpuAct,
        kv: &CpuKv,
        layer: usize,
        queries: &[AttnQuery<'_>],
        shape: AttnShape,
        out: &mut CpuAct,
    ) {
        if let Some(kv32) = &kv.f32 {
            let bs = kv.block_size;
            return f32_cache::attention(&self.pool, q, kv32, layer, bs, queries, shape, out);
        }
        let invariant = self.row_invariant.load(Ordering::Relaxed);
        if let Some(kq) = &kv.quant {
            let (bs, isa) = (kv.block_size, quant_cache::Isa::current());
            return quant_cache::attention(
                &self.pool, q, kq, layer, bs, queries, shape, out, isa, invariant,
            );
        }
        attention::attention(&self.pool, q, kv, layer, queries, shape, out, invariant);
    }

    fn copy_heads(&self, src: &CpuAct, dst: &mut CpuAct, c: HeadCopy) {
        ops::copy_heads(&src.data, src.cols, &mut dst.data, dst.cols, c);
    }

    fn add_rows_scaled(&self, x: &mut CpuAct, y: &CpuAct, rows: &[usize], scales: &[f32]) {
        for ((i, &r), &s) in rows.iter().enumerate().zip(scales) {
            let xs = &mut x.data[r * x.cols..(r + 1) * x.cols];
            xs.iter_mut().zip(y.row(i)).for_each(|(a, &b)| *a += s * b);
        }
    }

    fn gather_rows(&self, x: &CpuAct, rows: &[usize]) -> CpuAct {
        let mut data = Vec::with_capacity(rows.len() * x.cols);
        for &r in rows {
            data.extend_from_slice(x.row(r));
        }
        CpuAct {
            data,
            rows: rows.len(),
            cols: x.cols,
        }
    }

    fn to_host(&self, x: &CpuAct) -> Vec<f32> {
        x.data.clone()
    }

    fn take_host(&self, x: CpuAct) -> Vec<f32> {
        // The logits of a forward pass: the deferred copies may start.
        if let Some(d) = &self.deferred {
            d.open();
        }
        x.data
    }

    fn act_for_overwrite(&self, rows: usize, cols: usize) -> CpuAct {
        let n = rows * cols;
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        match spare.iter().position(|v| v.len() == n) {
            Some(i) => CpuAct {
                data: spare.swap_remove(i),
                rows,
                cols,
            },
            None => {
                drop(spare);
                self.act(rows, cols)
            }
        }
    }

    fn recycle(&self, host: Vec<f32>) {
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        if spare.len() < SPARE_BUFFERS {
            spare.push(host);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recycled_buffers_come_back_for_their_size_only() {
        let be = CpuBackend::new(1);
        let v = vec![1.5f32; 1000];
        let ptr = v.as_ptr();
        be.recycle(v);
        let other = be.act_for_overwrite(10, 10); // another size: a fresh, zeroed one
        assert!(other.data.iter().all(|&x| x == 0.0));
        let a = be.act_for_overwrite(2, 500);
        assert_eq!((a.data.as_ptr(), a.rows, a.cols), (ptr, 2, 500));
        let b = be.act_for_overwrite(2, 500); // the spare is taken: a fresh one
        assert_ne!(b.data.as_ptr(), ptr);
        for _ in 0..5 {
            be.recycle(vec![0.0; 8]);
        }
        assert_eq!(be.spare.lock().unwrap().len(), SPARE_BUFFERS);
    }

    /// A key rotated to position `p` and then shifted back by `d` equals the same key rotated to
    /// `p - d` directly: both RoPE styles, two bases, with and without frequency factors, in an
    /// f32 cache (within the f32 angles' rounding) and an f16 one (within f16 rounding).
    #[test]
    fn shifted_keys_equal_rope_at_the_new_position() {
        use crate::model::config::RopeStyle;
        let (hd, heads) = (64usize, 2usize);
        let d = hd * heads;
        let be = CpuBackend::new(1);
        let ff: Vec<f32> = (0..hd / 2).map(|i| 1.0 + i as f32 / 16.0).collect();
        let x = crate::kernels::cpu::test_floats(d, 7);
        let at = |pos: u32, base: f32, style: RopeStyle, ff: Option<&[f32]>| {
            let mut table = vec![0f32; hd];
            match ff {
                Some(ff) => ops::rope_cache_scaled(pos, base, hd, ff, &mut table),
                None => ops::rope_cache(pos, base, hd, &mut table),
            }
            let mut y = x.clone();
            y.chunks_exact_mut(hd)
                .for_each(|h| ops::rope_head(h, &table, style));
            y
        };
        for kv_type in [KvType::F32, KvType::F16] {
            let mut kv = be.alloc_kv(1, 4, 32, d, hd, kv_type).unwrap();
            for style in [RopeStyle::Normal, RopeStyle::Neox] {
                for base in [10_000f32, 1e6] {
                    for factors in [None, Some(&ff[..])] {
                        for (p, delta) in [(70u32, 32u32), (500, 64), (97, 96)] {
                            let rope = Rope {
                                style,
                                base,
                                head_dim: hd,
                            };
                            let slot = 40;
                            let k = CpuAct {
                                rows: 1,
                                cols: d,
                                data: at(p, base, style, factors),
                            };
                            be.kv_write(&mut kv, 0, &k, &k, &[slot]);
                            let ffv = factors.map(<[f32]>::to_vec);
                            be.kv_shift(&mut kv, 0, &[slot], delta, rope, ffv.as_ref())
                                .unwrap();
                            let got: Vec<f32> = match &kv.f32 {
                                Some(k32) => k32.k[0][slot * d..(slot + 1) * d].to_vec(),
                                None => kv.k[0][slot * d..(slot + 1) * d]
                                    .iter()
                                    .map(|h| h.to_f32())
                                    .collect(),
                            };
                            let want = at(p - delta, base, style, factors);
                            // f32 angles of hundreds of radians are exact to about 3e-5 (as
                            // in any RoPE); f16 storage rounds to about 5e-4.
                            let tol = if kv_type == KvType::F32 { 1e-4 } else { 2e-3 };
                            let scale = want.iter().fold(0f32, |m, w| m.max(w.abs()));
                            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                                assert!(
                                    (g - w).abs() <= tol * scale,
                                    "{kv_type:?} {style:?} base {base} ff {} p {p} d {delta} [{i}]: {g} vs {w}",
                                    factors.is_some()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
