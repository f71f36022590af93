"""llama.cpp's own tools, as llama.cpp users make and run their GGUF files, from the
`llama-cpp-python==0.3.36` sdist (fetched once with pip and cached under the test cache,
`$TRIOLLM_TEST_CACHE_DIR`, else ~/.cache/triollm-tests, so later runs are offline; where it is
absent and cannot be fetched, or cannot be built, the calling test is skipped, saying so):

* `convert`: `convert_hf_to_gguf.py` (the sdist's `vendor/llama.cpp/` with its `conversion/`
  package and its own `gguf-py`), run on several checkpoints in one child process (its imports
  take most of the time). One change to its behaviour: a tiny tokenizer trained for a test has no
  entry in llama.cpp's table of known BPE pre-tokenizers (keyed by a hash of a test string's
  tokens), where the converter stops; it gets the name of the split transformers' tokenizer class
  applies ("qwen2" for Qwen2Tokenizer, else "gpt-2", the tiny byte-level BPE's own).
* `llama_cpp_run`: the sdist's llama.cpp built once (libllama and ggml, shared, with CMake; AVX2
  kernels where the CPU has them, never -march=native, so the cache runs on any machine this
  checkout moves to) under llama-cpp-python's own ctypes bindings, in a child process:
  `llama_model_quantize` (llama.cpp's quantizer: its K-quant mixes, its IQ4 searches) and its
  greedy tokens with each step's log-probabilities.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

SDIST = "llama-cpp-python==0.3.36"
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
_DRIVER = """
import sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "qwen2" if type(tokenizer).__name__.startswith("Qwen2") else "gpt-2"
base.TextModel.get_vocab_base_pre = pre
import convert_hf_to_gguf
args = sys.argv[2:]
for i in range(0, len(args), 3):
    sys.argv = ["convert_hf_to_gguf.py", args[i], "--outfile", args[i + 1], "--outtype", args[i + 2]]
    convert_hf_to_gguf.main()
