//! `infer bench --profile`: the launches of some decode steps, timed one by one on the device
//! (CUDA events around each, graphs bypassed: [`super::launch::Launch::profile_start`]), summed
//! per kernel (matrix products per kernel and shape), with the bytes each kernel must move at least (weights, activations read and
//! written, KV written) and so its achieved bandwidth. The bytes come from the launch's own
//! arguments, as ops.rs lays them out; kernels whose traffic depends on more than their arguments
//! (attention over a sequence's positions, embedding lookups) get no figure.

use super::launch::{Arg, Timed};
use super::ops::{self, Q8_1_BYTES};
use super::repack;
use crate::format::GgmlType;

/// One kernel's share of the profiled steps.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelProfile {
    pub name: String,
    /// Launches per step.
    pub launches: f64,
    /// Seconds per step.
    pub secs: f64,
    /// Bytes moved per step, where every launch of it has a figure.
    pub bytes: Option<f64>,
}

impl KernelProfile {
    /// Achieved bandwidth in bytes/s.
    pub fn bandwidth(&self) -> Option<f64> {
        self.bytes.map(|b| b / self.secs.max(1e-12))
    }
}

fn int(args: &[Arg], i: usize) -> Option<u64> {
    match args.get(i)? {
        Arg::I32(v) => u64::try_from(*v).ok(),
        Arg::I64(v) => u64::try_from(*v).ok(),
        _ => None,
    }
}

fn ptr_set(args: &[Arg], i: usize) -> bool {
    matches!(args.get(i), Some(Arg::Ptr(p)) if *p != 0)
}

fn weight_type(suffix: &str) -> Option<GgmlType> {
    Some(match suffix {
        "q4_0" => GgmlType::Q4_0,
        "q5_0" => GgmlType::Q5_0,
        "q8_0" => GgmlType::Q8_0,
        "q4_k" => GgmlType::Q4K,
        "q6_k" => GgmlType::Q6K,
        "f16" => GgmlType::F16,
        "f32" => GgmlType::F32,
        _ => return None,
    })
}

/// The weight type of a matrix-product launch (`gemv_<type>`, `gemm_<type>`).
fn matmul_type(name: &str) -> Option<GgmlType> {
    name.strip_prefix("gemv_")
        .or_else(|| name.strip_prefix("gemm_"))
        .and_then(weight_type)
}

/// (rows, cols, tokens) of a `gemv_multi_<type>` launch: (xq, cols, tokens, then per matrix w,
/// out, bias, rows), the rows of all its matrices summed; or of a `gemv_glu_<type>` launch (xq,
/// cols, tokens, w_gate, gate, w_up, up, ff, ..): both matrices' 2 ff rows; or of a
/// `gemv_norm_<type>` launch (xq, cols, tokens, w, y, rows, ..).
fn multi_shape(t: &Timed) -> Option<(GgmlType, u64, u64, u64)> {
    if let Some(ty) = t.name.strip_prefix("gemv_glu_") {
        let rows = 2 * int(&t.args, 7)?;
        return Some((weight_type(ty)?, rows, int(&t.args, 1)?, int(&t.args, 2)?));
    }
    if let Some(ty) = t.name.strip_prefix("gemv_norm_") {
        let rows = int(&t.args, 5)?;
        return Some((weight_type(ty)?, rows, int(&t.args, 1)?, int(&t.args, 2)?));
    }
    let ty = weight_type(t.name.strip_prefix("gemv_multi_")?)?;
    let rows = (0..ops::GEMV_MULTI)
        .map(|j| int(&t.args, 6 + 4 * j))
        .sum::<Option<u64>>()?;
    Some((ty, rows, int(&t.args, 1)?, int(&t.args, 2)?))
}

/// Q's, K's and V's (type, rows).
type QkvMatrices = [(GgmlType, u64); 3];

/// The three matrices (type, rows) and the (cols, tokens) of a `gemv_qkv_<type>` launch (xq,
/// cols, tokens, then weights, outputs and RoPE arguments: n_head 20, n_head_kv 21, head_dim 22;
/// `gemv_qkv_<qk type>_v_<v type>` when V's type differs).
fn qkv_shape(t: &Timed) -> Option<(QkvMatrices, u64, u64)> {
    let types = t.name.strip_prefix("gemv_qkv_")?;
    let (qk, v) = match types.split_once("_v_") {
        Some((qk, v)) => (weight_type(qk)?, weight_type(v)?),
        None => (weight_type(types)?, weight_type(types)?),
    };
    let a = &t.args;
    let (nh, nkv, hd) = (int(a, 20)?, int(a, 21)?, int(a, 22)?);
    let m = [(qk, nh * hd), (qk, nkv * hd), (v, nkv * hd)];
    Some((m, int(a, 1)?, int(a, 2)?))
}

