#!/usr/bin/env bash
# Data parallel on one node: `triollm serve` with one engine core (1 thread, 2 threads) against two
# (-dp 2, one thread each), and the same two ranks as Ray actors (-dpb ray, on a local loopback
# Ray started here, when Ray is installed), measured by `triollm bench serve` at concurrency 64
# (128 prompts, 32-256 tokens in and out). Loopback only. Usage (from the project root):
#   bash docs/bench/data_parallel.sh [MODEL]     (default: the bundled model)
set -uo pipefail
root=$(pwd)
model=${1:-}
port=8129
out=$(mktemp -d)
cd /tmp
settings=("--num-threads 1" "--num-threads 2" "--num-threads 2 -dp 2")
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0  # Ray on 127.0.0.1 only
export RAY_AUTH_MODE=token  # Ray 2.59+: `ray start` enables token auth, drivers must say so too
if "$root/.venv/bin/python" -c "import ray" 2>/dev/null; then
  "$root/.venv/bin/ray" start --head --node-ip-address 127.0.0.1 --port 6391 --num-cpus 2 --object-store-memory 100000000 \
    --include-dashboard false --disable-usage-stats >"$out/ray.log" 2>&1 && {
    export RAY_ADDRESS=127.0.0.1:6391
    settings+=("--num-threads 2 -dp 2 -dpb ray")
  }
fi
for setting in "${settings[@]}"; do
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
[ -n "${RAY_ADDRESS:-}" ] && "$root/.venv/bin/ray" stop >/dev/null 2>&1
rm -rf "$out"