"""


def _cache_root() -> Path:
    cache = os.environ.get("TRIOLLM_TEST_CACHE_DIR")
    return Path(cache) if cache else Path.home() / ".cache" / "triollm-tests"


@contextmanager
def _sdist() -> Iterator[tarfile.TarFile]:
    """The sdist, opened; fetched into the cache first where it is not there (skips if it cannot
    be). Callers hold `_locked()`."""
    tarball = _cache_root() / f"{SDIST.replace('==', '-')}.tar.gz"
    if not tarball.is_file():
        with tempfile.TemporaryDirectory(dir=tarball.parent) as tmp:
            fetch = subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST, "-d", tmp],
                capture_output=True,
                text=True,
                timeout=900,
            )
            sdists = list(Path(tmp).glob("*.tar.gz"))
            if fetch.returncode != 0 or not sdists:
                pytest.skip(f"{SDIST} sdist (llama.cpp's tools) not cached and not fetched: {fetch.stderr[-300:]}")
            sdists[0].rename(tarball)
    with tarfile.open(tarball) as tar:
        yield tar


@contextmanager
def _locked() -> Iterator[None]:
    """One test process at a time fetches or builds (pytest-xdist workers share the cache)."""
    _cache_root().mkdir(parents=True, exist_ok=True)
    with open(_cache_root() / f"{SDIST.replace('==', '-')}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _extract(tar: tarfile.TarFile, prefix: str, keep: tuple[str, ...], dest: Path) -> None:
    """The members under `prefix` whose rest starts with one of `keep` ("" keeps all), into `dest`."""
    for member in tar.getmembers():
        _, sep, rest = member.name.partition(prefix)
        if sep and rest.startswith(keep) and (member.isfile() or member.isdir()):
            member.name = rest
            tar.extract(member, dest, filter="data")


def converter_dir() -> Path:
    """The cached converter (fetched on first use); skips the calling test if it cannot be had."""
    root = _cache_root() / SDIST.replace("==", "-")
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter needs sentencepiece (pip install -e '.[dev]')")
    with _locked():
        if not (root / "convert_hf_to_gguf.py").is_file():
            with _sdist() as tar, tempfile.TemporaryDirectory(dir=root.parent) as tmp:
                _extract(tar, "/vendor/llama.cpp/", _PARTS, Path(tmp) / "llama.cpp")
                (Path(tmp) / "llama.cpp").rename(root)
    return root


# The ctypes bindings llama-cpp-python ships (its Llama class needs more packages; these only
# ctypes), under a package of that name whose __init__ imports nothing.
_BINDINGS = ("llama_cpp.py", "_ctypes_extensions.py", "_ggml.py")


def library_dir() -> Path:
    """The cached llama.cpp build with its bindings: put it on sys.path and import
    llama_cpp.llama_cpp, with LLAMA_CPP_LIB_PATH=<it>/llama_cpp. Built on first use (about two
    minutes on two cores); skips the calling test if CMake or a C++ compiler is missing."""
    root = _cache_root() / f"{SDIST.replace('==', '-')}-lib"
    if (root / "llama_cpp" / "libllama.so").is_file():
        return root
    # The dev extras install cmake and ninja into the environment's bin (on PATH or not).
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    cmake, ninja = shutil.which("cmake", path=path), shutil.which("ninja", path=path)
    cxx = shutil.which("c++") or shutil.which("g++")
    if cmake is None or cxx is None:
        pytest.skip(f"building llama.cpp needs cmake and a C++ compiler (found cmake={cmake}, c++={cxx})")
    with _locked():
        if (root / "llama_cpp" / "libllama.so").is_file():
            return root
        with _sdist() as tar, tempfile.TemporaryDirectory(dir=_cache_root()) as tmp:
            src, build, pkg = Path(tmp) / "src", Path(tmp) / "build", Path(tmp) / "lib" / "llama_cpp"
            _extract(tar, "/vendor/llama.cpp/", ("",), src)
            _extract(tar, "/llama_cpp/", _BINDINGS, pkg)
            avx2 = "avx2" in Path("/proc/cpuinfo").read_text().split()
            isa = [f"-DGGML_{f}=ON" for f in ("AVX", "AVX2", "FMA", "F16C", "BMI2")] if avx2 else []
            steps = [
                [cmake, "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
                 "-DGGML_NATIVE=OFF", *isa, "-DGGML_OPENMP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_COMMON=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
                 "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN",
                 *(["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else [])],
                [cmake, "--build", str(build), "--target", "llama", "-j", str(os.cpu_count() or 2)],
            ]
            for step in steps:
                done = subprocess.run(step, capture_output=True, text=True, timeout=1800)
                if done.returncode != 0:
                    log = done.stdout[-3000:] + done.stderr[-3000:]
                    raise AssertionError(f"building llama.cpp failed: {' '.join(step)}\n{log}")
            for lib in (build / "bin").glob("lib*.so*"):
                shutil.copy2(lib, pkg / lib.name, follow_symlinks=False)
            (pkg / "__init__.py").write_text("")
            (Path(tmp) / "lib").rename(root)
    return root


def convert(jobs: list[tuple[Path, Path, str]]) -> None:
    """Convert each (HF directory, output .gguf, --outtype: f32, q8_0, ...) with llama.cpp's converter."""
    args = [str(a) for job in jobs for a in job]
    root = converter_dir()
    # Run from the converter's folder: from a checkout's root `import kernels` (transformers') would
    # find triollm's kernels/.
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(root), *args], cwd=root, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise AssertionError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-4000:]}")


