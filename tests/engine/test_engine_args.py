"""One argument schema: `LLM(**kw)`, `EngineArgs(**kw)` and `triollm serve --flag` accept the same
vLLM names with the same meaning; what has no effect here is accepted and said once in the log;
what cannot be honoured is a ValueError naming the field and the allowed values."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from tinymodel import build_tokenizer

from triollm import LLM, SamplingParams, TokensPrompt
from triollm.actors.llm import engine_args_from_kwargs
from triollm.api.cli import build_parser
from triollm.engine import config as config_module
from triollm.engine.config import IGNORED_ARGS, EngineArgs
from triollm.engine.execution import executor as core_module
from triollm.engine.processing.tokenizer import Tokenizer

# What people pass to vLLM's `LLM(...)` and `vllm serve` (quickstart, examples/offline_inference),
# as keyword -> CLI words. Every pair must build the same EngineArgs both ways.
VLLM_USAGE: dict[str, tuple[Any, list[str]]] = {
    "dtype": ("half", ["--dtype", "half"]),
    "seed": (1, ["--seed", "1"]),
    "max_model_len": (128, ["--max-model-len", "128"]),
    "max_num_seqs": (8, ["--max-num-seqs", "8"]),
    "max_num_batched_tokens": (512, ["--max-num-batched-tokens", "512"]),
    "gpu_memory_utilization": (0.5, ["--gpu-memory-utilization", "0.5"]),
    "enforce_eager": (True, ["--enforce-eager"]),
    "trust_remote_code": (True, ["--trust-remote-code"]),
    "disable_log_stats": (True, ["--disable-log-stats"]),
    "kv_cache_dtype": ("auto", ["--kv-cache-dtype", "auto"]),
    "revision": ("main", ["--revision", "main"]),
    "tokenizer_revision": ("main", ["--tokenizer-revision", "main"]),
    "download_dir": ("/tmp/x", ["--download-dir", "/tmp/x"]),
    "load_format": ("safetensors", ["--load-format", "safetensors"]),
    "tokenizer_mode": ("auto", ["--tokenizer-mode", "auto"]),
    "max_seq_len_to_capture": (4096, ["--max-seq-len-to-capture", "4096"]),
    "disable_custom_all_reduce": (True, ["--disable-custom-all-reduce"]),
    "tensor_parallel_size": (1, ["--tensor-parallel-size", "1"]),
    "pipeline_parallel_size": (1, ["--pipeline-parallel-size", "1"]),
    "distributed_executor_backend": ("mp", ["--distributed-executor-backend", "mp"]),
    "enable_prefix_caching": (False, ["--no-enable-prefix-caching"]),
    "enable_chunked_prefill": (True, ["--enable-chunked-prefill"]),
    "block_size": (32, ["--block-size", "32"]),
    "max_logprobs": (5, ["--max-logprobs", "5"]),
    "quantization": (None, []),
    "served_model_name": (["a", "b"], ["--served-model-name", "a", "b"]),
    "skip_tokenizer_init": (False, ["--no-skip-tokenizer-init"]),
    "hf_token": ("hf_x", ["--hf-token", "hf_x"]),
    "cpu_offload_gb": (0.0, ["--cpu-offload-gb", "0"]),
    "num_gpu_blocks_override": (64, ["--num-gpu-blocks-override", "64"]),
    "compilation_config": (3, ["--compilation-config", "3"]),
    "renderer_num_workers": (2, ["--renderer-num-workers", "2"]),
}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a fresh process would: nothing warned about yet."""
    monkeypatch.setattr(config_module.ignored, "_warned", set())


def serve_args(*words: str) -> EngineArgs:
    return EngineArgs.from_cli_args(build_parser().parse_args(["serve", *words]))


