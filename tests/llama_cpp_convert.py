"""llama.cpp's own `convert_hf_to_gguf.py`, as llama.cpp users make their GGUF files.

It ships in the `llama-cpp-python==0.3.36` sdist under `vendor/llama.cpp/` (with its
`conversion/` package and its own `gguf-py`). `converter_dir()` fetches the sdist once with pip
and keeps only those three parts under the test cache (`$TRIOLLM_TEST_CACHE_DIR`, else
~/.cache/triollm-tests), so later runs are offline; where it is absent and cannot be fetched the
calling test is skipped, saying so.

`convert` runs the converter on several checkpoints in one child process (its imports take most of
the time). One change to the converter's behaviour: a tiny tokenizer trained for a test has no
entry in llama.cpp's table of known BPE pre-tokenizers (keyed by a hash of a test string's
tokens), where the converter stops; it gets the name of the split transformers' tokenizer class
applies ("qwen2" for Qwen2Tokenizer, else "gpt-2", the tiny byte-level BPE's own).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

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


def converter_dir() -> Path:
    """The cached converter (fetched on first use); skips the calling test if it cannot be had."""
    root = _cache_root() / SDIST.replace("==", "-")
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter needs sentencepiece (pip install -e '.[dev]')")
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        fetch = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST, "-d", tmp],
            capture_output=True,
            text=True,
            timeout=900,
        )
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if fetch.returncode != 0 or not sdists:
            pytest.skip(f"{SDIST} sdist (llama.cpp's converter) not cached and not fetched: {fetch.stderr[-300:]}")
        staging = Path(tmp) / "llama.cpp"
        with tarfile.open(sdists[0]) as tar:
            for member in tar.getmembers():
                _, sep, rest = member.name.partition("/vendor/llama.cpp/")
                if sep and rest.startswith(_PARTS) and (member.isfile() or member.isdir()):
                    member.name = rest
                    tar.extract(member, staging, filter="data")
        try:
            staging.rename(root)
        except OSError:  # another test process fetched it first
            if not (root / "convert_hf_to_gguf.py").is_file():
                raise
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
