#!/usr/bin/env python3
"""Checks GGUF files written by `infer quantize` with gguf-py (llama.cpp's own Python reader and
quantizers), independently of the Rust code. Used by tests/convert_hf.rs; needs `pip install gguf`.

  check-gguf-py.py hf    OUT.gguf HF_DIR    an f32 conversion of a Hugging Face checkpoint: arch and
                                            tensor names are llama.cpp's (gguf-py's tables), every
                                            tensor equals the safetensors data mapped with gguf-py's
                                            TensorNameMap (+ the converter's Q/K permutation, Gemma
                                            norm +1, expert stacking), tokens equal tokenizer.json's
  check-gguf-py.py quant OUT.gguf F32.gguf  OUT converted from the same checkpoint: F32/F16/BF16/Q4_0/
                                            Q4_1/Q5_0/Q5_1/Q8_0 tensors are byte-identical to
                                            gguf.quants.quantize() of the f32 data; k-quants decode
                                            (gguf-py) close to it
  check-gguf-py.py requant OUT.gguf IN.gguf OUT re-quantized from IN: same tensors and shapes, same
                                            metadata but general.file_type, and each tensor equals
                                            gguf-py's quantize(dequantize(IN)) (or IN's bytes when the
                                            type is unchanged)

Prints one summary line and exits 0, or prints the first problems and exits 1.
"""
import json
import math
import struct
import sys
from pathlib import Path

try:
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as Q
except ImportError as e:  # the Rust test turns this into a clear failure
    sys.exit(f"check-gguf-py: cannot import gguf-py ({e}); install it with: pip install gguf numpy")

HF_TO_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
PY_QUANTIZABLE = {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
# Largest RMS error relative to the tensor's RMS accepted for a k-quant of Gaussian-like weights.
K_REL_RMS = {Q.Q2_K: 0.6, Q.Q3_K: 0.35, Q.Q4_K: 0.15, Q.Q5_K: 0.08, Q.Q6_K: 0.04}

problems = []


def problem(msg):
    problems.append(msg)


def finish(summary):
    if problems:
        for p in problems[:20]:
            print("check-gguf-py:", p)
        if len(problems) > 20:
            print(f"check-gguf-py: ... {len(problems) - 20} more")
        sys.exit(1)
    print(summary)


def read_safetensors(path):
    """Every tensor of a safetensors file as float32 numpy arrays (own parser, not the Rust one)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    out = {}
    dtypes = {"F32": np.float32, "F16": np.float16}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        s, e = info["data_offsets"]
        buf = raw[8 + n + s : 8 + n + e]
        if info["dtype"] == "BF16":
            a = (np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            a = np.frombuffer(buf, dtype=dtypes[info["dtype"]]).astype(np.float32)
        out[name] = a.reshape(info["shape"])
    return out


def fields(reader):
    return {k: v for k, v in reader.fields.items() if not k.startswith("GGUF.")}


def value(field):
    return field.contents()


def llama_permute(w, n_head, n_head_kv):
    # convert_hf_to_gguf.py LlamaModel.permute
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_f32(t):
    """A reader tensor's values as float32 in ggml row-major order (shape reversed to numpy's)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    if t.tensor_type == Q.F32:
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)