def test_llm_kwargs_and_cli_flags_build_the_same_engine_args(tiny_model_dir: Path) -> None:
    kwargs = {name: value for name, (value, _) in VLLM_USAGE.items()}
    words = [w for _, flag in VLLM_USAGE.values() for w in flag]
    from_llm = engine_args_from_kwargs(str(tiny_model_dir), **kwargs)
    from_cli = serve_args("--model", str(tiny_model_dir), *words)
    assert from_llm == from_cli == EngineArgs(model=str(tiny_model_dir), **kwargs)
    assert from_cli.dtype == "float16" and from_cli.served_model_name == ["a", "b"]


def test_a_pathlib_path_is_taken_as_its_string(tiny_model_dir: Path) -> None:
    """`LLM(model=Path(...))` (scripts build paths with pathlib) loads as the string would: the
    loader once called `.strip()` on it."""
    args = engine_args_from_kwargs(tiny_model_dir, tokenizer=tiny_model_dir, download_dir=tiny_model_dir)
    assert args == engine_args_from_kwargs(
        str(tiny_model_dir), tokenizer=str(tiny_model_dir), download_dir=str(tiny_model_dir)
    )
    assert isinstance(args.model, str) and isinstance(args.tokenizer, str)


def test_every_field_is_a_flag_and_every_flag_a_field() -> None:
    parser = build_parser()
    for name in EngineArgs.field_names():
        flag = "--" + name.replace("_", "-")
        assert any(flag in a.option_strings for a in _serve_parser(parser)._actions), flag


def _serve_parser(parser: Any) -> Any:
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["serve"]


def test_unknown_names_are_rejected_by_both(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for removed in ("not_a_flag", "inject_fault_at_step"):
        with pytest.raises(TypeError, match=f"unexpected keyword arguments: {removed}"):
            LLM(str(tiny_model_dir), **{removed: 1})
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["serve", "--" + removed.replace("_", "-"), "1"])
        assert info.value.code == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--load-format", "scripted"])
    assert "invalid choice: 'scripted'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"load_format": "scripted"}, "load_format: 'scripted' is not supported; allowed: auto, safetensors, gguf"),
        ({"load_format": "dummy"}, "load_format: 'dummy' is not supported; allowed: auto"),
        (
            {"kv_cache_dtype": "fp4"},
            "kv_cache_dtype: 'fp4' is not supported; allowed: auto, bfloat16, float32, fp8, fp8_e4m3, fp8_e5m2, "
            "int8, q8_0",
        ),
        (
            {"quantization": "bitsandbytes"},
            "quantization: 'bitsandbytes' is not supported; allowed: gguf, int8, int4, gptq, gptq_marlin, awq, "
            "awq_marlin, fp8, compressed-tensors, none",
        ),
        ({"dtype": "fp16"}, "dtype: 'fp16' is not one of auto, half, float16, bfloat16, float, float32"),
        ({"dtype": torch.float64}, "dtype: torch.float64 is not one of torch.float16"),
        ({"tokenizer_mode": "mistral"}, "tokenizer_mode: 'mistral' is not supported; allowed: auto, hf, slow"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size: 2 is not supported"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization: must be in \(0, 1\]"),
        (
            {"kv_transfer_config": {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}},
            "Invalid 'kv_transfer_config' provided: triollm has no KV transfer",
        ),
    ],
)
def test_values_that_cannot_be_honoured_name_the_field(
    tiny_model_dir: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_model_dir), **kwargs)
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tiny_model_dir), **kwargs)


def test_kv_transfer_config_from_the_cli_is_the_same_error(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="Invalid 'kv_transfer_config' provided"):
        serve_args("--kv-transfer-config", '{"kv_connector": "X"}')


def test_dtype_aliases(tiny_model_dir: Path) -> None:
    expected = {
        "half": ("float16", torch.float16),
        "float16": ("float16", torch.float16),
        "bfloat16": ("bfloat16", torch.bfloat16),
        "float": ("float32", torch.float32),
        "float32": ("float32", torch.float32),
        "FLOAT": ("float32", torch.float32),
        torch.float16: ("float16", torch.float16),
        torch.bfloat16: ("bfloat16", torch.bfloat16),
    }
    for given, (name, dtype) in expected.items():
        args = EngineArgs(model=str(tiny_model_dir), dtype=given, device="cpu")
        assert args.dtype == name
        assert args.create_engine_config().model.dtype == dtype
    auto = EngineArgs(model=str(tiny_model_dir), device="cpu")
    assert auto.dtype == "auto" and auto.create_engine_config().model.dtype == torch.float32


