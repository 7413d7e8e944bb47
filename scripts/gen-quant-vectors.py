#!/usr/bin/env python3
"""Generate the quant test vectors in tests/fixtures/quant/ from gguf-py, an implementation of the
ggml block formats independent of ours.

Run once (and again only when the vectors should change):

    python3 scripts/gen-quant-vectors.py            # needs `pip install gguf numpy` and the models
                                                    # from scripts/fetch-models.sh

Writes three JSON files. Byte strings and float arrays are lowercase hex of their little-endian bytes,
so floats round-trip bit-exactly.

* dequant.json  — per type: deterministic pseudo-random blocks (their f16 scale fields overwritten
                  with finite, sane values, plus a few edge blocks) and gguf-py's dequantization.
* quantize.json — per type gguf-py can quantize (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
                  deterministic f32 rows (including zero, constant, tie and outlier blocks) and the bytes
                  gguf-py produces.
* models.json   — for a few tensors of the real models: the first 512 values of the first and last
                  row, dequantized by gguf-py from the file's bytes.

tests/fixtures/quant/ggml_ref.json is NOT written here: it holds golden outputs of ggml's own C code
(k-quant and Q8_1/Q8_K quantizers, generic dot products) that gguf-py cannot produce; its `source`
field records where they came from.
"""

import json
import os
import sys

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "quant")
MODELS = os.environ.get("INFER_MODELS", os.path.join(ROOT, "models"))

# Byte offsets of the f16 fields of each block type (ggml-common.h), and the block geometry.
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}


def hexf32(a):
    return np.ascontiguousarray(a, dtype="<f4").tobytes().hex()


def sane_f16(rng, n):
    """Finite f16 scales spanning 1e-4..1e-1 with random signs."""
    mag = 10.0 ** rng.uniform(-4.0, -1.0, size=n)
    sign = np.where(rng.random(n) < 0.25, -1.0, 1.0)
    return (mag * sign).astype(np.float16)


def quant_blocks(rng, qtype, nblocks):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(nblocks, type_size), dtype=np.uint8)
    fields = F16_FIELDS[qtype]
    for off in fields:
        vals = sane_f16(rng, nblocks)
        # Edge blocks: a zero scale, a subnormal scale, a large scale, an all-0xFF payload.
        vals[0] = np.float16(0.0)
        vals[1] = np.float16(2.0**-20)
        vals[2] = np.float16(1.5)
        raw[:, off : off + 2] = vals.view(np.uint8).reshape(nblocks, 2)
    raw[3, :] = 0xFF
    for off in fields:
        raw[3, off : off + 2] = np.array([np.float16(0.0625)]).view(np.uint8)
    return raw.reshape(-1)


def float_values(rng, qtype, n):
    if qtype == T.F16:
        v = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float16)
        v[:6] = np.array([0.0, -0.0, 2.0**-24, 65504.0, np.inf, -np.inf], dtype=np.float16)
        return v.view(np.uint8)
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    exp = (bits >> 7) & 0xFF
    man = bits & 0x7F
    bits = np.where((exp == 0xFF) & (man != 0), bits & 0xFF7F, bits).astype(np.uint16)  # no NaNs
    bits[:4] = [0x0000, 0x8000, 0x0001, 0x7F80]  # zero, -zero, subnormal, inf
    return bits.view(np.uint8)


def dequant_cases(rng):
    cases = []
    for qtype, nblocks in [
        (T.F16, 256),
        (T.BF16, 256),
        (T.Q4_0, 16),
        (T.Q4_1, 16),
        (T.Q5_0, 16),
        (T.Q5_1, 16),
        (T.Q8_0, 16),
        (T.Q2_K, 4),
        (T.Q3_K, 4),
        (T.Q4_K, 4),
        (T.Q5_K, 4),
        (T.Q6_K, 4),
    ]:
        if qtype in (T.F16, T.BF16):
            raw = float_values(rng, qtype, nblocks)
        else:
            raw = quant_blocks(rng, qtype, nblocks)
        out = dequantize(raw.reshape(1, -1), qtype).reshape(-1).astype(np.float32)
        assert np.all(np.isfinite(out) | np.isinf(out)), qtype.name
        cases.append({"type": qtype.name, "n": int(out.size), "raw": raw.tobytes().hex(), "expected_f32": hexf32(out)})
    return cases