/// Bytes moved by RoPE and the KV write for `rows` rows (q read and written, k and v read as
/// f32, the cache written in its types: f16, or q8_0/q4_0 blocks), from `rope_kv`'s arguments
/// n_head, n_head_kv, head_dim, k_type and v_type at these indices.
fn rope_bytes(a: &[Arg], rows: u64, [nh, nkv, hd, kt, vt]: [usize; 5]) -> Option<u64> {
    let (nh, nkv, hd) = (int(a, nh)?, int(a, nkv)?, int(a, hd)?);
    let stored = |i: usize| match int(a, i) {
        Some(1) => hd / 32 * 34,
        Some(2) => hd / 32 * 18,
        _ => hd * 2,
    };
    Some(rows * (nh * hd * 8 + nkv * (hd * 8 + stored(kt) + stored(vt))))
}

/// The weight bytes a matrix-product launch reads, in the device's layout (None for other
/// kernels).
pub fn weight_bytes(t: &Timed) -> Option<u64> {
    let dev = |ty, cols: u64| repack::row_bytes(ty, cols as usize).map(|b| b as u64);
    if let Some((m, cols, _)) = qkv_shape(t) {
        return m
            .iter()
            .map(|&(ty, rows)| Some(rows * dev(ty, cols)?))
            .sum();
    }
    if let Some((ty, rows, cols, _)) = multi_shape(t) {
        return Some(rows * dev(ty, cols)?);
    }
    // (w, x, out, rows, cols, ..)
    let (rows, cols) = (int(&t.args, 3)?, int(&t.args, 4)?);
    Some(rows * dev(matmul_type(&t.name)?, cols)?)
}

/// The least bytes a launch moves (see the module docs), from its arguments.
pub fn launch_bytes(t: &Timed) -> Option<u64> {
    let a = &t.args;
    let q8 = |values: u64| values / 32 * Q8_1_BYTES as u64;
    if let Some((m, cols, n)) = qkv_shape(t) {
        // The products' outputs written (f32), then RoPE and the KV write on them.
        let rows: u64 = m.iter().map(|&(_, r)| r).sum();
        let rope = rope_bytes(a, n, [20, 21, 22, 27, 28])?;
        return Some(weight_bytes(t)? + q8(n * cols) + n * rows * 4 + rope);
    }
    if let Some((_, rows, cols, n)) = multi_shape(t) {
        // A fused GLU also reads the gate and up values back, writes the GLU over gate, and its
        // q8_1 blocks.
        let glu = match t.name.starts_with("gemv_glu_") {
            true => n * rows * 4 + n * rows / 2 * 4 + q8(n * rows / 2),
            false => 0,
        };
        // A fused join reads the product back, reads and writes the residual, writes the normed
        // rows and their q8_1 blocks, and reads its norm weights (the product's too, with a norm
        // of the product: argument 7).
        let join = match t.name.starts_with("gemv_norm_") {
            true => n * rows * 4 * 4 + (1 + ptr_set(a, 7) as u64) * rows * 4 + q8(n * rows),
            false => 0,
        };
        return Some(weight_bytes(t)? + q8(n * cols) + n * rows * 4 + glu + join);
    }
    if let Some(ty) = matmul_type(&t.name) {
        // (w, x, out, rows, cols, tokens, ..)
        let (rows, cols, n) = (int(a, 3)?, int(a, 4)?, int(a, 5)?);
        let w = weight_bytes(t)?;
        let x = match ty {
            GgmlType::F16 | GgmlType::F32 => n * cols * 4,
            _ => q8(n * cols),
        };
        return Some(w + x + n * rows * 4);
    }
    match t.name.as_str() {
        "quantize_q8_1" => {
            let values = int(a, 2)? * 32;
            Some(values * 4 + q8(values))
        }
        "add_rms_norm_q8" => {
            // (x, y, yw, w, out, q8, n, eps); one row a block
            let (rows, n) = (t.grid[0] as u64, int(a, 6)?);
            let add = ptr_set(a, 1) as u64;
            let rows_moved = 2 + 2 * add; // x and out, plus y read and x written back
            let vectors = 1 + ptr_set(a, 2) as u64;
            let quant = if ptr_set(a, 5) { q8(rows * n) } else { 0 };
            Some(rows * n * 4 * rows_moved + vectors * n * 4 + quant)
        }
        "glu_q8" => {
            let n = int(a, 3)?;
            Some(n * 4 * 3 + q8(n))
        }
        "rope_kv" => rope_bytes(a, t.grid[0] as u64, [10, 11, 12, 17, 18]),
        _ => None,
    }
}

/// What a launch is summed under: its kernel, and for a matrix product the weight's shape (rows,
/// all of a multi-matrix launch's, × cols), so that each matrix shape has its own bandwidth (a
/// model's output head apart from its 256-row V projection of the same type).
fn label(t: &Timed) -> String {
    let qkv = qkv_shape(t).map(|(m, cols, _)| (m.iter().map(|&(_, r)| r).sum(), cols));
    let shape = match multi_shape(t) {
        Some((_, rows, cols, _)) => Some((rows, cols)),
        None if qkv.is_some() => qkv,
        None => matmul_type(&t.name).and_then(|_| Some((int(&t.args, 3)?, int(&t.args, 4)?))),
    };
    match shape {
        Some((rows, cols)) => format!("{} {rows}x{cols}", t.name),
        None => t.name.clone(),
    }
}