def test_swap_space_is_deprecated_and_dropped(tiny_model_dir: Path) -> None:
    with pytest.warns(DeprecationWarning, match="swap_space is deprecated"):
        args = EngineArgs(model=str(tiny_model_dir), swap_space=4)
    assert args.swap_space is None
    with pytest.warns(DeprecationWarning, match="swap_space"):
        assert serve_args("--swap-space", "4").swap_space is None


def test_ignored_args_are_logged_once_per_name(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="triollm")
    kwargs: dict[str, Any] = {
        "trust_remote_code": True,
        "revision": "main",
        "download_dir": "/tmp/models",
        "distributed_executor_backend": "mp",
        "gpu_memory_utilization": 0.5,
        "renderer_num_workers": 4,
        "tokenizer_mode": "slow",
        "enforce_eager": True,  # honoured: the model always runs eagerly
        "disable_log_stats": True,  # honoured: no periodic stats are logged
    }
    args = EngineArgs(model=str(tiny_model_dir), device="cpu", **kwargs)
    config = args.create_engine_config()
    ignored = (
        "trust_remote_code", "revision", "download_dir", "distributed_executor_backend",
        "renderer_num_workers", "gpu_memory_utilization", "tokenizer_mode",
    )
    assert sorted(config.ignored_args) == sorted(ignored)
    assert config.cache.gpu_memory_utilization == 0.5  # recorded for the CUDA path
    logged = [r.getMessage() for r in caplog.records if r.name == "triollm"]
    for name in ignored:
        assert sum(m.startswith(f"{name}=") for m in logged) == 1, name
    assert any("trust_remote_code=True has no effect" in m for m in logged)
    caplog.clear()
    args.create_engine_config()  # e.g. a second LLM in the same process
    assert not [r for r in caplog.records if r.name == "triollm"]


def test_defaults_log_nothing(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="triollm")
    assert EngineArgs(model=str(tiny_model_dir)).create_engine_config().ignored_args == ()
    assert not caplog.records
    assert set(IGNORED_ARGS) <= set(EngineArgs.field_names())


def test_gpu_memory_utilization_sizes_the_cuda_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (60 * gib, 80 * gib))  # 20 GiB in use
    assert core_module.default_kv_budget("cuda", 0.9) == 52 * gib  # 72 GiB share - 20 in use
    assert core_module.default_kv_budget("cuda", 0.5) == 20 * gib
    with pytest.raises(ValueError, match="gpu_memory_utilization: 0.2 of 80.0 GiB leaves no room"):
        core_module.default_kv_budget("cuda", 0.2)


