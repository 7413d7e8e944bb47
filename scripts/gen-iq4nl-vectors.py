#!/usr/bin/env python3
"""Generate tests/fixtures/quant/iq4_nl/gguf_py.json: IQ4_NL (ggml type 20) dequantization truth from
gguf-py, an implementation of the ggml block formats independent of ours.

Run from anywhere (needs only `pip install gguf numpy`; no network, no models):

    python3 scripts/gen-iq4nl-vectors.py

Input: the committed tests/fixtures/quant/iq4_nl/tiny-qwen2-iq4_nl.gguf (written by llama.cpp's
llama-quantize; see tests/fixtures/quant/iq4_nl/README.md). The output is deterministic: the same
gguf-py and numpy give byte-identical JSON (a fixed numpy seed, no timestamps).

Conventions are those of scripts/gen-quant-vectors.py: byte strings and f32 arrays are lowercase hex
of their little-endian bytes, so floats round-trip bit-exactly.

JSON fields:

* generator, gguf_py, numpy       — provenance.
* model                           — file name (relative to this fixture folder) and its sha256.
* tensors                         — one entry per IQ4_NL tensor of the model, in file order:
    name, ne ([ne0, ne1], ggml order: ne0 = row length), n_rows, row_len, raw_sha256 (sha256 of the
    tensor's raw IQ4_NL bytes, to check the test reads the right bytes), and first_row_f32 /
    last_row_f32: gguf-py's dequantization of row 0 and row n_rows-1. The test reads the raw bytes
    from the GGUF itself.
* other_tensors                   — name and type of every tensor that is not IQ4_NL (for reference).
* cases                           — synthetic blocks, each {name, n, raw, expected_f32}:
    "random": 64 blocks of 18 bytes (f16 d + 16 nibble bytes) from numpy's default_rng(seed); each d
              is overwritten by a finite f16 with magnitude 10**U(-3, 1) (i.e. in [1e-3, 10]) and a
              random sign (about 1 in 4 negative).
    "edge":   hand-made blocks: d = +0, d = -0, d negative (-0.5), d subnormal (2**-24), d = 65504
              (largest finite f16), all nibbles 0 (every value = -127*d), all nibbles 15
              (every value = 113*d), the ramp 0..15 in both halves, and low/high nibbles different
              (0x0F / 0xF0 bytes) so the element order (low nibbles -> elements 0..15, high
              nibbles -> elements 16..31) is pinned.
"""

import hashlib
import json
import os

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIR = os.path.join(ROOT, "tests", "fixtures", "quant", "iq4_nl")
MODEL = "tiny-qwen2-iq4_nl.gguf"
OUT = os.path.join(DIR, "gguf_py.json")
SEED = 20250420

BLOCK, TYPE_SIZE = gguf.GGML_QUANT_SIZES[T.IQ4_NL]
assert (BLOCK, TYPE_SIZE) == (32, 18)


def hexf32(a):
    return np.ascontiguousarray(a, dtype="<f4").tobytes().hex()


def deq(raw):
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(1, -1)
    return dequantize(raw, T.IQ4_NL).reshape(-1).astype(np.float32)


def tensor_cases(path):
    reader = gguf.GGUFReader(path)
    tensors, others = [], []
    for t in reader.tensors:
        if t.tensor_type != T.IQ4_NL:
            others.append({"name": t.name, "type": t.tensor_type.name, "ne": [int(x) for x in t.shape]})
            continue
        ne = [int(x) for x in t.shape]
        row_len = ne[0]
        n_rows = int(np.prod(ne)) // row_len
        data = np.asarray(t.data).view(np.uint8).reshape(n_rows, row_len // BLOCK * TYPE_SIZE)
        tensors.append(
            {
                "name": t.name,
                "ne": ne,
                "n_rows": n_rows,
                "row_len": row_len,
                "raw_sha256": hashlib.sha256(data.tobytes()).hexdigest(),
                "first_row_f32": hexf32(deq(data[0])),
                "last_row_f32": hexf32(deq(data[n_rows - 1])),
            }
        )
    return tensors, others


def f16_bytes(v):
    return np.array([v], dtype=np.float16).view(np.uint8)


def random_blocks(rng, n):
    raw = rng.integers(0, 256, size=(n, TYPE_SIZE), dtype=np.uint8)
    mag = 10.0 ** rng.uniform(-3.0, 1.0, size=n)
    sign = np.where(rng.random(n) < 0.25, -1.0, 1.0)
    d = (mag * sign).astype(np.float16)
    assert np.all(np.isfinite(d)) and np.all(np.abs(d) >= np.float16(1e-3)) and np.all(np.abs(d) <= 10)
    raw[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    return raw


def edge_blocks(rng):
    rows = []

    def block(d, qs):
        b = np.zeros(TYPE_SIZE, dtype=np.uint8)
        b[0:2] = f16_bytes(d)
        b[2:] = qs
        rows.append(b)

    rnd = lambda: rng.integers(0, 256, size=16, dtype=np.uint8)  # noqa: E731
    block(0.0, rnd())                                  # d = +0
    block(-0.0, rnd())                                 # d = -0
    block(-0.5, rnd())                                 # d negative
    block(2.0**-24, rnd())                             # d subnormal (smallest f16)
    block(65504.0, rnd())                              # d largest finite f16
    block(0.25, np.zeros(16, dtype=np.uint8))          # all nibbles 0  -> -127 * d
    block(0.25, np.full(16, 0xFF, dtype=np.uint8))     # all nibbles 15 ->  113 * d
    block(1.0, np.arange(16, dtype=np.uint8) * 0x11)   # ramp 0..15 in both halves, d = 1: the table itself
    block(-1.0, np.full(16, 0x0F, dtype=np.uint8))     # low 15 / high 0, negative d
    block(3.0, np.full(16, 0xF0, dtype=np.uint8))      # low 0 / high 15
    return np.stack(rows)


def main():
    path = os.path.join(DIR, MODEL)
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    tensors, others = tensor_cases(path)

    rng = np.random.default_rng(SEED)
    cases = []
    for name, raw in [("random", random_blocks(rng, 64)), ("edge", edge_blocks(rng))]:
        out = deq(raw.reshape(-1))
        assert out.size == raw.shape[0] * BLOCK
        cases.append({"name": name, "n": int(out.size), "raw": raw.tobytes().hex(), "expected_f32": hexf32(out)})

    doc = {
        "generator": "scripts/gen-iq4nl-vectors.py",
        "gguf_py": _dist_version(),
        "numpy": np.__version__,
        "seed": SEED,
        "model": {"file": MODEL, "sha256": sha},
        "tensors": tensors,
        "other_tensors": others,
        "cases": cases,
    }
    with open(OUT, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(OUT, ROOT)}: {len(tensors)} IQ4_NL tensors, {len(cases)} synthetic cases")


def _dist_version():
    v = getattr(gguf, "__version__", None)
    if v:
        return v
    from importlib.metadata import version

    return version("gguf")


if __name__ == "__main__":
    main()
