//! ggml's quantized block layouts, field for field (`ggml-common.h`), and their safe byte codecs.
//!
//! Each `Block*` struct is `#[repr(C)]` with exactly ggml's field order and size (checked by a
//! `const` assertion per type), so `size_of::<BlockX>()` is the GGUF `type_size` of that type.
//! Tensor bytes from a memory-mapped file are only guaranteed 1-byte aligned, so this module never
//! casts `&[u8]` to a struct: [`Block::read`] copies one block out of a byte slice (little-endian,
//! as every GGUF is) and [`Block::write`] writes it back. Those two are exact inverses for every
//! bit pattern. Nothing here does arithmetic on the values beyond unpacking packed scale fields
//! (`get_scale_min_k4`, the Q3_K 6-bit scale unpacking), which are part of the layout.

use half::f16;
use std::mem::size_of;

/// Elements per block of Q4_0.
pub const QK4_0: usize = 32;
/// Elements per block of Q4_1.
pub const QK4_1: usize = 32;
/// Elements per block of Q5_0.
pub const QK5_0: usize = 32;
/// Elements per block of Q5_1.
pub const QK5_1: usize = 32;
/// Elements per block of Q8_0.
pub const QK8_0: usize = 32;
/// Elements per block of Q8_1.
pub const QK8_1: usize = 32;
/// Elements per super-block of every k-quant (Q2_K..Q8_K).
pub const QK_K: usize = 256;
/// Bytes of packed 6-bit scales and mins in Q4_K / Q5_K.
pub const K_SCALE_SIZE: usize = 12;

/// A fixed-size ggml block: `ELEMS` values stored in `size_of::<Self>()` bytes.
pub trait Block: Copy + Sized + 'static {
    /// Values encoded by one block.
    const ELEMS: usize;
    /// Bytes one block occupies in a tensor (ggml's `type_size`); always `size_of::<Self>()`.
    const BYTES: usize = size_of::<Self>();
    /// Copies one block out of `bytes[..Self::BYTES]`. Panics if `bytes` is shorter.
    fn read(bytes: &[u8]) -> Self;
    /// Writes this block into `out[..Self::BYTES]`. Panics if `out` is shorter.
    fn write(&self, out: &mut [u8]);
}

/// Iterates the blocks of `src`, whose length must be a whole number of blocks (panics otherwise).
pub fn iter_blocks<B: Block>(src: &[u8]) -> impl Iterator<Item = B> + '_ {
    assert!(
        src.len().is_multiple_of(B::BYTES),
        "{} bytes is not a whole number of {}-byte blocks",
        src.len(),
        B::BYTES
    );
    src.chunks_exact(B::BYTES).map(B::read)
}

/// Sequential little-endian reader over one block's bytes.
pub(super) struct Rd<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Rd<'a> {
    pub(super) fn new(b: &'a [u8], len: usize) -> Self {
        assert!(b.len() >= len, "block needs {len} bytes, got {}", b.len());
        Rd { b, pos: 0 }
    }
    pub(super) fn arr<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        a.copy_from_slice(&self.b[self.pos..self.pos + N]);
        self.pos += N;
        a
    }
    pub(super) fn f16(&mut self) -> f16 {
        f16::from_le_bytes(self.arr::<2>())
    }
    pub(super) fn f32(&mut self) -> f32 {
        f32::from_le_bytes(self.arr::<4>())
    }
    pub(super) fn i8s<const N: usize>(&mut self) -> [i8; N] {
        self.arr::<N>().map(|v| v as i8)
    }
    pub(super) fn i16s<const N: usize>(&mut self) -> [i16; N] {
        let mut a = [0i16; N];
        for v in &mut a {
            *v = i16::from_le_bytes(self.arr::<2>());
        }
        a
    }
}

/// Sequential little-endian writer over one block's bytes.
pub(super) struct Wr<'a> {
    b: &'a mut [u8],
    pos: usize,
}

impl<'a> Wr<'a> {
    pub(super) fn new(b: &'a mut [u8], len: usize) -> Self {
        assert!(b.len() >= len, "block needs {len} bytes, got {}", b.len());
        Wr { b, pos: 0 }
    }
    pub(super) fn bytes(&mut self, v: &[u8]) {
        self.b[self.pos..self.pos + v.len()].copy_from_slice(v);
        self.pos += v.len();
    }
    pub(super) fn f16(&mut self, v: f16) {
        self.bytes(&v.to_le_bytes());
    }
    pub(super) fn f32(&mut self, v: f32) {
        self.bytes(&v.to_le_bytes());
    }
    pub(super) fn i8s(&mut self, v: &[i8]) {
        for &x in v {
            self.bytes(&[x as u8]);
        }
    }
    pub(super) fn i16s(&mut self, v: &[i16]) {
        for &x in v {
            self.bytes(&x.to_le_bytes());
        }
    }
}

/// `block_q4_0`: 32 values `d * (q - 8)`, q a nibble; low nibbles hold values 0..16, high 16..32.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK4_0 / 2],
}