/// Sums `timed` (the launches of `steps` steps) per kernel and matrix shape ([`label`]), in order
/// of first launch.
pub fn summarize(timed: &[Timed], steps: usize) -> Vec<KernelProfile> {
    let steps = steps.max(1) as f64;
    let mut out: Vec<(KernelProfile, bool)> = Vec::new();
    for t in timed {
        let name = label(t);
        let i = match out.iter().position(|(k, _)| k.name == name) {
            Some(i) => i,
            None => {
                let k = KernelProfile {
                    name,
                    launches: 0.0,
                    secs: 0.0,
                    bytes: Some(0.0),
                };
                out.push((k, true));
                out.len() - 1
            }
        };
        let (k, known) = &mut out[i];
        k.launches += 1.0 / steps;
        k.secs += t.secs / steps;
        match launch_bytes(t) {
            Some(b) => k.bytes = k.bytes.map(|x| x + b as f64 / steps),
            None => *known = false,
        }
    }
    out.into_iter()
        .map(|(mut k, known)| {
            if !known {
                k.bytes = None;
            }
            k
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timed(name: &str, grid: u32, args: Vec<Arg>, secs: f64) -> Timed {
        Timed {
            name: name.into(),
            grid: [grid, 1, 1],
            args,
            secs,
        }
    }

    fn gemv(name: &str, rows: i32, cols: i32, secs: f64) -> Timed {
        let a = vec![Arg::Ptr(1), Arg::Ptr(2), Arg::Ptr(3)];
        let a = [
            a,
            vec![Arg::I32(rows), Arg::I32(cols), Arg::I32(1), Arg::Ptr(0)],
        ]
        .concat();
        timed(name, 1, a, secs)
    }

    #[test]
    fn sums_per_kernel_and_shape_with_bytes_from_the_arguments() {
        let attn = timed("attn_split", 2, vec![Arg::Ptr(1)], 3e-6);
        // Two steps: 1536x1536 Q4_K products (two a step), a 256x1536 one, and attention.
        let t = [
            gemv("gemv_q4_k", 1536, 1536, 4e-6),
            attn.clone(),
            gemv("gemv_q4_k", 256, 1536, 1e-6),
            gemv("gemv_q4_k", 1536, 1536, 2e-6),
        ];
        let t: Vec<Timed> = t.iter().chain(t.iter()).cloned().collect();
        let p = summarize(&t, 2);
        assert_eq!(p.len(), 3);
        assert_eq!(p[0].name, "gemv_q4_k 1536x1536");
        assert_eq!(p[0].launches, 2.0);
        assert!((p[0].secs - 6e-6).abs() < 1e-15);
        // Q4_K: 144 bytes per 256 values; q8_1 input of 1536 values; one f32 out per row.
        let want = |rows: f64| rows * 6.0 * 144.0 + 48.0 * 36.0 + rows * 4.0;
        assert_eq!(p[0].bytes, Some(2.0 * want(1536.0)));
        let bw = p[0].bandwidth().unwrap();
        assert!((bw - 2.0 * want(1536.0) / 6e-6).abs() < 1.0, "{bw}");
        assert_eq!((p[1].name.as_str(), p[1].bytes), ("attn_split", None));
        assert_eq!(p[2].name, "gemv_q4_k 256x1536");
        assert_eq!(p[2].bytes, Some(want(256.0)));
    }

    #[test]
    fn q6_k_counts_its_repacked_rows() {
        // 1536 wide: six 208-byte blocks and 16 bytes of d (12 and 4 of padding) a row.
        let p = summarize(&[gemv("gemv_q6_k", 151_936, 1536, 1e-4)], 1);
        assert_eq!(p[0].name, "gemv_q6_k 151936x1536");
        let want = 151_936.0 * 1264.0 + 48.0 * 36.0 + 151_936.0 * 4.0;
        assert_eq!(p[0].bytes, Some(want));
    }

    #[test]
    fn fused_norm_counts_what_it_reads_and_writes() {
        let a = |y: u64, yw: u64, q8: u64| {
            let p = [1, y, yw, 4, 5, q8].map(Arg::Ptr).to_vec();
            [p, vec![Arg::I32(1536), Arg::F32(1e-6)]].concat()
        };
        let row = 1536.0 * 4.0;
        let plain = launch_bytes(&timed("add_rms_norm_q8", 1, a(0, 0, 6), 1e-6));
        assert_eq!(plain, Some((2.0 * row + row + 48.0 * 36.0) as u64));
        let full = launch_bytes(&timed("add_rms_norm_q8", 3, a(2, 3, 0), 1e-6));
        assert_eq!(full, Some((3.0 * 4.0 * row + 2.0 * row) as u64));
    }
}
