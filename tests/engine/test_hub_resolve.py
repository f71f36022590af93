"""Hub repo ids (`owner/name`) resolve through huggingface_hub: the local HF cache first, a download
only after a miss and only online. Every cache here is built in huggingface_hub's own layout
(`models--owner--name/{blobs,snapshots,refs}`) in a temporary directory; no test touches the
network (`no_network` makes any socket connect fail, and the download is faked where one is meant
to happen)."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from huggingface_hub import constants, errors
from huggingface_hub.utils import filter_repo_objects
from tinymodel import make_tiny_model

from triollm import LLM, SamplingParams
from triollm.api.cli import build_parser
from triollm.engine import config as config_module
from triollm.engine.config import EngineArgs
from triollm.engine.loading.hub import MODEL_PATTERNS, is_hub_id
from triollm.engine.loading.model_files import resolve_model

REPO = "owner/tiny"
MAIN = "a" * 40  # commit hashes: refs/main -> MAIN, refs/v1 -> V1
V1 = "b" * 40
REAL_SNAPSHOT_DOWNLOAD = huggingface_hub.snapshot_download


def add_snapshot(cache: Path, repo_id: str, src: Path, commit: str, refs: tuple[str, ...] = ()) -> Path:
    """Lay `src`'s files out as huggingface_hub does: content-addressed blobs, a snapshot of
    relative symlinks to them, and refs naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in src.iterdir():
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`owner/tiny` at two commits (main and the tag v1, different weights) and `owner/tok`, a
    tokenizer-only repo."""
    cache = tmp_path_factory.mktemp("hf-hub")
    src = tmp_path_factory.mktemp("src")
    add_snapshot(cache, REPO, make_tiny_model(src / "main"), MAIN, ("main",))
    add_snapshot(cache, REPO, make_tiny_model(src / "v1", seed=1), V1, ("v1",))
    tok = src / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok / name).write_bytes((src / "main" / name).read_bytes())
    add_snapshot(cache, "owner/tok", tok, V1, ("main",))
    return cache


def snapshot(cache: Path, commit: str, repo_id: str = REPO) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: socket.socket, address: Any) -> None:
        raise AssertionError(f"a test tried to connect to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, no_network: None) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch, no_network: None) -> None:
    """HF_HUB_OFFLINE unset, as huggingface_hub would have read it (the network stays blocked)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Every snapshot_download call; the local ones run for real, an online one fails the test
    unless a test replaces `download` below."""
    seen: list[dict[str, Any]] = []

    def spy(repo_id: str, **kwargs: Any) -> str:
        seen.append({"repo_id": repo_id, **kwargs})
        if kwargs.get("local_files_only"):
            return REAL_SNAPSHOT_DOWNLOAD(repo_id, **kwargs)
        return spy.download(repo_id, **kwargs)  # type: ignore[attr-defined, no-any-return]

    def no_download(repo_id: str, **kwargs: Any) -> str:
        raise AssertionError(f"{repo_id} was downloaded")

    spy.download = no_download  # type: ignore[attr-defined]
    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    yield seen


def test_llm_generates_from_the_cache_offline(hub_cache: Path, offline: None) -> None:
    with LLM(REPO, download_dir=str(hub_cache), max_model_len=64, multiprocess=False, num_threads=1) as llm:
        config = llm.llm_engine.async_llm.config
        (out,) = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert config.model.path == config.tokenizer == snapshot(hub_cache, MAIN)
    assert len(out.outputs[0].token_ids) == 4
    assert config.ignored_args == ()  # download_dir is honoured, not "ignored"


def test_revision_picks_the_snapshot(hub_cache: Path, offline: None, calls: list[dict[str, Any]]) -> None:
    def resolve(revision: str | None) -> Path:
        return resolve_model(REPO, None, revision=revision, download_dir=str(hub_cache))

    assert resolve(None) == snapshot(hub_cache, MAIN)
    assert resolve("v1") == snapshot(hub_cache, V1)  # a tag, through refs/v1
    assert resolve(V1) == snapshot(hub_cache, V1)  # a commit hash, directly
    config = EngineArgs(model=REPO, revision="v1", download_dir=str(hub_cache), hf_token="hf_x").create_engine_config()
    assert config.model.path == config.tokenizer == snapshot(hub_cache, V1)
    assert config.ignored_args == ()
    assert {c["local_files_only"] for c in calls} == {True}
    assert calls[-1]["token"] == "hf_x" and calls[-1]["cache_dir"] == str(hub_cache)


def test_default_cache_is_huggingface_hubs(
    hub_cache: Path, offline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # huggingface_hub reads HF_HOME / HF_HUB_CACHE once, at import, into this constant.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    assert resolve_model(REPO, None) == snapshot(hub_cache, MAIN)


def test_tokenizer_from_the_hub(hub_cache: Path, tiny_model_dir: Path, offline: None) -> None:
    def tokenizer(**kwargs: Any) -> Path:
        return EngineArgs(download_dir=str(hub_cache), **kwargs).create_engine_config().tokenizer

    assert tokenizer(model=str(tiny_model_dir), tokenizer="owner/tok") == snapshot(hub_cache, V1, "owner/tok")
    # with tokenizer unset, tokenizer_revision picks the model repo's tokenizer at that revision
    assert tokenizer(model=REPO, tokenizer_revision="v1") == snapshot(hub_cache, V1)
    with pytest.raises(ValueError, match=r"^tokenizer: 'owner/none' is not a local path.*hf download owner/none"):
        tokenizer(model=str(tiny_model_dir), tokenizer="owner/none")


@pytest.mark.parametrize("how", ["env", "at-import"])
def test_offline_miss_names_the_cache_and_the_command(
    hub_cache: Path, how: str, no_network: None, calls: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    if how == "env":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as info:
        resolve_model("owner/absent", None, revision="v2", download_dir=str(hub_cache))
    message = str(info.value)
    assert message.startswith("model: 'owner/absent' is not a local path, and not in the Hugging Face cache at ")
    assert f"{hub_cache} (revision 'v2')" in message and "HF_HUB_OFFLINE is set" in message
    assert f"`hf download owner/absent --revision v2 --cache-dir {hub_cache}`" in message
    assert [c["local_files_only"] for c in calls] == [True]


def test_cached_snapshot_without_weights_is_a_miss(
    tmp_path: Path, tiny_model_dir: Path, offline: None, calls: list[dict[str, Any]]
) -> None:
    # What AutoConfig.from_pretrained leaves behind: config.json alone.
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    cache = tmp_path / "hub"
    partial = add_snapshot(cache, REPO, src, MAIN, ("main",))
    with pytest.raises(ValueError, match=rf"its cached snapshot {partial} lacks model.safetensors .*HF_HUB_OFFLINE"):
        resolve_model(REPO, None, download_dir=str(cache))


def test_download_happens_after_a_local_miss_only(
    tmp_path: Path, tiny_model_dir: Path, online: None, calls: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hub"

    def download(repo_id: str, **kwargs: Any) -> str:  # what the hub would leave in the cache
        return str(add_snapshot(Path(kwargs["cache_dir"]), repo_id, tiny_model_dir, V1, (kwargs["revision"],)))

    huggingface_hub.snapshot_download.download = download  # type: ignore[attr-defined]
    assert resolve_model(REPO, None, revision="v1", download_dir=str(cache), token="hf_x") == snapshot(cache, V1)
    assert [c["local_files_only"] for c in calls] == [True, False]
    for call in calls:
        assert {k: call[k] for k in ("repo_id", "revision", "cache_dir", "token")} == {
            "repo_id": REPO, "revision": "v1", "cache_dir": str(cache), "token": "hf_x"
        }
        assert call["allow_patterns"] == list(MODEL_PATTERNS)
    calls.clear()
    assert resolve_model(REPO, None, revision="v1", download_dir=str(cache)) == snapshot(cache, V1)
    assert [c["local_files_only"] for c in calls] == [True]  # now cached: no second download


def test_downloaded_repo_without_safetensors(
    tmp_path: Path, tiny_model_dir: Path, online: None, calls: list[dict[str, Any]]
) -> None:
    src = tmp_path / "src"  # a GGUF-only repo: the allow patterns leave its configs alone
    src.mkdir()
    (src / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())

    def download(repo_id: str, **kwargs: Any) -> str:
        return str(add_snapshot(Path(kwargs["cache_dir"]), repo_id, src, MAIN, ("main",)))

    huggingface_hub.snapshot_download.download = download  # type: ignore[attr-defined]
    with pytest.raises(
        ValueError,
        match=(
            r"^model: 'owner/gguf' \(revision 'main'\) was downloaded to .* lacks model\.safetensors; triollm needs "
            r"safetensors weights"
        ),
    ):
        resolve_model("owner/gguf", None, download_dir=str(tmp_path / "hub"))


def _http_error(cls: type[Exception], status: int) -> Exception:
    response = types.SimpleNamespace(status_code=status, headers={}, request=None)
    return cls(
        f"{status} Client Error.\n\nRepository Not Found for url: https://huggingface.co/api/models/x",
        response=response,
    )


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            lambda: _http_error(errors.RepositoryNotFoundError, 401),
            r"no such repository on the Hub, or it is gated/private: log in with `hf auth login` \(or "
            r"`huggingface-cli login`\) or pass hf_token",
        ),
        (
            lambda: _http_error(errors.GatedRepoError, 403),
            r"the repository is gated: accept its conditions at https://huggingface.co/owner/absent",
        ),
        (lambda: _http_error(errors.RevisionNotFoundError, 404), r"the repository has no revision 'main'"),
        (lambda: _http_error(errors.HfHubHTTPError, 401), r"the Hub refused access \(HTTP 401\)"),
        (
            lambda: errors.LocalEntryNotFoundError("Got: ConnectError: [Errno 101] Network is unreachable\nmore"),
            r"the Hub could not be reached \(a network error: Got: ConnectError: \[Errno 101\] Network is "
            r"unreachable\)",
        ),
    ],
    ids=["not-found", "gated", "no-revision", "http-401", "unreachable"],
)
def test_failed_download_is_one_clear_error(
    tmp_path: Path, error: Any, expected: str, online: None, calls: list[dict[str, Any]]
) -> None:
    def download(repo_id: str, **kwargs: Any) -> str:
        raise error()

    huggingface_hub.snapshot_download.download = download  # type: ignore[attr-defined]
    with pytest.raises(ValueError) as info:
        resolve_model("owner/absent", None, download_dir=str(tmp_path))
    message = str(info.value)
    assert message.startswith(f"model: 'owner/absent' is not a local path, not in the Hugging Face cache at {tmp_path}")
    assert "and the download failed: " in message and "`hf download owner/absent --cache-dir" in message
    assert re.search(expected, message), message
    assert "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no traceback wall
    assert [c["local_files_only"] for c in calls] == [True, False]


def test_allow_patterns_fetch_what_a_model_needs_only() -> None:
    repo_files = [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "merges.txt",
        "vocab.json",
        "vocab.txt",
        "chat_template.jinja",
        "qwen.tiktoken",
        "1_Pooling/config.json",
        "pytorch_model.bin",
        "model.pt",
        "flax_model.msgpack",
        "tf_model.h5",
        "onnx/model.onnx",
        "README.md",
        ".gitattributes",
    ]
    kept = list(filter_repo_objects(repo_files, allow_patterns=list(MODEL_PATTERNS)))
    assert kept == repo_files[:13]


def test_hub_id_detection(tmp_path: Path) -> None:
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("gpt2")
    (tmp_path / "owner").mkdir()
    for name in (
        "no/such/dir",
        "x.gguf",
        "owner/model.gguf",
        "/abs/path",
        "./rel",
        "~/x",
        "a b",
        "",
        None,
        str(tmp_path),
    ):
        assert not is_hub_id(name), name


def test_hub_options_on_a_local_model_are_ignored(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module.ignored, "_warned", set())
    config = EngineArgs(model=str(tiny_model_dir), tokenizer_revision="v1", hf_token="x").create_engine_config()
    assert sorted(config.ignored_args) == ["hf_token", "tokenizer_revision"]


def test_serve_cli_takes_a_hub_id(hub_cache: Path, offline: None) -> None:
    ns = build_parser().parse_args(["serve", REPO, "--download-dir", str(hub_cache), "--revision", "v1"])
    assert (ns.model_tag, ns.download_dir, ns.revision) == (REPO, str(hub_cache), "v1")
    ns.model = ns.model_tag  # as cmd_serve does
    assert EngineArgs.from_cli_args(ns).create_engine_config().model.path == snapshot(hub_cache, V1)
