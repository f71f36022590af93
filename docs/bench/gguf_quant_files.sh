#!/usr/bin/env bash
# GGUF files of the bundled model in the quant types llama.cpp users pick, made with llama.cpp's own
# tools: the HF fp32 copy (../shared/peers/setup.sh hf) converted to F16 by convert_hf_to_gguf.py (the
# converter the tests cache, tests/llama_cpp_convert.py), then llama_model_quantize (llama-cpp-python in
# $PEERS/venv-llamacpp: setup.sh llamacpp) to Q4_K_M, IQ4_XS, Q3_K_M and Q2_K, into $PEERS/models/gguf/.
# SmolLM2-135M's width (576) is not a multiple of 256, so llama.cpp writes its fallbacks for most tensors
# (IQ4_NL, Q4_0, Q5_0, Q8_0); the rest are the named type. Run from the project root.
set -euo pipefail
P=${PEERS:-$HOME/.cache/triollm-peers}; G=$P/models/gguf; M=$P/models/smollm2-135m-instruct-fp32
[ -f "$G/smollm2-f16.gguf" ] || PYTHONPATH=tests .venv/bin/python -c "
from pathlib import Path; from llama_cpp_convert import convert
convert([(Path('$M'), Path('$G/smollm2-f16.gguf'), 'f16')])"
for q in Q4_K_M:15 IQ4_XS:30 Q3_K_M:12 Q2_K:10; do
  name=${q%%:*}; ftype=${q##*:}
  [ -f "$G/smollm2-$name.gguf" ] || "$P/venv-llamacpp/bin/python" -c "
import ctypes, llama_cpp
p = llama_cpp.llama_model_quantize_default_params(); p.ftype = $ftype; p.nthread = 2
assert llama_cpp.llama_model_quantize(b'$G/smollm2-f16.gguf', b'$G/smollm2-$name.gguf', ctypes.byref(p)) == 0"
done
ls -l "$G"
