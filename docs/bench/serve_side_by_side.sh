#!/usr/bin/env bash
# `triollm serve` and `vllm serve` on one model and the same flags, measured by one client
# (`triollm bench serve`, which speaks to any OpenAI server) at concurrency 1, 16 and 64.
# Needs the peers (../shared/peers/setup.sh vllm). Loopback only. Runs from a neutral directory
# (see side_by_side.sh). Usage (from the project root): bash docs/bench/serve_side_by_side.sh
# DTYPE=float32 (default bfloat16) for both; TRIOLLM_FLAGS="--scheduler-prefill-budget off" adds
# flags to triollm's server only, LABEL names its results (default triollm); ENGINES="triollm vllm";
# CONCS="16 64" measures only those concurrencies.
set -uo pipefail
root=$(pwd)
export PEERS=${PEERS:-$HOME/.cache/triollm-peers}
M=$PEERS/models/smollm2-135m-instruct-fp32
out=$PEERS/results/serve-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
cd /tmp
port=8127
flags=(--dtype "${DTYPE:-bfloat16}" --max-num-seqs 64 --max-model-len 1024 --host 127.0.0.1 --port $port)

wait_up() {  # $1 = the server's pid
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    kill -0 "$1" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

measure() {  # $1 = engine label
  for c in ${CONCS:-1 16 64}; do
    n=$(( c == 1 ? 12 : 2 * c ))
    (( n < 64 )) && (( c > 1 )) && n=64
    "$root/.venv/bin/triollm" bench serve --base-url "http://127.0.0.1:$port" --num-prompts $n \
      --max-concurrency $c --result-file "$out/$1-c$c.json" >"$out/$1-c$c.txt" 2>&1 || echo "$1 c$c failed"
  done
}

for engine in ${ENGINES:-triollm vllm}; do
  if [ $engine = triollm ]; then
    engine=${LABEL:-triollm}
    # shellcheck disable=SC2086
    "$root/.venv/bin/triollm" serve "$M" "${flags[@]}" ${TRIOLLM_FLAGS:-} >"$out/$engine-server.log" 2>&1 &
  else
    VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-$(( $(nproc) - 1 )) VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
      "$PEERS/venv-vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$M" "${flags[@]}" \
      >"$out/$engine-server.log" 2>&1 &  # (its `vllm` script looks up a "vllm" distribution; this one is "vllm-cpu")
  fi
  pid=$!
  if wait_up $pid; then measure $engine; else echo "$engine did not start"; fi
  kill -INT $pid; wait $pid 2>/dev/null
done

python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'engine':8} {'conc':>4} {'out tok/s':>10} {'med TTFT':>9} {'med ITL':>8} {'p99 ITL':>8}")
for engine in sorted({f.name.split("-c")[0] for f in out.glob("*-c*.json")}):
    for c in (1, 16, 64):
        f = out / f"{engine}-c{c}.json"
        if not f.exists():
            continue
        r = json.loads(f.read_text())
        print(f"{engine:8} {c:>4} {r['output_throughput']:>10.1f} {r['median_ttft_ms']:>9.1f} "
              f"{r['median_itl_ms']:>8.1f} {r['p99_itl_ms']:>8.1f}")
PY
echo "raw: $out"