def quant_inputs(rng, n):
    """n f32 values in 32-value blocks of varied character."""
    blocks = []
    kinds = ["normal", "uniform", "zeros", "const", "ties", "outlier", "posmax", "tiny"]
    for i in range(n // 32):
        kind = kinds[i % len(kinds)]
        scale = np.float32(10.0 ** rng.uniform(-3, 1))
        if kind == "normal":
            b = rng.standard_normal(32) * scale
        elif kind == "uniform":
            b = rng.uniform(-1, 1, 32) * scale
        elif kind == "zeros":
            b = np.zeros(32)
        elif kind == "const":
            b = np.full(32, -0.375)
        elif kind == "ties":
            # amax 127 makes d = 1 and id = 1 for Q8_0: x * id lands exactly on .5 values.
            b = rng.integers(-254, 255, 32) / 2.0
            b[0] = 127.0
        elif kind == "outlier":
            b = rng.standard_normal(32) * 0.01
            b[rng.integers(0, 32)] = -3.0
        elif kind == "posmax":
            b = rng.uniform(0, 1, 32) * scale
        else:
            b = rng.standard_normal(32) * 1e-6
        blocks.append(b)
    return np.concatenate(blocks).astype(np.float32)


def quantize_cases(rng):
    cases = []
    for qtype in [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]:
        x = quant_inputs(rng, 512)
        if qtype == T.BF16:
            x[:8] = np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.4e38, 1e-40, -0.0, np.inf, np.nan, -1.5e-39], dtype=np.float32)
            bits = x.view(np.uint32)
            bits[8] = 0x7F800001  # signalling NaN
            bits[9] = 0xFFC12345  # negative quiet NaN with payload
        if qtype == T.F16:
            x[:6] = np.array([65519.0, 65520.0, 1.0 + 2.0**-11, 2.0**-25, 3 * 2.0**-26, -1e-8], dtype=np.float32)
        with np.errstate(over="ignore"):  # 65520 -> inf is one of the F16 cases
            q = quantize(x.reshape(1, -1), qtype)
        cases.append({"type": qtype.name, "n": int(x.size), "input_f32": hexf32(x), "expected": np.asarray(q).view(np.uint8).tobytes().hex()})
    return cases


MODEL_TENSORS = {
    "gemma-3-270m-q4_k_m.gguf": [
        "blk.0.ffn_down.weight",  # Q6_K
        "blk.2.ffn_down.weight",  # Q4_K
        "blk.0.attn_q.weight",  # Q5_0
        "blk.0.attn_v.weight",  # Q8_0
        "token_embd.weight",  # Q8_0
        "output_norm.weight",  # F32
    ],
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": [
        "blk.0.ffn_down.weight",  # Q6_K
        "blk.0.ffn_gate.weight",  # Q4_K
        "token_embd.weight",  # Q4_K
    ],
}


def model_cases():
    cases = []
    for fname, names in MODEL_TENSORS.items():
        path = os.path.join(MODELS, fname)
        if not os.path.exists(path):
            sys.exit(f"{path} is missing: run scripts/fetch-models.sh first")
        reader = gguf.GGUFReader(path)
        tensors = {t.name: t for t in reader.tensors}
        for name in names:
            t = tensors[name]
            data = np.asarray(t.data)
            row_len = int(t.shape[0])
            n_rows = int(np.prod(t.shape)) // row_len
            data = data.reshape(n_rows, -1).view(np.uint8)
            block_size, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
            n = min(512, row_len)
            for row in [0, n_rows - 1]:
                raw = data[row, : n // block_size * type_size]
                vals = dequantize(raw.reshape(1, -1), t.tensor_type).reshape(-1).astype(np.float32)
                cases.append(
                    {
                        "model": fname,
                        "tensor": name,
                        "type": t.tensor_type.name,
                        "row_len": row_len,
                        "n_rows": n_rows,
                        "row": row,
                        "n": n,
                        "expected_f32": hexf32(vals),
                    }
                )
    return cases


def main():
    os.makedirs(OUT, exist_ok=True)
    header = {
        "generator": "scripts/gen-quant-vectors.py",
        "gguf_py": getattr(gguf, "__version__", None) or _dist_version(),
        "numpy": np.__version__,
    }
    rng = np.random.default_rng(20240601)
    for fname, cases in [
        ("dequant.json", dequant_cases(rng)),
        ("quantize.json", quantize_cases(rng)),
        ("models.json", model_cases()),
    ]:
        with open(os.path.join(OUT, fname), "w") as f:
            json.dump({**header, "cases": cases}, f, indent=1)
            f.write("\n")
        print(f"wrote {fname}: {len(cases)} cases")


def _dist_version():
    from importlib.metadata import version

    return version("gguf")


if __name__ == "__main__":
    main()
