#!/usr/bin/env bash
# The GPU check on the device machine, as one command (docs/benchmarks.md, "GPU: expected"):
#
#   bash docs/bench/gpu_check_run.sh [BUNDLE [PARTS]]
#
# BUNDLE (default build/gpu-bundle, from `make gpu-bundle`, carried with the call): its wheels
# go into /tmp/site with no package index, then tests/gpu_check.py runs every part (or the
# comma-separated PARTS) into /tmp/gpu-check, on the machine's own python3 (torch, Triton,
# transformers). With $OUT set, gpu_check.json and one archive of the parts' logs land there.
# A rerun of some parts merges into the report of an earlier run when $PREVIOUS_REPORT names it
# (the device machine keeps nothing between calls).
set -uo pipefail
cd "$(dirname "$0")/../.."
bundle=${1:-build/gpu-bundle}
parts=${2:-}
out=/tmp/gpu-check
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$bundle"/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out"
if [ -n "${PREVIOUS_REPORT:-}" ] && [ -f "$PREVIOUS_REPORT" ]; then cp "$PREVIOUS_REPORT" "$out/gpu_check.json"; fi
python3 tests/gpu_check.py --out "$out" --model-dir "$bundle/model" ${parts:+--parts "$parts"}
rc=$?
if [ -n "${OUT:-}" ]; then
    cp "$out/gpu_check.json" "$OUT/"
    tar czf "$OUT/gpu-check-logs.tgz" -C "$out" parts
fi
exit $rc
