//! Single-thread throughput of the SIMD dot-product kernels (`kernels::cpu::simd`) against the
//! scalar reference (plain `main`, `harness = false`).
//!
//! For each weight type it builds a `rows × cols` matrix (default 1536 × 1536, Qwen2.5-1.5B's
//! attention shape) from random floats and multiplies it, one weight row at a time, with
//! activation rows quantized to the type's `vec_dot_type`:
//! - `dot`: every weight row against one activation row — the decode path;
//! - `tile mN`: every weight row against N activation rows in one `tile` call — prefill.
//!
//! Figures: time per matrix pass, GB/s of weight bytes read (each pass reads the matrix once) and
//! GOP/s (2 · rows · cols · N). A 1536² Q4_K matrix (1.3 MB) stays in cache, so the `dot` line is
//! the kernel's compute ceiling; the `dot cold` line streams a 256 MiB set of matrices, which is what
//! decoding a real model does (memory-bound). Each figure is the best of several timed repetitions.
//!
//! Then the whole-matrix paths the engine uses for that type (`x8 matmul`, `panel matmul`,
//! `dot_rows`), single-threaded, with the same GB/s and GOP/s columns; for Q4_K also the x8 GEMV
//! streaming 256 MiB on 4 KiB and on 2 MiB pages, with one and two threads.
//!
//! Run: `cargo bench --bench kernels [-- TYPE...]` (types by ggml name, e.g. `q4_K q6_K`; default:
//! all types with a kernel). `INFER_SIMD` does not apply: every available level is measured.
//!
//! `cargo bench --bench kernels -- attention` times instead one decode step's attention (one query
//! row, every head, the paged f16 cache in cache) for the two real models' shapes at several
//! context lengths, on two threads, as the engine runs it.

use std::hint::black_box;
use std::time::{Duration, Instant};

use infer::format::GgmlType;
use infer::kernels::cpu::simd::{
    kernels_at, q4_k_gemm, q4k_gemm_kernels_at, reference, Kernels, Level,
};
use infer::quant::{activation_row_bytes, quantize_activations, quantize_row, vec_dot_type};

const ROWS: usize = 1536;
const COLS: usize = 1536;
const TILES: [usize; 5] = [1, 2, 4, 8, 16];
const COLD_BYTES: usize = 256 << 20;

/// Types benchmarked by default, in the order real models need them.
const TYPES: [GgmlType; 12] = [
    GgmlType::Q4K,
    GgmlType::Q6K,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q5K,
    GgmlType::Q4_1,
    GgmlType::Q5_1,
    GgmlType::Q2K,
    GgmlType::Q3K,
];

/// xorshift64* floats in [-1, 1), with a per-32 magnitude so blocks have realistic scales.
fn floats(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let scale = 10f32.powf(next());
        for _ in 0..32.min(n - v.len()) {
            v.push(scale * next());
        }
    }
    v
}

/// A quantized matrix and 16 quantized activation rows.
struct Data {
    w: Vec<u8>,
    row_bytes: usize,
    acts: Vec<u8>,
    act_bytes: usize,
}

impl Data {
    fn new(ty: GgmlType, rows: usize, seed: u64) -> Data {
        let mut w = Vec::new();
        let mut tmp = Vec::new();
        for r in 0..rows {
            quantize_row(ty, &floats(seed + r as u64, COLS), &mut tmp).unwrap();
            w.extend_from_slice(&tmp);
        }
        let row_bytes = w.len() / rows;
        let act_bytes = activation_row_bytes(vec_dot_type(ty), COLS).unwrap();
        let mut acts = Vec::new();
        for j in 0..16 {
            quantize_activations(ty, &floats(1000 + j, COLS), &mut tmp).unwrap();
            acts.extend_from_slice(&tmp);
        }
        Data {
            w,
            row_bytes,
            acts,
            act_bytes,
        }
    }

    fn rows(&self) -> usize {
        self.w.len() / self.row_bytes
    }
}