def check_hf(out_path, hf_dir):
    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    hf_arch = cfg["architectures"][0]
    r = gguf.GGUFReader(out_path)
    f = fields(r)
    arch = value(f["general.architecture"])
    if arch != HF_TO_ARCH.get(hf_arch):
        problem(f"general.architecture {arch!r}, expected {HF_TO_ARCH.get(hf_arch)!r} for {hf_arch}")
        return finish("")
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    n_layer = cfg["num_hidden_layers"]
    valid = set()
    for t in gguf.MODEL_TENSORS[arch_enum]:
        base = gguf.TENSOR_NAMES[t]
        for b in range(n_layer) if "{bid}" in base else [None]:
            name = base.format(bid=b) if b is not None else base
            valid |= {name + ".weight", name + ".bias"}
    if value(f[f"{arch}.block_count"]) != n_layer:
        problem(f"{arch}.block_count {value(f[f'{arch}.block_count'])} != {n_layer}")
    if value(f[f"{arch}.embedding_length"]) != cfg["hidden_size"]:
        problem(f"{arch}.embedding_length differs from hidden_size {cfg['hidden_size']}")

    # Expected tensors from the checkpoint, mapped with gguf-py's TensorNameMap.
    tmap = gguf.get_tensor_name_map(arch_enum, n_layer)
    st = read_safetensors(hf_dir / "model.safetensors")
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    expected = {}
    experts = {}
    for name, data in st.items():
        if hf_arch == "Gemma3ForCausalLM" and name == "lm_head.weight":
            continue
        parts = name.split(".")
        if ".experts." in name:
            # model.layers.L.block_sparse_moe.experts.E.w1.weight / model.layers.L.mlp.experts.E.up_proj.weight
            i = parts.index("experts")
            layer, expert, proj = int(parts[2]), int(parts[i + 1]), parts[i + 2]
            key = (f"layers.{layer}.feed_forward.experts.{proj}" if proj in ("w1", "w2", "w3")
                   else f"model.layers.{layer}.mlp.experts.{proj}")
            experts.setdefault(key, {})[expert] = data
            continue
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            problem(f"gguf-py cannot map checkpoint tensor {name}")
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = llama_permute(data, n_head, n_head)
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = llama_permute(data, n_head, n_kv)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        expected[new] = data
    for key, by_expert in experts.items():
        new = tmap.get_name(key + ".weight", try_suffixes=(".weight",))
        if new is None:
            problem(f"gguf-py cannot map expert tensor {key}")
            continue
        expected[new] = np.stack([by_expert[e] for e in sorted(by_expert)])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if arch == "llama" and rope.get("rope_type") == "llama3":
        # LlamaModel.generate_extra_tensors, in float32
        dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
        base = np.float32(rope.get("rope_theta", 10000.0))
        freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
        factor, lo, hi = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        old = rope.get("original_max_position_embeddings", 8192)
        out = []
        for fr in freqs:
            wl = 2 * math.pi / fr
            if wl < old / hi:
                out.append(1.0)
            elif wl > old / lo:
                out.append(factor)
            else:
                s = (old / wl - lo) / (hi - lo)
                out.append(1 / ((1 - s) / factor + s))
        expected["rope_freqs.weight"] = np.array(out, dtype=np.float32)

    got = {t.name: t for t in r.tensors}
    for name in got:
        if name not in valid:
            problem(f"tensor {name} is not a llama.cpp tensor of architecture {arch}")
    for name in sorted(set(expected) - set(got)):
        problem(f"tensor {name} (from the checkpoint) is missing")
    for name in sorted(set(got) - set(expected)):
        problem(f"tensor {name} has no source in the checkpoint")
    for name in sorted(set(got) & set(expected)):
        t, want = got[name], expected[name]
        if t.tensor_type != Q.F32:
            problem(f"{name}: type {t.tensor_type.name}, expected F32")
            continue
        have = tensor_f32(t)
        if name == "token_embd.weight" and have.shape[0] < want.shape[0]:
            want = want[: have.shape[0]]
        if have.shape != want.shape:
            problem(f"{name}: shape {have.shape}, expected {want.shape}")
        elif name == "rope_freqs.weight":
            if not np.allclose(have, want, rtol=1e-5, atol=0):
                problem(f"{name}: {have} != {want}")
        elif not np.array_equal(have, want):
            problem(f"{name}: values differ (max |diff| {np.abs(have - want).max()})")

    # Tokens: ids as tokenizer.json assigns them.
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    by_id.update({a["id"]: a["content"] for a in tok.get("added_tokens", [])})
    tokens = value(f["tokenizer.ggml.tokens"])
    for i, t in by_id.items():
        if i < len(tokens) and tokens[i] != t and tokens[i] != t.replace("\u2581", " "):
            problem(f"token {i}: {tokens[i]!r} != tokenizer.json {t!r}")
    n_types = len(value(f["tokenizer.ggml.token_type"]))
    if n_types != len(tokens):
        problem(f"{n_types} token types for {len(tokens)} tokens")
    finish(f"ok: {arch}, {len(got)} tensors equal the checkpoint, {len(tokens)} tokens")


