#!/usr/bin/env bash
# The GPU check, in two halves.
#
#   scripts/gpu-check.sh --prepare     # here: build, strip the binary and write the real models'
#                                      # skeletons into gpu-carry/ (git-ignored, gzipped: ~13 MiB)
#   scripts/gpu-check.sh               # on the lent GPU machine, with gpu-carry/ carried along:
#                                      # everything it measures goes under $OUT
#
# On the device it expands the skeletons into files with the real models' exact shapes and types
# (Qwen2.5-Coder-1.5B Q4_K_M, Gemma-3-270M Q4_K_M; random weights: `infer synth`), then runs
# `infer selftest` (every CUDA kernel, and a whole forward of each file, against the CPU),
# `infer bench --device cuda --json` (the device's bandwidth measured in the same run, pp512,
# tg128, and batched decode through the scheduler at 1, 8 and 32 sequences),
# `infer bench --profile` (every kernel of 16 decode steps at 512 positions timed alone: time
# and bandwidth), the selftest and benches again with programmatic dependent launch on
# (INFER_CUDA_PDL=1: A/B in the same run), Qwen's bench with the FFN's gate/up/GLU launch split
# in two again (INFER_CUDA_FUSED_FFN=0), with the output products and residual joins split again
# (INFER_CUDA_FUSED_NORM=0), with Q/K/V and RoPE split again (INFER_CUDA_FUSED_QKV=0), and last, Qwen's decode at depth 4,096 with the KV
# cache in f16, q8_0 and q4_0 (`--kv-types`, timed in the same run). figures.txt gathers the
# headline numbers.
# Each step has its own time limit and nothing runs past BUDGET (470 s), so the whole run stays
# under 8 minutes; a failed step is recorded in $OUT/summary.txt and the others still run. Every
# GPU figure in a note comes from these files.
#
# DEVICE=cpu QUICK=1 OUT=/tmp/gpu-out scripts/gpu-check.sh runs the same steps on the CPU with
# small sizes (the selftest is skipped): a dry run of the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=gpu-carry

if [ "${1:-}" = "--prepare" ]; then
    set -e
    cargo build --release --locked
    rm -rf "$CARRY"
    mkdir -p "$CARRY"
    # Compressed: the binary embeds every architecture's kernels (PTX is text), and what travels
    # (the working tree and the carried folder together) must stay under 64 MiB.
    strip -o "$CARRY/infer" target/release/infer
    target/release/infer synth --skeleton-of models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf -o "$CARRY/qwen.skel.gguf"
    target/release/infer synth --skeleton-of models/gemma-3-270m-q4_k_m.gguf -o "$CARRY/gemma.skel.gguf"
    gzip -9 "$CARRY/infer" "$CARRY/qwen.skel.gguf" "$CARRY/gemma.skel.gguf"
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -n 1 | cut -f1)
    carry=$(du -sb "$CARRY" | cut -f1)
    echo "gpu-check: $((tree / 1048576)) MiB of working tree + $((carry / 1048576)) MiB in $CARRY travel (64 MiB at most)"
    if [ $((tree + carry)) -gt $((64 * 1048576)) ]; then
        echo "gpu-check: that is over the device machine's 64 MiB" >&2
        exit 1
    fi
    exit 0
fi

OUT="${OUT:?set OUT to the folder that receives the results}"
DEVICE="${DEVICE:-cuda}"
QUICK="${QUICK:-0}"
WORK="${TMPDIR:-/tmp}/infer-gpu-check"
BIN="$WORK/infer"
mkdir -p "$OUT" "$WORK"
[ -f "$CARRY/infer.gz" ] || { echo "gpu-check: $CARRY/infer.gz is missing: run scripts/gpu-check.sh --prepare and carry $CARRY" >&2; exit 1; }
for f in infer qwen.skel.gguf gemma.skel.gguf; do
    gzip -dc "$CARRY/$f.gz" > "$WORK/$f" || { echo "gpu-check: cannot unpack $CARRY/$f.gz" >&2; exit 1; }
done
chmod +x "$BIN"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

