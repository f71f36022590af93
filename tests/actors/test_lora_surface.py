"""LoRA's offline and async surface: `lora_request=` on `LLM.generate` / `chat` / `beam_search` /
`enqueue`, `LLMEngine.add_request`, `AsyncLLM.generate` / `add_request` / `beam_search` and
`SyncEngine`, as vLLM spells them.

- Plumbing (runs now): the adapter given reaches every core request of its request (the n > 1
  children and every beam of a search included), a list gives one adapter per prompt, `None`
  entries run the base model; a LoRA-less engine, a list of the wrong length, an adapter whose
  rank is above `max_lora_rank` or whose config is malformed are `ValueError`s naming the field;
  an adapter's config is read once per id, and a second path under one id is refused.
- Numbers: one `LLM.generate` batch mixing two adapters and the base gives `peft`'s greedy tokens for each.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
from lora_adapters import make_peft_adapter, peft_greedy

from triollm import LLM, AsyncLLM, SamplingParams
from triollm.actors.messages import AddRequest
from triollm.engine.beam_search import BeamSearchParams
from triollm.engine.config import EngineArgs, LoRAConfig
from triollm.engine.frontend import lora as frontend_lora
from triollm.engine.frontend.lora import LoRAChecker
from triollm.engine.sync_engine import SyncEngine
from triollm.lora.request import LoRARequest
from triollm.testing import InputRecorder

MAX_MODEL_LEN = 128
N = 6  # greedy tokens compared with peft's
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0)
PROMPTS = ["The capital of France is", "Once upon a time there was", "def add(a, b):", "The quick brown fox"]

@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    """Two random PEFT adapters (r=8 and r=4, different targets), one of rank 16, one malformed."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora-surface")
    a = make_peft_adapter(tiny_model_dir, root / "a", seed=1, r=8)
    b = make_peft_adapter(tiny_model_dir, root / "b", seed=2, r=4, target_modules=("q_proj", "v_proj", "down_proj"))
    big = make_peft_adapter(tiny_model_dir, root / "big", seed=3, r=16)
    dora = root / "dora"
    shutil.copytree(a, dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    return {
        "a": LoRARequest("a", 1, str(a)),
        "b": LoRARequest("b", 2, str(b)),
        "big": LoRARequest("big", 3, str(big)),
        "dora": LoRARequest("dora", 4, str(dora)),
    }


def lora_args(model: Path, **overrides: Any) -> EngineArgs:
    kw: dict[str, Any] = dict(model=str(model), max_model_len=MAX_MODEL_LEN, multiprocess=False, seed=0)
    kw.update(enable_lora=True, max_loras=2, max_lora_rank=8)
    kw.update(overrides)
    return EngineArgs(**kw)


# ------------------------------------------------------------------------------ the checker


def test_checker_reads_an_adapter_once_and_keeps_ids_apart(
    adapters: dict[str, LoRARequest], monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    real = frontend_lora.read_adapter_config

    def counting(path: str, **kw: Any) -> Any:
        reads.append(path)
        return real(path, **kw)

    monkeypatch.setattr(frontend_lora, "read_adapter_config", counting)
    checker = LoRAChecker(LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2, dtype="float32"))
    a = adapters["a"]
    assert checker.needs_io(a) and not checker.needs_io(None)
    for _ in range(3):
        assert checker.check(a) is a
    assert reads == [a.lora_path] and not checker.needs_io(a)
    assert checker.check(None) is None
    with pytest.raises(ValueError, match=r"^lora_int_id: 1 is already the id of the adapter at"):
        checker.check(LoRARequest("other", 1, adapters["b"].lora_path))
    with pytest.raises(ValueError, match=r"^lora_request: must be a LoRARequest or None, got str"):
        checker.check("a")
    with pytest.raises(ValueError, match=r"r=16 is above max_lora_rank=8"):
        checker.check(adapters["big"])
    with pytest.raises(ValueError, match=r"^lora_path: .*dora.*use_dora=True is not supported"):
        checker.check(adapters["dora"])
    with pytest.raises(ValueError, match=r"^lora_request: LoRA adapters are not enabled.*enable_lora=True"):
        LoRAChecker(None).check(a)


def test_sync_engine_carries_adapters_and_refuses_them_without_lora(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = SyncEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, seed=0))
    with pytest.raises(ValueError, match=r"^lora_request: LoRA adapters are not enabled.*enable_lora=True"):
        plain.generate(PROMPTS[:2], GREEDY, lora_request=adapters["a"])
    assert not plain.has_unfinished_requests()
    engine = SyncEngine.from_engine_args(lora_args(tiny_model_dir))
    sent: list[Any] = []
    real_add = engine.core.add_request
    monkeypatch.setattr(engine.core, "add_request", lambda req: sent.append(req) or real_add(req))
    outs = engine.generate(PROMPTS[:3], GREEDY, lora_request=[adapters["a"], None, adapters["b"]])
    assert [len(o.outputs[0].token_ids) for o in outs] == [N] * 3
    assert [r.lora_request for r in sent] == [adapters["a"], None, adapters["b"]]
    with pytest.raises(ValueError, match=r"^lora_request: 1 given for 2 prompts"):
        engine.generate(PROMPTS[:2], GREEDY, lora_request=[adapters["a"]])