/// `block_q4_1`: 32 values `d * q + m`, q a nibble (same nibble order as Q4_0).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK4_1 / 2],
}

/// `block_q5_0`: 32 values `d * (q - 16)`, q 5 bits: nibble in `qs`, bit 4 of value j in bit j of
/// the little-endian u32 `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK5_0 / 2],
}

/// `block_q5_1`: 32 values `d * q + m`, q 5 bits laid out as in Q5_0.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK5_1 / 2],
}

/// `block_q8_0`: 32 values `d * q`, q a signed byte.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK8_0],
}

/// `block_q8_1`: 32 values `d * q` plus `s = d * sum(q)` (f16), the activation format of Q4_1/Q5_1.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; QK8_1],
}

/// `block_q2_K`: 16 sub-blocks of 16; each scale byte holds a 4-bit scale (low) and 4-bit min (high);
/// value = `d * sc * q - dmin * m`, q 2 bits.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: f16,
    pub dmin: f16,
}

/// `block_q3_K`: 16 sub-blocks of 16 with 6-bit signed scales (packed in 12 bytes, offset 32);
/// value = `d * (sc - 32) * (q - 4 * !hbit)`, q 2 low bits in `qs`, high bit in `hmask`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: f16,
}

/// `block_q4_K`: 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes
/// ([`get_scale_min_k4`]); value = `d * sc * q - dmin * m`, q a nibble.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}

/// `block_q5_K`: as Q4_K with a fifth bit per value in `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// `block_q6_K`: 16 sub-blocks of 16 with signed 8-bit scales; value = `d * sc * (q - 32)`,
/// q 6 bits: low nibble in `ql`, top 2 bits in `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

/// `block_q8_K`: the activation format of the k-quants. `d` is an **f32**; `bsums[j]` is the sum of
/// `qs[16j..16j+16]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

const _: () = assert!(size_of::<BlockQ4_0>() == 18);
const _: () = assert!(size_of::<BlockQ4_1>() == 20);
const _: () = assert!(size_of::<BlockQ5_0>() == 22);
const _: () = assert!(size_of::<BlockQ5_1>() == 24);
const _: () = assert!(size_of::<BlockQ8_0>() == 34);
const _: () = assert!(size_of::<BlockQ8_1>() == 36);
const _: () = assert!(size_of::<BlockQ2K>() == 84);
const _: () = assert!(size_of::<BlockQ3K>() == 110);
const _: () = assert!(size_of::<BlockQ4K>() == 144);
const _: () = assert!(size_of::<BlockQ5K>() == 176);
const _: () = assert!(size_of::<BlockQ6K>() == 210);
const _: () = assert!(size_of::<BlockQ8K>() == 292);

impl Block for BlockQ4_0 {
    const ELEMS: usize = QK4_0;
    fn read(b: &[u8]) -> Self {
        let mut r = Rd::new(b, Self::BYTES);
        BlockQ4_0 {
            d: r.f16(),
            qs: r.arr(),
        }
    }
    fn write(&self, out: &mut [u8]) {
        let mut w = Wr::new(out, Self::BYTES);
        w.f16(self.d);
        w.bytes(&self.qs);
    }
}

impl Block for BlockQ4_1 {
    const ELEMS: usize = QK4_1;
    fn read(b: &[u8]) -> Self {
        let mut r = Rd::new(b, Self::BYTES);
        BlockQ4_1 {
            d: r.f16(),
            m: r.f16(),
            qs: r.arr(),
        }
    }
    fn write(&self, out: &mut [u8]) {
        let mut w = Wr::new(out, Self::BYTES);
        w.f16(self.d);
        w.f16(self.m);
        w.bytes(&self.qs);
    }
}

impl Block for BlockQ5_0 {
    const ELEMS: usize = QK5_0;
    fn read(b: &[u8]) -> Self {
        let mut r = Rd::new(b, Self::BYTES);
        BlockQ5_0 {
            d: r.f16(),
            qh: r.arr(),
            qs: r.arr(),
        }
    }
    fn write(&self, out: &mut [u8]) {
        let mut w = Wr::new(out, Self::BYTES);
        w.f16(self.d);
        w.bytes(&self.qh);
        w.bytes(&self.qs);
    }
}

impl Block for BlockQ5_1 {
    const ELEMS: usize = QK5_1;
    fn read(b: &[u8]) -> Self {
        let mut r = Rd::new(b, Self::BYTES);
        BlockQ5_1 {
            d: r.f16(),
            m: r.f16(),
            qh: r.arr(),
            qs: r.arr(),
        }
    }
    fn write(&self, out: &mut [u8]) {
        let mut w = Wr::new(out, Self::BYTES);
        w.f16(self.d);
        w.f16(self.m);
        w.bytes(&self.qh);
        w.bytes(&self.qs);
    }
}

