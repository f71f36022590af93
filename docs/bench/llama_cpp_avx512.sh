#!/usr/bin/env bash
# llama.cpp 0.3.36 (the llama-cpp-python sdist's vendor/llama.cpp) built with AVX-512 (VNNI, BF16,
# VBMI) and no AMX, into $OUT (default /tmp/llama-cpp-avx512): for the AMX Xeon, where the peers'
# -march=native build (setup.sh llamacpp) segfaults in ggml_backend_amx_mul_mat on every quantized
# GGUF tried. Use it under the peers' bindings: LLAMA_CPP_LIB_PATH=$OUT/bin. About two minutes.
set -euo pipefail
OUT=${OUT:-/tmp/llama-cpp-avx512}; SRC=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$SRC"
tar xzf "$SRC"/llama_cpp_python-0.3.36.tar.gz -C "$SRC"
flags=""; for f in AVX AVX2 FMA F16C BMI2 AVX_VNNI AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16; do flags="$flags -DGGML_$f=ON"; done
cmake -S "$SRC"/llama_cpp_python-0.3.36/vendor/llama.cpp -B "$OUT" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF $flags -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' >/dev/null
ninja -C "$OUT" llama >/dev/null
rm -rf "$SRC"; ls "$OUT"/bin
