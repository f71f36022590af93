"""`AsyncLLM.encode` on all-MiniLM-L6-v2, on trio and asyncio, in process and with the engine
core in a child process (the pooled bytes cross ZMQ in the output batch)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from triollm import AsyncEngineArgs, AsyncLLM, PoolingParams, PoolingRequestOutput

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module", params=["inproc", "multiprocess"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_encode(minilm_dir: Path, transport: str) -> None:
    args = AsyncEngineArgs(model=str(minilm_dir), multiprocess=transport == "multiprocess")
    async with AsyncLLM.from_engine_args(args) as llm:
        assert await llm.get_supported_tasks() == ("embed", "token_embed")
        texts = ["first sentence", "a second, longer sentence to pad the batch", "third"]
        results: dict[int, PoolingRequestOutput] = {}

        async def one(i: int) -> None:
            async for out in llm.encode(texts[i], PoolingParams(task="embed"), request_id=f"e{i}"):
                results[i] = out

        async with anyio.create_task_group() as tg:
            for i in range(len(texts)):
                tg.start_soon(one, i)
        for i, out in results.items():
            assert out.request_id == f"e{i}" and out.finished
            assert out.outputs.data.shape == (384,)
            assert torch.isclose(out.outputs.data.norm(), torch.tensor(1.0), atol=1e-5)
        alone = [o async for o in llm.encode(texts[1], request_id="again")]
        assert len(alone) == 1 and torch.allclose(alone[0].outputs.data, results[1].outputs.data, atol=1e-5)
        tokens = [o async for o in llm.encode("two words", PoolingParams(task="token_embed"))][0]
        assert tokens.outputs.data.shape == (4, 384)
        with pytest.raises(ValueError, match="prompt: must not be empty"):
            async for _ in llm.encode({"prompt_token_ids": []}):
                pass
        with pytest.raises(ValueError, match="Try passing `--runner generate`"):
            async for _ in llm.generate("Hello"):
                pass
        assert llm.num_unfinished_requests == 0 and not llm.errored


async def test_encode_on_a_generative_model(tiny_model_dir: Path) -> None:
    args = AsyncEngineArgs(model=str(tiny_model_dir), multiprocess=False, max_model_len=64)
    async with AsyncLLM.from_engine_args(args) as llm:
        with pytest.raises(ValueError, match="only supported for pooling models. Try passing `--runner pooling`"):
            async for _ in llm.encode("x"):
                pass
        with pytest.raises(ValueError, match="--runner pooling"):
            await llm.add_request("r", "x", PoolingParams())
