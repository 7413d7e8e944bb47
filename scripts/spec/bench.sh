#!/usr/bin/env bash
# Speculative decoding benchmark (for notes, not a test): the code-rename prompt of
# rename_prompt.txt (a 40-line function, rename one identifier) on Qwen2.5-Coder-1.5B with
# --chat --temp 0, plain decoding against each speculative method (with and without the cost
# model's cap on the draft length), ROUNDS interleaved rounds
# (one run of every method per round), medians of the decode tokens/s printed on stderr.
#
#   scripts/spec/bench.sh [ROUNDS]
# Env: INFER (binary, default target/release/infer), MODEL (default the Qwen file),
#      DRAFT (a draft model for --draft-model; that method is skipped when unset),
#      SELF_LAYERS (layers for --self-draft, default 22), N (max tokens, default 512).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-3}
INFER=${INFER:-target/release/infer}
MODEL=${MODEL:-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
N=${N:-512}
PROMPT=$(cat scripts/spec/rename_prompt.txt)
methods=("plain|" "lookup|--lookup 3" "lookup-no-cost-k|--lookup 3 --no-cost-k"
  "self-draft|--self-draft ${SELF_LAYERS:-22}" "self-draft-no-cost-k|--self-draft ${SELF_LAYERS:-22} --no-cost-k")
if [[ -n "${DRAFT:-}" ]]; then
  methods+=("draft-model|--draft-model $DRAFT" "draft-model-no-cost-k|--draft-model $DRAFT --no-cost-k")
fi
out=$(mktemp -d)
for r in $(seq 1 "$ROUNDS"); do
  for m in "${methods[@]}"; do
    name=${m%%|*}; flags=${m#*|}
    # shellcheck disable=SC2086
    "$INFER" run -m "$MODEL" --chat --temp 0 -n "$N" $flags -p "$PROMPT" \
      >"$out/$name.$r.txt" 2>"$out/$name.$r.err"
    tps=$(sed -n 's/.*generated [0-9]* tokens, \([0-9.]*\) tokens\/s.*/\1/p' "$out/$name.$r.err")
    echo "$tps" >>"$out/$name.tps"
    extra=$(grep -o 'drafted.*' "$out/$name.$r.err" || true)
    echo "round $r $name: $tps tokens/s $extra" >&2
    if [[ $name != plain ]] && ! cmp -s "$out/plain.$r.txt" "$out/$name.$r.txt"; then
      echo "WARNING: $name output differs from plain decoding" >&2
    fi
  done
done
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
base=$(median <"$out/plain.tps")
for m in "${methods[@]}"; do
  name=${m%%|*}
  med=$(median <"$out/$name.tps")
  echo "$name: median $med tokens/s over $ROUNDS runs, $(awk -v a="$med" -v b="$base" 'BEGIN{printf "%.2f", a/b}')x plain" >&2
done
rm -rf "$out"
