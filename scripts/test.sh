#!/usr/bin/env bash
# The test command: installs what the tests need, then runs every test. A fresh clone passes with
# this alone (and network access to PyPI and crates.io).
#
#   scripts/test.sh                  # everything
#   scripts/test.sh --test cli_basics # extra arguments go to `cargo test`
#
# What it installs, each step idempotent:
# - Python packages (scripts/test-requirements.txt): gguf-py and numpy, the independent GGUF reader
#   and dequantizer the conversion tests check our files with; the NVRTC 12.4 wheels that compile
#   the CUDA kernels (no GPU needed); the official openai client the server tests drive it with;
#   jsonschema, which checks structured output.
# - Chromium (Debian's package, as root through apt-get), for the chat page test.
# - The real models (scripts/fetch-models.sh: skipped when present with the right sha256).
# Then it regenerates the CUDA kernels' PTX and cubins and fails on any difference with the
# committed cuda/build/ or on a register spill, and runs `cargo test --release --locked`, failing
# if the CPU lacks a SIMD level in INFER_EXPECT_SIMD (default `avx2`; `avx2,avx512` on an
# AVX-512 runner, empty for none).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '== %s\n' "$*" >&2; }

step "python packages (scripts/test-requirements.txt)"
pip=(python3 -m pip install --quiet --disable-pip-version-check -r scripts/test-requirements.txt)
if ! "${pip[@]}" 2>/tmp/infer-pip.$$; then
    # A system Python that refuses global installs (PEP 668): install for this user instead.
    if grep -q externally-managed /tmp/infer-pip.$$; then
        "${pip[@]}" --user --break-system-packages
    else
        cat /tmp/infer-pip.$$ >&2
        rm -f /tmp/infer-pip.$$
        exit 1
    fi
fi
rm -f /tmp/infer-pip.$$

step "chromium (the chat page test opens infer serve's page in it)"
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 ||
            { apt-get update >/dev/null 2>&1 &&
              apt-get install -y --no-install-recommends chromium >/dev/null; })
    else
        echo "chromium is missing: install Debian's chromium package (tests/server.rs needs it)" >&2
        exit 1
    fi
fi

step "models (scripts/fetch-models.sh)"
scripts/fetch-models.sh

step "cuda kernels (regenerated with NVRTC, compared with cuda/build/)"
python3 scripts/build-cuda-kernels.py --check --no-spills > /dev/null

# The SIMD levels this machine must have: a kernel test for a level the building CPU lacks is
# compiled as ignored (build.rs), and this makes the run fail instead when the level is expected.
export INFER_EXPECT_SIMD="${INFER_EXPECT_SIMD-avx2}"
step "cargo test --release --locked $* (expecting SIMD levels: ${INFER_EXPECT_SIMD:-none})"
cargo test --release --locked "$@"
