#!/usr/bin/env bash
# triollm and vLLM-CPU on the peers' workload in one sitting (../shared/peers/: setup.sh first).
# Runs from a neutral directory: from the project root, vLLM's `python -m` subprocesses put the
# root on sys.path and transformers imports this repository's kernels/ as the Hugging Face
# `kernels` package (run.sh then reports "vllm bfloat16 failed").
# Usage (from the project root): bash docs/bench/side_by_side.sh
set -uo pipefail
root=$(pwd)
peers=$(cd ../shared/peers && pwd)
export PEERS=${PEERS:-$HOME/.cache/triollm-peers}
M=$PEERS/models/smollm2-135m-instruct-fp32
out=$PEERS/results/side-$(date +%Y%m%d-%H%M%S).jsonl
cd /tmp
"$root/.venv/bin/python" "$peers/bench_triollm.py" --model "$M" --dtype bfloat16 --single --out "$out" >/dev/null 2>&1 || echo "triollm failed"
for eager in "" "--eager"; do
  VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-$(( $(nproc) - 1 )) VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
    "$PEERS/venv-vllm/bin/python" "$peers/bench_vllm.py" --model "$M" --dtype bfloat16 $eager --single --out "$out" >/dev/null 2>&1 || echo "vllm $eager failed"
done
"$root/.venv/bin/python" "$peers/bench_triollm.py" --model "$M" --dtype bfloat16 --single --out "$out" >/dev/null 2>&1 || echo "triollm failed"
"$root/.venv/bin/python" "$peers/bench_triollm.py" --model "$M" --dtype float32 --single --out "$out" >/dev/null 2>&1 || echo "triollm fp32 failed"
python3 - "$out" <<'PY'
import json, sys
print(f"{'engine':24} {'dtype':9} {'out tok/s':>10} {'b1 ms/tok':>10}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    name = r["engine"] + (" (eager)" if r.get("eager") else "")
    print(f"{name:24} {r['dtype'][:9]:9} {r['out_tok_s']:>10} {r.get('b1_decode_ms_per_tok', ''):>10}")
PY
echo "raw: $out"
