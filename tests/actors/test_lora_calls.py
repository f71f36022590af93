"""vLLM's `remove_lora`, `list_loras` and `pin_lora` (AsyncLLM, and LLMEngine's), on the tiny model
with two random PEFT adapters, the engine core in process and in a child process: a removed id
may name another adapter afterwards, and the engine core serves the new one's weights (it forgot
the old ones), not a stale copy."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from lora_adapters import make_peft_adapter

from triollm import LLM, AsyncLLM, SamplingParams
from triollm.api.app import build_app
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs
from triollm.lora.request import LoRARequest

pytestmark = pytest.mark.anyio

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def paths(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora-calls")
    return {name: str(make_peft_adapter(tiny_model_dir, root / name, seed=seed)) for name, seed in (("a", 1), ("b", 2))}


def _args(model: Path, multiprocess: bool) -> EngineArgs:
    return EngineArgs(
        model=str(model), max_model_len=128, seed=0, multiprocess=multiprocess,
        enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip


@pytest.fixture(params=[False, True], ids=["in-process", "multiprocess"])
async def llm(tiny_model_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[AsyncLLM]:
    async with AsyncLLM.from_engine_args(_args(tiny_model_dir, request.param)) as engine:
        yield engine


async def _tokens(llm: AsyncLLM, lora: LoRARequest | None, rid: str) -> list[int]:
    outs = [out async for out in llm.generate(PROMPT, GREEDY, rid, lora_request=lora)]
    return list(outs[-1].outputs[0].token_ids)


async def test_remove_list_and_pin(llm: AsyncLLM, paths: dict[str, str]) -> None:
    a, b = LoRARequest("a", 1, paths["a"]), LoRARequest("b", 2, paths["b"])
    assert await llm.list_loras() == set()
    assert await llm.add_lora(a)
    assert await llm.list_loras() == {1}
    with_a, with_b = await _tokens(llm, a, "1"), await _tokens(llm, b, "2")
    assert with_a != with_b
    assert await llm.list_loras() == {1, 2}
    assert await llm.pin_lora(1)
    await llm.sleep(2)
    await llm.wake_up()
    assert await llm.collective_rpc(lambda worker: worker.lora.pinned) == [{1}]  # pins outlive sleep
    with pytest.raises(ValueError, match=r"lora_id: 99 is not a known adapter"):
        await llm.pin_lora(99)
    with pytest.raises(ValueError, match=r"lora_id: 2 cannot be pinned: 1 of max_loras=2"):
        await llm.pin_lora(2)  # one slot must stay free
    assert await llm.remove_lora(1)
    assert await llm.list_loras() == {2}
    assert not await llm.remove_lora(1)
    # Id 1 now names b's weights: the engine core forgot a's, so b's tokens come out.
    assert await _tokens(llm, LoRARequest("b-again", 1, paths["b"]), "3") == with_b


async def test_the_unload_route_removes_the_adapter_from_the_engine(llm: AsyncLLM, paths: dict[str, str]) -> None:
    settings = ServerSettings(served_model_names=("base",), allow_runtime_lora_updating=True)
    transport = httpx.ASGITransport(app=build_app(ServerState(llm, settings)))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": paths["a"]})
        assert r.status_code == 200, r.text
        (lora_id,) = await llm.list_loras()
        r = await http.post("/v1/completions", json={"model": "a", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert await llm.collective_rpc(lambda worker: set(worker.lora.cpu)) == [{lora_id}]
        assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})).status_code == 200
        assert await llm.list_loras() == set()
        assert await llm.collective_rpc(lambda worker: set(worker.lora.cpu)) == [set()]  # the engine's copy went


def test_llm_engine_lora_calls(tiny_model_dir: Path, paths: dict[str, str]) -> None:
    llm = LLM.from_engine_args(_args(tiny_model_dir, False))
    try:
        engine = llm.llm_engine
        assert engine.add_lora(LoRARequest("a", 7, paths["a"]))
        assert engine.list_loras() == {7}
        assert engine.pin_lora(7)
        assert engine.remove_lora(7)
        assert engine.list_loras() == set()
    finally:
        llm.shutdown()
