#!/usr/bin/env bash
# Data parallel on one node: `triollm serve` with one engine core (1 thread, 2 threads) against two
# (-dp 2, one thread each), measured by `triollm bench serve` at concurrency 64 (128 prompts,
# 32-256 tokens in and out). Loopback only. Usage (from the project root):
#   bash docs/bench/data_parallel.sh [MODEL]     (default: the bundled model)
set -uo pipefail
root=$(pwd)
model=${1:-}
port=8129
out=$(mktemp -d)
cd /tmp
for setting in "--num-threads 1" "--num-threads 2" "--num-threads 2 -dp 2"; do
  # shellcheck disable=SC2086
  "$root/.venv/bin/triollm" serve $model --dtype bfloat16 --max-num-seqs 64 --max-model-len 1024 \
    --host 127.0.0.1 --port $port $setting >"$out/server.log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  "$root/.venv/bin/triollm" bench serve --base-url "http://127.0.0.1:$port" --num-prompts 128 \
    --max-concurrency 64 --result-file "$out/r.json" >/dev/null 2>&1 || echo "$setting: bench failed"
  python3 -c "import json,sys; r=json.load(open('$out/r.json')); print(f\"{sys.argv[1]:24} {r['output_throughput']:8.1f} tok/s  median ITL {r['median_itl_ms']:6.1f} ms  median TTFT {r['median_ttft_ms']:7.1f} ms\")" "$setting"
  kill -INT $pid; wait $pid 2>/dev/null
done
rm -rf "$out"