impl Block for BlockQ8_0 {
    const ELEMS: usize = QK8_0;
    fn read(b: &[u8]) -> Self {
        let mut r = Rd::new(b, Self::BYTES);
        BlockQ8_0 {
            d: r.f16(),
            qs: r.i8s(),
        }
    }
    fn write(&self, out: &mut [u8]) {
        let mut w = Wr::new(out, Self::BYTES);
        w.f16(self.d);
        w.i8s(&self.qs);
    }
}

impl Block for BlockQ8_1 {
    const ELEMS: usize = QK8_1;
    fn read(b: &[u8]) -> Self {
        let mut r = Rd::new(b, Self::BYTES);
        BlockQ8_1 {
            d: r.f16(),
            s: r.f16(),
            qs: r.i8s(),
        }
    }
    fn write(&self, out: &mut [u8]) {
        let mut w = Wr::new(out, Self::BYTES);
        w.f16(self.d);
        w.f16(self.s);
        w.i8s(&self.qs);
    }
}

impl Block for BlockQ2K {
    const ELEMS: usize = QK_K;
    fn read(b: &[u8]) -> Self {
        let mut r = Rd::new(b, Self::BYTES);
        BlockQ2K {
            scales: r.arr(),
            qs: r.arr(),
            d: r.f16(),
            dmin: r.f16(),
        }
    }
    fn write(&self, out: &mut [u8]) {
        let mut w = Wr::new(out, Self::BYTES);
        w.bytes(&self.scales);
        w.bytes(&self.qs);
        w.f16(self.d);
        w.f16(self.dmin);
    }
}

impl Block for BlockQ3K {
    const ELEMS: usize = QK_K;
    fn read(b: &[u8]) -> Self {
        let mut r = Rd::new(b, Self::BYTES);
        BlockQ3K {
            hmask: r.arr(),
            qs: r.arr(),
            scales: r.arr(),
            d: r.f16(),
        }
    }
    fn write(&self, out: &mut [u8]) {
        let mut w = Wr::new(out, Self::BYTES);
        w.bytes(&self.hmask);
        w.bytes(&self.qs);
        w.bytes(&self.scales);
        w.f16(self.d);
    }
}

impl Block for BlockQ4K {
    const ELEMS: usize = QK_K;
    fn read(b: &[u8]) -> Self {
        let mut r = Rd::new(b, Self::BYTES);
        BlockQ4K {
            d: r.f16(),
            dmin: r.f16(),
            scales: r.arr(),
            qs: r.arr(),
        }
    }
    fn write(&self, out: &mut [u8]) {
        let mut w = Wr::new(out, Self::BYTES);
        w.f16(self.d);
        w.f16(self.dmin);
        w.bytes(&self.scales);
        w.bytes(&self.qs);
    }
}

impl Block for BlockQ5K {
    const ELEMS: usize = QK_K;
    fn read(b: &[u8]) -> Self {
        let mut r = Rd::new(b, Self::BYTES);
        BlockQ5K {
            d: r.f16(),
            dmin: r.f16(),
            scales: r.arr(),
            qh: r.arr(),
            qs: r.arr(),
        }
    }
    fn write(&self, out: &mut [u8]) {
        let mut w = Wr::new(out, Self::BYTES);
        w.f16(self.d);
        w.f16(self.dmin);
        w.bytes(&self.scales);
        w.bytes(&self.qh);
        w.bytes(&self.qs);
    }
}

impl Block for BlockQ6K {
    const ELEMS: usize = QK_K;
    fn read(b: &[u8]) -> Self {
        let mut r = Rd::new(b, Self::BYTES);
        BlockQ6K {
            ql: r.arr(),
            qh: r.arr(),
            scales: r.i8s(),
            d: r.f16(),
        }
    }
    fn write(&self, out: &mut [u8]) {
        let mut w = Wr::new(out, Self::BYTES);
        w.bytes(&self.ql);
        w.bytes(&self.qh);
        w.i8s(&self.scales);
        w.f16(self.d);
    }
}

impl Block for BlockQ8K {
    const ELEMS: usize = QK_K;
    fn read(b: &[u8]) -> Self {
        let mut r = Rd::new(b, Self::BYTES);
        BlockQ8K {
            d: r.f32(),
            qs: r.i8s(),
            bsums: r.i16s(),
        }
    }
    fn write(&self, out: &mut [u8]) {
        let mut w = Wr::new(out, Self::BYTES);
        w.f32(self.d);
        w.i8s(&self.qs);
        w.i16s(&self.bsums);
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit (scale, min) of sub-block `j` (0..8) of a Q4_K/Q5_K block.
#[inline]
pub fn get_scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 16 unsigned 6-bit scales (0..64, before ggml subtracts 32) of a Q3_K block, unpacked as
/// ggml's `kmask1`/`kmask2` shuffle does: scale j has its low nibble in byte `j % 8` (low nibble
/// for j < 8, high for j >= 8) and its top 2 bits in byte `8 + j % 4` at bit `2 * (j / 4)`.
#[inline]
pub fn q3k_scales(s: &[u8; 12]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = low | (high << 4);
    }
    out
}