/// Best time of `f` over repetitions filling about `budget`.
fn best(budget: Duration, mut f: impl FnMut()) -> Duration {
    f();
    let mut best = Duration::MAX;
    let start = Instant::now();
    let mut reps = 0;
    while reps < 3 || (start.elapsed() < budget && reps < 1000) {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
        reps += 1;
    }
    best
}

fn report(label: &str, d: &Data, t: Duration, m: usize, base: Option<Duration>) {
    let s = t.as_secs_f64();
    let gbs = d.w.len() as f64 / s / 1e9;
    let gops = 2.0 * (d.rows() * COLS * m) as f64 / s / 1e9;
    let speedup = base.map_or(String::new(), |b| {
        format!("  {:6.1}x scalar", b.as_secs_f64() / s)
    });
    println!(
        "  {label:<20} {:9.1} us/pass  {gbs:7.2} GB/s  {gops:7.2} GOP/s{speedup}",
        s * 1e6
    );
}

/// Times one pass of `k.dot` over every row of `d` against activation row 0.
fn time_dot(k: &Kernels, d: &Data, budget: Duration) -> Duration {
    let a = &d.acts[..d.act_bytes];
    best(budget, || {
        for wr in d.w.chunks_exact(d.row_bytes) {
            black_box((k.dot)(COLS, black_box(wr), a));
        }
    })
}

