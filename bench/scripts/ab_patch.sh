#!/usr/bin/env bash
# A/B one change on one machine: each bench line runs with PATCH reversed (A) and applied (B),
# alternating A B B A per line, so drift between runs shows as spread, not as the change.
#   git diff -- engine > ab.patch
#   PATCH=ab.patch OUT=$OUT bash bench/scripts/ab_patch.sh "enc2dec bench ARGS..." ["enc2dec bench ARGS..." ...]
# Each line gets --report-json (lN-A-k / lN-B-k); summarize.py's table of them comes last.
# The working tree must hold the change (B) when this starts; it is left so.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-./gpu-out}; PATCH=${PATCH:?PATCH=file.patch}; mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
i=0
for line in "$@"; do
  i=$((i + 1))
  for side in A B B A; do
    [ "$side" = A ] && { git apply -R "$PATCH" || exit 1; }
    n=$(ls "$OUT"/l$i-$side-*.json 2>/dev/null | wc -l)
    t0=$SECONDS
    timeout ${LIMIT_S:-150} ${line/enc2dec /python -m enc2dec.cli.main } --report-json "$OUT/l$i-$side-$n.json" \
        >"$OUT/l$i-$side-$n.log" 2>&1
    echo "line $i $side: exit $? after $((SECONDS - t0)) s"
    [ "$side" = A ] && { git apply "$PATCH" || exit 1; }
  done
done
python bench/scripts/summarize.py "$OUT"