def test_multiprocess_env_is_read_once_into_the_config(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = EngineArgs(model=str(tiny_model_dir))
    monkeypatch.setenv("TRIOLLM_MULTIPROCESS", "0")
    config = args.create_engine_config()
    assert config.actor.multiprocess is False
    monkeypatch.setenv("TRIOLLM_MULTIPROCESS", "1")
    assert config.actor.multiprocess is False  # frozen: later changes do not leak in
    assert args.create_engine_config().actor.multiprocess is True
    assert EngineArgs(model=str(tiny_model_dir), multiprocess=False).create_engine_config().actor.multiprocess is False
    monkeypatch.setenv("TRIOLLM_MULTIPROCESS", "yes")
    with pytest.raises(ValueError, match="TRIOLLM_MULTIPROCESS: 'yes' is not 0 or 1"):
        args.create_engine_config()
    monkeypatch.delenv("TRIOLLM_MULTIPROCESS")
    actor = EngineArgs(
        model=str(tiny_model_dir), output_chunk_size=7, zmq_address="tcp://127.0.0.1", max_logprobs=3
    ).create_engine_config().actor
    assert (actor.multiprocess, actor.output_chunk_size, actor.zmq_address, actor.max_logprobs) == (
        True, 7, "tcp://127.0.0.1", 3,
    )


def test_plain_tcp_is_an_explicit_setting(tiny_model_dir: Path) -> None:
    """`zmq_insecure_tcp` is off by default and a flag like any other; only a real bool counts."""
    tcp = ["--model", str(tiny_model_dir), "--zmq-address", "tcp://127.0.0.1"]
    assert serve_args(*tcp).create_engine_config().actor.zmq_insecure_tcp is False
    args = serve_args(*tcp, "--zmq-insecure-tcp")
    assert args == EngineArgs(
        model=str(tiny_model_dir), zmq_address="tcp://127.0.0.1", zmq_insecure_tcp=True
    )
    assert args.create_engine_config().actor.zmq_insecure_tcp is True
    assert serve_args(*tcp, "--no-zmq-insecure-tcp").zmq_insecure_tcp is False
    with pytest.raises(ValueError, match="zmq_insecure_tcp: must be True or False, got '1'"):
        EngineArgs(model=str(tiny_model_dir), zmq_insecure_tcp="1").create_engine_config()  # type: ignore[arg-type]


# ------------------------------------------------------------------ tokenizer=


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer with a smaller vocabulary than the tiny model's (its ids fit the model)."""
    path = tmp_path_factory.mktemp("other-tokenizer")
    build_tokenizer(vocab_size=300).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": "OTHER{{ messages[0]['content'] }}"})
    )
    return path