# ------------------------------------------------------------------------------ LLM and LLMEngine


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path, adapters: dict[str, LoRARequest]) -> Iterator[LLM]:
    args = lora_args(tiny_model_dir)
    with LLM.from_engine_args(args) as engine:
        yield engine


@pytest.fixture
def spy(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[LoRARequest | None]:
    """The `lora_request` of every `AsyncLLM.add_request` the LLM makes (its portal's engine)."""
    seen: list[LoRARequest | None] = []
    engine = llm.llm_engine.async_llm
    real = engine.add_request

    async def add_request(*args: Any, lora_request: LoRARequest | None = None, **kw: Any) -> Any:
        seen.append(lora_request)
        return await real(*args, lora_request=lora_request, **kw)

    monkeypatch.setattr(engine, "add_request", add_request)
    return seen


def test_generate_takes_one_adapter_or_one_per_prompt(
    llm: LLM, adapters: dict[str, LoRARequest], spy: list[Any]
) -> None:
    a, b = adapters["a"], adapters["b"]
    outs = llm.generate(PROMPTS, GREEDY, lora_request=[a, None, b, a], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [N] * 4
    assert spy == [a, None, b, a]
    spy.clear()
    llm.generate(PROMPTS[:2], GREEDY, lora_request=b, use_tqdm=False)
    assert spy == [b, b]
    with pytest.raises(ValueError, match=r"^lora_request: the list has 1 entries for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[a], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^lora_request: must be a LoRARequest, a list of one per prompt, or None"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request="a", use_tqdm=False)  # type: ignore[arg-type]


def test_rank_above_max_and_malformed_adapters_are_refused(llm: LLM, adapters: dict[str, LoRARequest]) -> None:
    with pytest.raises(ValueError, match=r"^lora_path: .*big.*r=16 is above max_lora_rank=8"):
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[adapters["a"], adapters["big"]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^lora_path: .*use_dora=True"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=adapters["dora"], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^lora_path: '/nonexistent/adapter' is not a LoRA adapter directory"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("gone", 9, "/nonexistent/adapter"), use_tqdm=False)
    assert llm.llm_engine.async_llm.num_unfinished_requests == 0  # the batch's other requests were aborted
    assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == N  # still serving


def test_chat_beam_search_enqueue_and_llm_engine_carry_adapters(
    llm: LLM, adapters: dict[str, LoRARequest], spy: list[Any]
) -> None:
    a, b = adapters["a"], adapters["b"]
    conversation = [{"role": "user", "content": "Hello"}]
    llm.chat([conversation, conversation], GREEDY, lora_request=[None, b], use_tqdm=False)
    assert spy == [None, b]
    spy.clear()
    results = llm.beam_search(
        [{"prompt_token_ids": [5, 6, 7]}, "Hi"], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=[a, b]
    )
    assert len(results) == 2 and all(len(r.sequences) == 2 for r in results)
    # Round 1 runs one beam per prompt, round 2 two: every beam under its prompt's adapter.
    assert spy == [a, b, a, a, b, b]
    spy.clear()
    ids = llm.enqueue(PROMPTS[:2], GREEDY, lora_request=a)
    ids.append(llm.llm_engine.add_request("engine-lora", PROMPTS[2], GREEDY.clone(), lora_request=b))
    outs = {o.request_id: o for o in llm.wait_for_completion(use_tqdm=False)}
    assert sorted(outs) == sorted(ids) and spy == [a, a, b]


def test_a_batch_mixing_adapters_and_the_base_gives_peft_tokens(
    llm: LLM, adapters: dict[str, LoRARequest], tiny_model_dir: Path
) -> None:
    a, b = adapters["a"], adapters["b"]
    tokenizer = llm.get_tokenizer()
    loras = [a, b, None, a]
    outs = llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    want = [
        peft_greedy(tiny_model_dir, None if lora is None else Path(lora.lora_path), tokenizer.encode(p), N)
        for p, lora in zip(PROMPTS, loras)
    ]
    assert got == want
    assert got[0] != list(
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    )  # a moves the tokens


# ------------------------------------------------------------------------------ AsyncLLM


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
async def tapped(
    tiny_model_dir: Path, adapters: dict[str, LoRARequest], anyio_backend: str
) -> AsyncIterator[tuple[AsyncLLM, InputRecorder]]:
    recorder = InputRecorder()
    async with AsyncLLM.from_engine_args(lora_args(tiny_model_dir), input_tap=recorder) as engine:
        yield engine, recorder


def added(recorder: InputRecorder) -> list[tuple[str, LoRARequest | None]]:
    return [
        (m.request.request_id.split("#")[0], m.request.lora_request) for m in recorder.sent if isinstance(m, AddRequest)
    ]


@pytest.mark.anyio
async def test_async_generate_children_and_beams_carry_the_adapter(
    tapped: tuple[AsyncLLM, InputRecorder], adapters: dict[str, LoRARequest]
) -> None:
    llm, recorder = tapped
    recorder.sent.clear()
    a, b = adapters["a"], adapters["b"]
    async with aclosing(llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, n=3), "n3", lora_request=a)) as gen:
        outs = [out async for out in gen]
    assert outs[-1].finished and len(outs[-1].outputs) == 3
    assert added(recorder) == [(f"{i}_n3", a) for i in range(3)]
    recorder.sent.clear()
    async with aclosing(
        llm.beam_search({"prompt_token_ids": [5, 6, 7]}, "beam", BeamSearchParams(beam_width=2, max_tokens=2), b)
    ) as gen:
        (result,) = [out async for out in gen]
    assert len(result.outputs) == 2
    assert [lora for _, lora in added(recorder)] == [b, b, b]  # one beam, then two
    recorder.sent.clear()
    stream = await llm.add_request("plain", PROMPTS[1], SamplingParams(max_tokens=1))
    with stream:
        [out async for out in stream]
    assert added(recorder) == [("plain", None)]
    assert await llm.add_lora(adapters["a"]) is True
    with pytest.raises(ValueError, match=r"^lora_path: .*r=16 is above max_lora_rank=8"):
        await llm.add_lora(adapters["big"])
    with pytest.raises(ValueError, match=r"^lora_path: .*use_dora"):
        await llm.add_request("bad", PROMPTS[0], SamplingParams(max_tokens=1), lora_request=adapters["dora"])
    assert llm.num_unfinished_requests == 0  # the refused request left nothing behind
