#!/usr/bin/env bash
# Coverage-guided fuzzing of infer's input parsers (libFuzzer through cargo-fuzz, with
# AddressSanitizer). Runs on the stable toolchain: the sanitizer's `-Z` flags are unlocked with
# RUSTC_BOOTSTRAP=1 (stable ships the AddressSanitizer runtime); cargo-fuzz is installed when
# missing (`cargo install cargo-fuzz --locked`, from crates.io).
#
#   scripts/fuzz.sh [SECONDS per target, default 30] [TARGET...]
#
# Targets (fuzz/fuzz_targets/): gguf (the GGUF reader, then every metadata value and tensor
# range of what it accepts), server_request (`infer serve`'s body parsing and checks), tokenizer
# (both real tokenizers; needs the models from scripts/fetch-models.sh), chat_template
# (arbitrary templates and messages), hf_checkpoint (config.json and safetensors bytes through
# `infer quantize`'s reader and plan), prompt_cache (the prompt cache file), constraint (JSON
# schemas, GBNF grammars and regexes compiled and stepped over a small vocabulary). Seeds are in
# fuzz/seeds/TARGET, the growing corpus in fuzz/corpus/TARGET (git-ignored). Limits: 1 s per
# input, 2 GiB of memory. Exits non-zero on the first crash, leak, timeout or out-of-memory, with
# the input under fuzz/artifacts/TARGET.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs="${1:-30}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf server_request tokenizer chat_template hf_checkpoint prompt_cache constraint)
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked --version 0.13.1
export RUSTC_BOOTSTRAP=1
echo "== building the fuzz targets (AddressSanitizer)" >&2
cargo fuzz build -O >&2
for t in "${targets[@]}"; do
    max_len=4096
    [ "$t" = gguf ] && max_len=16384
    [ "$t" = hf_checkpoint ] && max_len=32768
    [ "$t" = prompt_cache ] && max_len=16384
    mkdir -p "corpus/$t"
    echo "== $t ($secs s)" >&2
    INFER_MODELS="${INFER_MODELS:-$PWD/../models}" cargo fuzz run -O "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$secs" -rss_limit_mb=2048 -timeout=1 -max_len="$max_len" -print_final_stats=1 \
        2>&1 | grep -E '^(Done|stat::number_of_executed_units|stat::peak_rss_mb)|ERROR|SUMMARY' >&2
done
