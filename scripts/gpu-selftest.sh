#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build infer and compare every CUDA kernel and a whole forward
# pass (of MODEL, default the Qwen2.5-Coder 1.5B Q4_K_M file from scripts/fetch-models.sh) with
# the CPU backend. Prints a pass/fail table with timings; exits 1 on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}"
cargo build --release --locked
args=(selftest)
if [ -f "$MODEL" ]; then args+=(--model "$MODEL"); else echo "($MODEL not found: kernels only)" >&2; fi
exec "${CARGO_TARGET_DIR:-target}/release/infer" "${args[@]}"