# One thread: ggml's workers spin at each barrier, and beside the other test worker on two cores a
# second spinning thread waits for a descheduled one at every op (a CI run's setup overran 20 min).
_RUN = """
import ctypes, json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import llama_cpp.llama_cpp as L
L.llama_backend_init()
out = []
for job in json.load(open(sys.argv[2])):
    if job["ftype"] is not None:
        params = L.llama_model_quantize_default_params()
        params.ftype, params.nthread = job["ftype"], 1
        if L.llama_model_quantize(job["src"].encode(), job["dst"].encode(), ctypes.byref(params)) != 0:
            sys.exit("llama_model_quantize failed: " + job["dst"])
    model = L.llama_model_load_from_file(job["dst"].encode(), L.llama_model_default_params())
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cparams = L.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = 512
    cparams.n_threads = cparams.n_threads_batch = 1
    runs = []
    for prompt in job["prompts"]:
        ctx = L.llama_init_from_model(model, cparams)
        feed, tokens, logprobs = list(prompt), [], []
        for _ in range(job["max_tokens"]):
            batch = (L.llama_token * len(feed))(*feed)
            if L.llama_decode(ctx, L.llama_batch_get_one(batch, len(feed))) != 0:
                sys.exit("llama_decode failed")
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).astype(np.float64)
            shifted = logits - logits.max()
            logprobs.append((shifted - np.log(np.exp(shifted).sum())).tolist())
            feed = [int(np.argmax(logits))]
            tokens.append(feed[0])
        runs.append({"tokens": tokens, "logprobs": logprobs})
        L.llama_free(ctx)
    L.llama_model_free(model)
    out.append(runs)
json.dump(out, open(sys.argv[3], "w"))
"""


def llama_cpp_run(jobs: list[dict[str, Any]], workdir: Path) -> list[list[dict[str, Any]]]:
    """llama.cpp on each job, in a child process: {"src": .gguf, "dst": .gguf, "ftype": a
    llama_ftype (LLAMA_FTYPE_MOSTLY_Q4_K_M is 15, ...) to quantize src into dst with
    llama_model_quantize first, or None to run dst as it is, "prompts": token id lists,
    "max_tokens": n}. Per job and prompt: {"tokens": its greedy tokens, "logprobs": each step's
    log-probabilities over the whole vocabulary}."""
    runs: list[list[dict[str, Any]]] = _in_child(_RUN, "llama_cpp_runs", jobs, workdir, timeout=900)
    return runs


def _in_child(script: str, name: str, jobs: list[dict[str, Any]], workdir: Path, *, timeout: int) -> Any:
    """Run `script` (argv: the bindings' folder, the jobs' JSON, the output's JSON) on `jobs` in
    a child process with the cached llama.cpp build, and return what it wrote."""
    lib = library_dir()
    (workdir / f"{name}_jobs.json").write_text(json.dumps(jobs))
    out = workdir / f"{name}.json"
    done = subprocess.run(
        [sys.executable, "-c", script, str(lib), str(workdir / f"{name}_jobs.json"), str(out)],
        env={**os.environ, "LLAMA_CPP_LIB_PATH": str(lib / "llama_cpp")},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise AssertionError(f"llama.cpp failed (rc {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


_TOKENIZE = """
import ctypes, json, sys
sys.path.insert(0, sys.argv[1])
import llama_cpp.llama_cpp as L
L.llama_backend_init()
out = []
for job in json.load(open(sys.argv[2])):
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(job["gguf"].encode(), params)
    if not model:
        sys.exit("llama_model_load_from_file failed: " + job["gguf"])
    vocab = L.llama_model_get_vocab(model)
    ids = []
    for text in job["texts"]:
        data = text.encode()
        buf = (L.llama_token * (len(data) + 8))()
        n = L.llama_tokenize(vocab, data, len(data), buf, len(buf), False, False)
        if n < 0:
            sys.exit("llama_tokenize failed")
        ids.append(list(buf[:n]))
    out.append(ids)
    L.llama_model_free(model)
json.dump(out, open(sys.argv[3], "w"))
"""


def llama_cpp_tokenize(jobs: list[dict[str, Any]], workdir: Path) -> list[list[list[int]]]:
    """llama.cpp's tokens, in a child process: per job {"gguf": a file (its vocabulary is read,
    vocab_only), "texts": [...]}, each text's ids (no BOS, special tokens not parsed)."""
    tokens: list[list[list[int]]] = _in_child(_TOKENIZE, "llama_cpp_tokens", jobs, workdir, timeout=600)
    return tokens