/// Times one pass of `k.tile` over every row of `d` against `m` activation rows.
fn time_tile(k: &Kernels, d: &Data, m: usize, budget: Duration) -> Duration {
    let mut out = vec![0f32; m];
    best(budget, || {
        for wr in d.w.chunks_exact(d.row_bytes) {
            (k.tile)(COLS, black_box(wr), &d.acts, d.act_bytes, m, &mut out);
            black_box(&out);
        }
    })
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if args.iter().any(|a| a == "attention") {
        return attention();
    }
    let types: Vec<GgmlType> = if args.is_empty() {
        TYPES.to_vec()
    } else {
        args.iter()
            .map(|a| GgmlType::from_name(a).unwrap_or_else(|| panic!("unknown type {a}")))
            .collect()
    };
    let levels: Vec<Level> = Level::ALL
        .into_iter()
        .filter(|&l| l != Level::Scalar && l.available())
        .collect();
    println!(
        "simd kernels, single thread, {ROWS}x{COLS} weights; levels: {}",
        levels
            .iter()
            .map(|l| l.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let budget = Duration::from_millis(300);
    // The decode roofline: one thread streaming a buffer far larger than the caches.
    let buf: Vec<u64> = (0..(COLD_BYTES / 8) as u64).collect();
    let t = best(budget * 3, || {
        let mut acc = [0u64; 8];
        for line in buf.chunks_exact(8) {
            for (a, &v) in acc.iter_mut().zip(line) {
                *a = a.wrapping_add(v);
            }
        }
        black_box(acc);
    });
    println!(
        "memory read, one thread: {:.2} GB/s",
        COLD_BYTES as f64 / t.as_secs_f64() / 1e9
    );
    drop(buf);
    for ty in types {
        let d = Data::new(ty, ROWS, 1);
        let scalar = reference(ty).expect("type has a scalar dot");
        println!(
            "{} ({:.2} MB of weights, {} B/row):",
            ty.name(),
            d.w.len() as f64 / 1e6,
            d.row_bytes
        );
        let sdot = time_dot(&scalar, &d, budget);
        report("scalar dot", &d, sdot, 1, None);
        let stile = time_tile(&scalar, &d, 16, budget);
        report("scalar tile m16", &d, stile, 16, None);
        for &level in &levels {
            let Some(k) = kernels_at(level, ty) else {
                continue;
            };
            let t = time_dot(&k, &d, budget);
            report(&format!("{} dot", level.name()), &d, t, 1, Some(sdot));
            for m in TILES {
                let t = time_tile(&k, &d, m, budget);
                let base = Duration::from_secs_f64(sdot.as_secs_f64() * m as f64);
                report(&format!("{} tile m{m}", level.name()), &d, t, m, Some(base));
            }
            // Decode from memory: a set of matrices far larger than the caches, each row once.
            // (Copies of the same matrix: the contents do not matter, only that no cache holds
            // them when they are read again.)
            let count = (COLD_BYTES / d.w.len()).max(1);
            let cold = d.w.repeat(count);
            let a = &d.acts[..d.act_bytes];
            let t = best(budget * 3, || {
                for wr in cold.chunks_exact(d.row_bytes) {
                    black_box((k.dot)(COLS, black_box(wr), a));
                }
            });
            let per = Duration::from_secs_f64(t.as_secs_f64() / count as f64);
            report(&format!("{} dot cold", level.name()), &d, per, 1, None);
        }
        matrix_kernels(ty, &d, budget, sdot);
        if ty == GgmlType::Q4K {
            // The GEMM-structure flavour llama.cpp uses for groups of four rows.
            let twin = Kernels {
                dot: q4_k_gemm::dot,
                tile: q4_k_gemm::tile,
                name: "scalar/q4_K-gemm",
            };
            let t = time_tile(&twin, &d, 4, budget);
            report("scalar gemm m4", &d, t, 4, None);
            for &level in &levels {
                if let Some(k) = q4k_gemm_kernels_at(level) {
                    for m in [1, 4, 16] {
                        let t = time_tile(&k, &d, m, budget);
                        let base = Duration::from_secs_f64(sdot.as_secs_f64() * m as f64);
                        report(&format!("{} gemm m{m}", level.name()), &d, t, m, Some(base));
                    }
                }
            }
        }
    }
}

/// The whole-matrix paths the engine runs (one thread): x8-packed Q4_K (GEMV for one row, GEMM for
/// groups of four), the Q6_K panel GEMM, the four-row Q8_0/Q5_0 decode kernel and their panel GEMM.
fn matrix_kernels(ty: GgmlType, d: &Data, budget: Duration, sdot: Duration) {
    use infer::kernels::cpu::layouts::{q4_k_x8, q6_k_x16};
    use infer::kernels::cpu::matmul::{q6_k_panels, q8_0_panels};
    use infer::kernels::cpu::threads::pool::ThreadPool;
    let pool = ThreadPool::new(1);
    let rows = d.rows();
    let acts = |m: usize| -> Vec<u8> {
        (0..m)
            .flat_map(|j| d.acts[(j % 16) * d.act_bytes..(j % 16 + 1) * d.act_bytes].to_vec())
            .collect()
    };
    let base = |m: usize| Some(Duration::from_secs_f64(sdot.as_secs_f64() * m as f64));
    match ty {
        GgmlType::Q4K => {
            let packed = q4_k_x8::pack(&pool, &d.w, rows, COLS);
            for m in [1, 4, 16, 64] {
                let (xq, mut out) = (acts(m), vec![0f32; m * rows]);
                let t = best(budget, || {
                    q4_k_x8::matmul(&pool, &packed, rows, COLS, &xq, m, true, &mut out);
                    black_box(&out);
                });
                report(&format!("x8 matmul m{m}"), d, t, m, base(m));
            }
            // The row-invariant flavour (batched decode rows): every row with the GEMV's arithmetic.
            for m in [2, 4, 8] {
                let (xq, mut out) = (acts(m), vec![0f32; m * rows]);
                let t = best(budget, || {
                    q4_k_x8::matmul(&pool, &packed, rows, COLS, &xq, m, false, &mut out);
                    black_box(&out);
                });
                report(&format!("x8 row-invariant m{m}"), d, t, m, base(m));
            }
            cold_gemv(&packed, rows, d, budget);
        }
        GgmlType::Q6K => {
            decode_rows_line(ty, d, budget, sdot);
            x16_gemv_line(ty, d, &pool, budget, sdot);
            for m in [8, 16, 64] {
                let (xq, mut out) = (acts(m), vec![0f32; m * rows]);
                let t = best(budget, || {
                    q6_k_panels::matmul(
                        &pool,
                        &d.w,
                        q6_k_x16::Layout::File,
                        rows,
                        COLS,
                        &xq,
                        m,
                        &mut out,
                    );
                    black_box(&out);
                });
                report(&format!("panel matmul m{m}"), d, t, m, base(m));
            }
        }
        GgmlType::Q8_0 | GgmlType::Q5_0 => {
            decode_rows_line(ty, d, budget, sdot);
            x16_gemv_line(ty, d, &pool, budget, sdot);
            for m in [4, 16, 64, 512] {
                if !q8_0_panels::applies(ty, COLS, m) {
                    continue;
                }
                let (xq, mut out) = (acts(m), vec![0f32; m * rows]);
                let t = best(budget, || {
                    q8_0_panels::matmul(&pool, ty, &d.w, rows, COLS, &xq, m, &mut out);
                    black_box(&out);
                });
                report(&format!("panel matmul m{m}"), d, t, m, base(m));
            }
        }
        _ => {}
    }
}

/// The x8 GEMV streaming a packed matrix far larger than the caches (copies of `packed`), on
/// ordinary and on huge pages, with one and with two threads.
fn cold_gemv(packed: &[u8], rows: usize, d: &Data, budget: Duration) {
    use infer::kernels::cpu::layouts::q4_k_x8;
    use infer::kernels::cpu::memory::hugebuf::HugeBuf;
    use infer::kernels::cpu::threads::pool::ThreadPool;
    let copies = COLD_BYTES / packed.len();
    let big_rows = rows * copies;
    let mut huge = HugeBuf::zeroed(copies * packed.len());
    // Every 64-byte line made distinct (the hypervisor may merge identical pages, which would
    // then be served from a cache): the sums are meaningless, the bytes read are what counts.
    for (i, c) in huge.chunks_exact_mut(packed.len()).enumerate() {
        c.copy_from_slice(packed);
        for (j, line) in c.chunks_exact_mut(64).enumerate() {
            line[63] ^= (i * 31 + j) as u8;
            line[62] ^= (i >> 3) as u8;
        }
    }
    let small: Vec<u8> = huge.to_vec();
    let xq = d.acts[..d.act_bytes].to_vec();
    let mut out = vec![0f32; big_rows];
    for threads in [1, 2] {
        let pool = ThreadPool::new(threads);
        for (name, w) in [("4k pages", &small[..]), ("huge pages", &huge[..])] {
            let t = best(budget * 2, || {
                q4_k_x8::matmul(&pool, w, big_rows, COLS, &xq, 1, true, &mut out);
                black_box(&out);
            });
            println!(
                "  x8 gemv cold, {threads} thr, {name:<10} {:7.2} GB/s",
                w.len() as f64 / t.as_secs_f64() / 1e9
            );
        }
    }
}

/// The x16 decode layouts (`q6_k_x16`, `q5_0_x16`, `q8_0_x16`) where this CPU packs them: one activation row
/// against the whole matrix, sixteen rows per kernel call.
fn x16_gemv_line(
    ty: GgmlType,
    d: &Data,
    pool: &infer::kernels::cpu::threads::pool::ThreadPool,
    budget: Duration,
    sdot: Duration,
) {
    use infer::kernels::cpu::layouts::{q5_0_x16, q6_k_x16, q8_0_x16};
    let rows = d.rows();
    let a = &d.acts[..d.act_bytes];
    let mut out = vec![0f32; rows];
    let mut packed = vec![0u8; d.w.len()];
    let t = match ty {
        GgmlType::Q6K if q6_k_x16::applies(rows, COLS) => {
            q6_k_x16::pack_into(pool, &d.w, rows, COLS, &mut packed);
            best(budget, || {
                q6_k_x16::gemv(COLS, &packed, a, &mut out);
                black_box(&out);
            })
        }
        GgmlType::Q5_0 if q5_0_x16::applies(rows, COLS) => {
            q5_0_x16::pack_into(pool, &d.w, rows, COLS, &mut packed);
            best(budget, || {
                q5_0_x16::gemv(COLS, &packed, a, &mut out);
                black_box(&out);
            })
        }
        GgmlType::Q8_0 if q8_0_x16::applies(rows, COLS) => {
            q8_0_x16::pack_into(pool, &d.w, rows, COLS, &mut packed);
            best(budget, || {
                q8_0_x16::gemv(COLS, &packed, a, &mut out);
                black_box(&out);
            })
        }
        _ => return,
    };
    report("x16 gemv", d, t, 1, Some(sdot));
}

/// The decode kernel that takes four weight rows per call against one activation row.
fn decode_rows_line(ty: GgmlType, d: &Data, budget: Duration, sdot: Duration) {
    if let Some(rows_fn) = infer::kernels::cpu::simd::dot_rows(ty) {
        let mut out = vec![0f32; d.rows()];
        let a = &d.acts[..d.act_bytes];
        let t = best(budget, || {
            rows_fn(COLS, &d.w, d.row_bytes, a, &mut out);
            black_box(&out);
        });
        report("dot_rows (4 rows)", d, t, 1, Some(sdot));
    }
}

/// One decode step's attention per layer: Qwen2.5-1.5B's shape (12 query heads on 2 KV heads of
/// 128) and Gemma-3-270M's (4 on 1 of 256), the cache filled to each context length.
fn attention() {
    use infer::kernels::cpu::backend::CpuBackend;
    use infer::model::backend::{AttnQuery, AttnShape, Backend, KvType};
    let be = CpuBackend::new(2);
    println!("decode attention, 2 threads, one query row, f16 paged cache (best of repetitions)");
    for (name, n_head, n_kv, hd) in [("qwen2 1.5B", 12, 2, 128), ("gemma3 270M", 4, 1, 256)] {
        let (bs, ctx) = (16usize, 2048usize);
        let mut kv = be
            .alloc_kv(1, ctx / bs, bs, n_kv * hd, hd, KvType::F16)
            .expect("kv cache");
        let table: Vec<u32> = (0..(ctx / bs) as u32).collect();
        let (mut k, mut v) = (be.act(1, n_kv * hd), be.act(1, n_kv * hd));
        for p in 0..ctx {
            for (i, x) in k.data.iter_mut().enumerate() {
                *x = ((i * 31 + p * 7) % 97) as f32 / 30.0 - 1.6;
            }
            for (i, x) in v.data.iter_mut().enumerate() {
                *x = ((i * 17 + p * 13) % 89) as f32 / 40.0 - 1.1;
            }
            be.kv_write(&mut kv, 0, &k, &v, &[p]);
        }
        let mut q = be.act(1, n_head * hd);
        for (i, x) in q.data.iter_mut().enumerate() {
            *x = ((i * 7) % 53) as f32 / 20.0 - 1.3;
        }
        let mut out = be.act(1, n_head * hd);
        let shape = AttnShape {
            n_head,
            n_head_kv: n_kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        for pos in [16u32, 128, 512, 2047] {
            let qs = [AttnQuery {
                seq: 0,
                block_table: &table,
                pos,
                lo: 0,
            }];
            let t = best(Duration::from_millis(300), || {
                be.attention(&q, &kv, 0, &qs, shape, &mut out);
                black_box(&out);
            });
            println!(
                "  {name:<12} ctx {:>5}  {:8.2} us  {:6.1} ns per position",
                pos + 1,
                t.as_secs_f64() * 1e6,
                t.as_secs_f64() * 1e9 / (pos + 1) as f64
            );
        }
    }
}