def test_tokenizer_is_honoured(tiny_model_dir: Path, other_tokenizer_dir: Path) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    other = Tokenizer.from_pretrained(other_tokenizer_dir)
    own = Tokenizer.from_pretrained(tiny_model_dir)
    assert other.encode(text) != own.encode(text)
    args = serve_args("--model", str(tiny_model_dir), "--tokenizer", str(other_tokenizer_dir))
    assert args.create_engine_config().tokenizer == other_tokenizer_dir
    with LLM(str(tiny_model_dir), tokenizer=str(other_tokenizer_dir), max_model_len=128, multiprocess=False) as llm:
        assert llm.get_tokenizer().chat_template == "OTHER{{ messages[0]['content'] }}"
        out = llm.generate(text, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
        assert out.prompt_token_ids == other.encode(text)
        assert out.outputs[0].text == other.decode(out.outputs[0].token_ids)


def test_a_bad_tokenizer_path_names_the_field(tiny_model_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    for bad in (empty, tmp_path / "missing"):
        with pytest.raises(ValueError, match=f"tokenizer: {bad} is not a directory holding tokenizer.json"):
            EngineArgs(model=str(tiny_model_dir), tokenizer=str(bad)).create_engine_config()


def test_tokenizer_reaches_a_copied_model_without_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's common split: weights in one directory, the tokenizer in another."""
    weights = tmp_path / "weights-only"
    weights.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(tiny_model_dir / name, weights / name)
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        with LLM(str(weights), max_model_len=64, multiprocess=False):
            pass
    with LLM(str(weights), tokenizer=str(tiny_model_dir), max_model_len=64, multiprocess=False) as llm:
        out = llm.generate("Hello", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 2


# ------------------------------------------------------------------ a vLLM script, unchanged


def test_a_vllm_offline_script_runs_unchanged(tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="triollm")
    llm = LLM(
        model=str(tiny_model_dir),
        tokenizer=str(tiny_model_dir),
        dtype="float",
        trust_remote_code=True,
        gpu_memory_utilization=0.8,
        enforce_eager=True,
        max_model_len=128,
        seed=0,
        tensor_parallel_size=1,
        disable_log_stats=True,
        multiprocess=False,
    )
    with llm:
        tokenizer = llm.get_tokenizer()
        messages = [{"role": "user", "content": "Hello"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        by_text, by_ids = llm.generate([text, TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        assert by_text.prompt_token_ids == ids == by_ids.prompt_token_ids
        assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
        assert tokenizer.decode(by_ids.outputs[0].token_ids) == by_ids.outputs[0].text
    assert {m.getMessage().split("=")[0] for m in caplog.records} == {
        "trust_remote_code", "gpu_memory_utilization"
    }


def test_the_engine_core_process_does_not_warn_again(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.WARNING, logger="triollm")
    with LLM(str(tiny_model_dir), max_model_len=64, trust_remote_code=True, multiprocess=True) as llm:
        out = llm.generate("Hello", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 2
    assert [r.getMessage().split("=")[0] for r in caplog.records] == ["trust_remote_code"]
    assert "trust_remote_code" not in capfd.readouterr().err  # nothing from the child


def test_vllm_example_argument_parsing(tiny_model_dir: Path) -> None:
    """vLLM's examples/offline_inference/basic/generate.py, with argparse for its parser."""
    import argparse

    parser = argparse.ArgumentParser()
    engine_group = parser.add_argument_group("Engine arguments")
    assert EngineArgs.add_cli_args(engine_group) is engine_group
    engine_group.set_defaults(model=str(tiny_model_dir))
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int, default=3)
    args = vars(parser.parse_args(["--max-model-len", "64", "--no-multiprocess", "--dtype", "float"]))
    max_tokens = args.pop("max_tokens")
    with LLM(**args) as llm:
        out = llm.generate("Hello, my name is", SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_auto_dtype_on_cuda_is_half_precision() -> None:
    """As vLLM on a GPU: a half-precision checkpoint keeps its dtype, anything else runs in bf16
    (the Triton kernels' dtype); on CPU an fp32 checkpoint stays fp32."""
    import torch

    from triollm.engine.loading.model_config import _resolve_dtype

    assert _resolve_dtype("auto", torch.float32, "cuda") == torch.bfloat16
    assert _resolve_dtype("auto", None, "cuda") == torch.bfloat16
    assert _resolve_dtype("auto", torch.float16, "cuda") == torch.float16
    assert _resolve_dtype("auto", torch.float32, "cpu") == torch.float32


def test_vllm_cpu_kvcache_space_sizes_the_cpu_kv_cache(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM-CPU containers size the cache with $VLLM_CPU_KVCACHE_SPACE (GiB); an explicit
    kv_cache_memory_bytes wins; 0 means "measure"; a bad value is refused at config time."""
    from triollm.engine.sync_engine import SyncEngine

    args = EngineArgs(model=str(tiny_model_dir), max_model_len=64, max_num_seqs=256)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.0005")
    config = args.create_engine_config()
    assert config.cache.kv_cache_memory_bytes == int(0.0005 * 2**30)
    engine = SyncEngine.from_engine_args(args)
    small = engine.core.statistics().num_blocks
    [out] = engine.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out.outputs[0].token_ids) == 4
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.001")
    assert SyncEngine.from_engine_args(args).core.statistics().num_blocks > small
    explicit = EngineArgs(model=str(tiny_model_dir), max_model_len=64, kv_cache_memory_bytes=12345678)
    assert explicit.create_engine_config().cache.kv_cache_memory_bytes == 12345678
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
    assert args.create_engine_config().cache.kv_cache_memory_bytes is None
    for bad in ("-1", "lots"):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", bad)
        with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE: .* is not a number of GiB"):
            args.create_engine_config()


def test_vllm_short_flags_pp_and_O(tiny_model_dir: Path) -> None:
    """`-pp 1` and `-O3` as vLLM's recipes write them (they exited 2): -pp is
    --pipeline-parallel-size (1 only here), -O3 is --compilation-config 3."""
    args = serve_args(str(tiny_model_dir), "-pp", "1", "-O3")
    assert args.pipeline_parallel_size == 1 and args.compilation_config.level == 3
    assert serve_args(str(tiny_model_dir), "-O", '{"level": 0}').compilation_config.level == 0
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        serve_args(str(tiny_model_dir), "-pp", "2").create_engine_config()