# step NAME SECONDS CMD...: runs CMD with a time limit, its stdout to $OUT/NAME.out and stderr to
# $OUT/NAME.err, and records the outcome.
# Nothing starts after BUDGET seconds, and no step runs past it.
BUDGET="${BUDGET:-470}"
step() {
    local name=$1 secs=$2
    shift 2
    local t0=$SECONDS left=$((BUDGET - SECONDS))
    if [ "$left" -le 5 ]; then
        printf '%-28s rc=%-3s %4ss  %s\n' "$name" skip 0 "(out of time) $*" | tee -a "$SUMMARY"
        return
    fi
    [ "$secs" -gt "$left" ] && secs=$left
    timeout "$secs" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
    local rc=$?
    printf '%-28s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" | tee -a "$SUMMARY"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv 2>&1 || true; uname -a; nproc; } > "$OUT/device.txt"

if [ "$QUICK" = 1 ]; then
    PP=64; TG=16; REPS=1; LEVELS=1,8; CPROMPT=32; CGEN=8; PDEPTH=32; KDEPTH=64
else
    PP=512; TG=128; REPS=3; LEVELS=1,8,32; CPROMPT=512; CGEN=64; PDEPTH=512; KDEPTH=4096
fi

for m in qwen gemma; do
    step "synth-$m" 60 "$BIN" synth --from "$WORK/$m.skel.gguf" -o "$WORK/$m.gguf"
done

if [ "$DEVICE" = cuda ]; then
    step selftest-kernels 90 "$BIN" selftest
    for m in qwen gemma; do
        step "selftest-$m" 90 "$BIN" selftest -m "$WORK/$m.gguf"
    done
fi

for m in qwen gemma; do
    step "bench-$m" 75 "$BIN" bench --device "$DEVICE" -m "$WORK/$m.gguf" -p "$PP" -n "$TG" -r "$REPS" --json
    step "batched-$m" 60 "$BIN" bench --device "$DEVICE" -m "$WORK/$m.gguf" --concurrency "$LEVELS" \
        -p "$CPROMPT" -n "$CGEN" -r 1 --shared-prefix 0 --json
    step "profile-$m" 45 "$BIN" bench --device "$DEVICE" -m "$WORK/$m.gguf" -d "$PDEPTH" -p 0 -n 16 -r 1 --profile
done
# Programmatic dependent launch (INFER_CUDA_PDL=1, off by default until measured): correctness
# on the Qwen-shaped file first, then the same benches as above with it on.
if [ "$DEVICE" = cuda ]; then
    step selftest-qwen-pdl 90 env INFER_CUDA_PDL=1 "$BIN" selftest -m "$WORK/qwen.gguf"
fi
for m in qwen gemma; do
    step "bench-$m-pdl" 60 env INFER_CUDA_PDL=1 "$BIN" bench --device "$DEVICE" -m "$WORK/$m.gguf" \
        -p "$PP" -n "$TG" -r "$REPS" --json
done
# The FFN's gate, up and GLU as two launches again (INFER_CUDA_FUSED_FFN=0): what fusing them gave.
step bench-qwen-unfused 60 env INFER_CUDA_FUSED_FFN=0 "$BIN" bench --device "$DEVICE" \
    -m "$WORK/qwen.gguf" -p "$PP" -n "$TG" -r "$REPS" --json
# The output products and the residual joins after them as two launches each again
# (INFER_CUDA_FUSED_NORM=0): what fusing them gave.
step bench-qwen-unfused-norm 60 env INFER_CUDA_FUSED_NORM=0 "$BIN" bench --device "$DEVICE" \
    -m "$WORK/qwen.gguf" -p "$PP" -n "$TG" -r "$REPS" --json
# The Q/K/V products and RoPE with the KV write as separate launches again
# (INFER_CUDA_FUSED_QKV=0): what fusing them gave.
step bench-qwen-unfused-qkv 60 env INFER_CUDA_FUSED_QKV=0 "$BIN" bench --device "$DEVICE" \
    -m "$WORK/qwen.gguf" -p "$PP" -n "$TG" -r "$REPS" --json
step batched-qwen-pdl 60 env INFER_CUDA_PDL=1 "$BIN" bench --device "$DEVICE" -m "$WORK/qwen.gguf" \
    --concurrency "$LEVELS" -p "$CPROMPT" -n "$CGEN" -r 1 --shared-prefix 0 --json
step kvtypes-qwen 45 "$BIN" bench --device "$DEVICE" -m "$WORK/qwen.gguf" -d "$KDEPTH" -p 0 -n 32 -r 1 \
    --kv-types f16,q8_0,q4_0 --json

# The headline figures, one line per output, read from the JSON with grep alone (the device
# machine may have no python): decode t/s and its share of the bandwidth measured in the same
# run, pp, and the batched levels' aggregate t/s and speed-up over one sequence.
field() { grep -o "\"$1\":[^,}]*" "$2" | head -n "${3:-1}" | tail -n 1 | cut -d: -f2; }
{
    for f in "$OUT"/bench-*.out; do
        [ -s "$f" ] || continue
        printf '%-22s bandwidth %s GB/s  decode efficiency %s' "$(basename "$f" .out)" \
            "$(field median "$f")" "$(field decode_efficiency "$f")"
        grep -o '"test":"[a-z]*[0-9]*","kv_cache_type":"[a-z0-9_]*","tps_median":[0-9.]*' "$f" |
            sed 's/"test":"\([^"]*\)".*"tps_median":\([0-9.]*\)/  \1 \2 t\/s/' | tr -d '\n'
        echo
    done
    for f in "$OUT"/batched-*.out; do
        [ -s "$f" ] || continue
        printf '%-22s' "$(basename "$f" .out)"
        grep -o '"concurrency":[0-9]*,"aggregate_tps_median":[0-9.]*,"aggregate_tps_rounds":[^]]*],"speedup_vs_1":[0-9.]*' "$f" |
            sed 's/"concurrency":\([0-9]*\),"aggregate_tps_median":\([0-9.]*\).*"speedup_vs_1":\([0-9.]*\)/  x\1 \2 t\/s (\3x)/' | tr -d '\n'
        echo
    done
} > "$OUT/figures.txt" 2>&1

rm -rf "$WORK"
cat "$SUMMARY" "$OUT/figures.txt"
! grep -qv 'rc=0 ' "$SUMMARY"