def check_quant(out_path, f32_path):
    out = {t.name: t for t in gguf.GGUFReader(out_path).tensors}
    ref = {t.name: t for t in gguf.GGUFReader(f32_path).tensors}
    if set(out) != set(ref):
        problem(f"tensor names differ: {sorted(set(out) ^ set(ref))}")
    exact = approx = 0
    for name, t in out.items():
        if name not in ref:
            continue
        data = tensor_f32(ref[name])
        qt = t.tensor_type
        if qt in PY_QUANTIZABLE:
            want = gguf.quants.quantize(data, qt)
            have = np.asarray(t.data)
            if want.tobytes() != have.tobytes():
                problem(f"{name} ({qt.name}): bytes differ from gguf.quants.quantize")
            exact += 1
        elif qt in K_REL_RMS:
            have = tensor_f32(t)
            rel = np.sqrt(np.mean((have - data) ** 2)) / max(np.sqrt(np.mean(data**2)), 1e-30)
            if not rel <= K_REL_RMS[qt]:
                problem(f"{name} ({qt.name}): relative RMS error {rel:.3f} > {K_REL_RMS[qt]}")
            approx += 1
        else:
            problem(f"{name}: unexpected type {qt.name}")
    finish(f"ok: {exact} tensors byte-identical to gguf-py's quantizer, {approx} k-quant tensors within bounds")


def check_requant(out_path, in_path):
    ro, ri = gguf.GGUFReader(out_path), gguf.GGUFReader(in_path)
    fo, fi = fields(ro), fields(ri)
    for k in sorted(set(fo) | set(fi)):
        if k in ("general.file_type", "general.quantization_version"):
            continue
        if k not in fo or k not in fi:
            problem(f"metadata key {k} only in {'output' if k in fo else 'input'}")
        elif fo[k].types != fi[k].types or value(fo[k]) != value(fi[k]):
            problem(f"metadata {k} differs")
    out = {t.name: t for t in ro.tensors}
    inp = {t.name: t for t in ri.tensors}
    if list(out) != list(inp):
        problem("tensor names or order differ")
    same = requantized = 0
    for name, t in out.items():
        s = inp.get(name)
        if s is None:
            continue
        if list(t.shape) != list(s.shape):
            problem(f"{name}: shape {list(t.shape)} != {list(s.shape)}")
            continue
        have = np.asarray(t.data)
        if t.tensor_type == s.tensor_type:
            if have.tobytes() != np.asarray(s.data).tobytes():
                problem(f"{name}: type unchanged ({t.tensor_type.name}) but bytes differ")
            same += 1
            continue
        if t.tensor_type not in PY_QUANTIZABLE:
            problem(f"{name}: cannot check type {t.tensor_type.name} with gguf-py")
            continue
        want = gguf.quants.quantize(tensor_f32(s), t.tensor_type)
        if want.tobytes() != have.tobytes():
            a, b = np.frombuffer(want.tobytes(), np.uint8), np.frombuffer(have.tobytes(), np.uint8)
            problem(f"{name} ({s.tensor_type.name} -> {t.tensor_type.name}): {int((a != b).sum())} of {a.size} bytes differ from gguf-py")
        requantized += 1
    finish(f"ok: {same} tensors copied unchanged, {requantized} re-quantized tensors byte-identical to gguf-py")


if __name__ == "__main__":
    modes = {"hf": check_hf, "quant": check_quant, "requant": check_requant}
    if len(sys.argv) != 4 or sys.argv[1] not in modes:
        sys.exit(__doc__)
    modes[sys.argv[1]](sys.argv[2], sys.argv[3])
