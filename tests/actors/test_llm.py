"""The sync `LLM` (blocking portal over AsyncLLM) and the legacy `LLMEngine`, on the tiny model."""

from __future__ import annotations

import _thread
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from triollm import LLM, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from triollm.engine.config import CompilationConfig

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["inproc-trio", "multiprocess-asyncio"])
def llm(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[LLM]:
    transport, backend = request.param.split("-")
    with LLM(
        str(tiny_model_dir),
        max_model_len=128,
        multiprocess=transport == "multiprocess",
        backend=backend,
        scheduling_policy="priority",
    ) as engine:
        yield engine


def idle(llm: LLM) -> None:
    stats = llm.llm_engine.portal.call(llm.llm_engine.async_llm.get_engine_stats)
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_blocks
    assert llm.llm_engine.async_llm.num_unfinished_requests == 0


def test_order_kept_and_matches_single_requests(llm: LLM) -> None:
    prompts = ["Hello", "The capital of France is", {"prompt_token_ids": [5, 6, 7]}, "abc"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello", "The capital of France is", None, "abc"]
    for prompt, out in zip(prompts, outs):
        alone = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 6 and out.finished
    idle(llm)


def test_params_list_and_priority(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 2, 3)]
    outs = llm.generate(["a", "b", "c"], params, use_tqdm=False, priority=[2, 1, 0])
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]
    with pytest.raises(ValueError, match="sampling_params: the list has 2 entries for 3 prompts"):
        llm.generate(["a", "b", "c"], params[:2], use_tqdm=False)
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a"], GREEDY, priority=[1, 2], use_tqdm=False)


def test_bad_prompt_in_batch_aborts_the_others(llm: LLM) -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        llm.generate("", GREEDY, use_tqdm=False)
    long = "x " * 300
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["fine", "also fine", long], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    idle(llm)
    assert len(llm.generate(["next batch"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_keyboard_interrupt_aborts_the_batch_and_leaves_llm_usable(llm: LLM) -> None:
    timer = threading.Timer(0.2, _thread.interrupt_main)
    start = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        # Far more work than 0.2 s: 512 requests filling the whole context.
        llm.generate(["long"] * 512, SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
    timer.join()
    assert time.monotonic() - start < 30
    idle(llm)  # the aborts ran before generate() returned
    assert len(llm.generate("after", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_chat_and_tokenizer(llm: LLM) -> None:
    convs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hello there"}]]
    outs = llm.chat(convs, GREEDY, use_tqdm=False)
    assert len(outs) == 2 and outs[0].prompt is not None and "<|im_start|>assistant" in outs[0].prompt
    one = llm.chat(convs[0], GREEDY, use_tqdm=False)
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert llm.get_tokenizer().decode(llm.get_tokenizer().encode("round trip")) == "round trip"


def test_tqdm_bar_reports_token_rates(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(["a", "b"], GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "output:" in err and "toks/s" in err


def test_config_normalisation(tiny_model_dir: Path) -> None:
    assert EngineArgs(compilation_config=3).compilation_config == CompilationConfig(level=3)
    assert EngineArgs(compilation_config={"level": 2}).compilation_config == CompilationConfig(level=2)
    with pytest.raises(ValueError, match="compilation_config: unknown key 'bogus'"):
        EngineArgs(compilation_config={"bogus": 1})
    with pytest.raises(ValueError, match="data_parallel_size: 2 is not supported by LLM .*data_parallel_offline.py"):
        LLM(str(tiny_model_dir), data_parallel_size=2)
    with pytest.raises(TypeError, match="unexpected keyword arguments: not_a_flag"):
        LLM(str(tiny_model_dir), not_a_flag=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with LLM(str(tiny_model_dir), swap_space=4, max_model_len=64, multiprocess=False) as llm:
            assert llm.args.max_model_len == 64
    assert any(issubclass(w.category, DeprecationWarning) and "swap_space" in str(w.message) for w in caught)


def test_startup_failure_is_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        LLM(str(tmp_path / "missing"))


def test_shutdown_is_idempotent(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=64, multiprocess=False)
    llm.shutdown()
    llm.shutdown()


def test_llm_engine_loop(tiny_model_dir: Path) -> None:
    with LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_model_len=128)) as engine:
        engine.add_request("a", "Hello", SamplingParams(max_tokens=5, ignore_eos=True))
        engine.add_request("b", "World", SamplingParams(max_tokens=9, ignore_eos=True))
        engine.add_request("c", "Gone", SamplingParams(max_tokens=1000, ignore_eos=True))
        engine.abort_request("c")
        final = {}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            steps += 1
        assert {k: len(v.outputs[0].token_ids) for k, v in final.items()} == {"a": 5, "b": 9}
        assert steps >= 2
        with pytest.raises(ValueError, match="empty"):
            engine.add_request("d", "", SamplingParams())


def test_llm_engine_step_merges_for_a_slow_script_and_aborts_once(tiny_model_dir: Path) -> None:
    """DELTA outputs: each step returns at most one output per request, a script that is slow
    between steps loses no token (the request's stream merged them), and a request aborted
    mid-flight returns nothing more."""
    delta = RequestOutputKind.DELTA
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=128, multiprocess=False)
    with LLMEngine.from_engine_args(args, backend="asyncio") as engine:
        for rid, n in (("a", 17), ("b", 30)):
            engine.add_request(rid, "Hello", SamplingParams(max_tokens=n, ignore_eos=True, output_kind=delta))
        engine.add_request("gone", "Hi", SamplingParams(max_tokens=100, ignore_eos=True, output_kind=delta))
        tokens: dict[str, int] = {}
        finished: set[str] = set()
        aborted = False
        while engine.has_unfinished_requests():
            outs = engine.step()
            ids = [o.request_id for o in outs]
            assert len(ids) == len(set(ids)), ids  # at most one output per request per step
            for o in outs:
                assert o.request_id not in finished
                tokens[o.request_id] = tokens.get(o.request_id, 0) + len(o.outputs[0].token_ids)
                if o.finished:
                    finished.add(o.request_id)
            if not aborted and "gone" in tokens:
                engine.abort_request("gone")
                aborted = True
                assert engine.get_num_unfinished_requests() == 2
            time.sleep(0.02)  # a slow script: several engine steps pass between our steps
        assert aborted and finished == {"a", "b"}
        assert (tokens["a"], tokens["b"]) == (17, 30)
        assert tokens["gone"] < 100
        assert engine.step() == []
        engine.add_request("a", "again", SamplingParams(max_tokens=2, ignore_eos=True))  # ids are free
        while engine.has_unfinished_requests():
            engine.step()


def test_offline_llm_gives_the_engine_every_core_unless_told(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline batches leave the frontend idle: the engine core's torch threads default to
    every core torch would use (here made 3), where AsyncLLM keeps one for the frontend."""
    import torch

    from triollm.actors.async_llm import AsyncLLM

    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    try:
        with LLM(str(tiny_model_dir), max_model_len=64, multiprocess=False) as llm:
            assert llm.args.num_threads == 3
            config = llm.llm_engine.async_llm.config
            assert config is not None and config.num_threads == 3
        with LLM(str(tiny_model_dir), max_model_len=64, multiprocess=False, num_threads=1) as llm:
            assert llm.args.num_threads == 1
    finally:
        torch.set_num_threads(before)  # the in-process engine set this process's threads
    assert AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model_dir))).args.num_threads is None
