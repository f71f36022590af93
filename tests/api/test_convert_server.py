"""vLLM's `--convert` through the server (in process, httpx's ASGI transport): tiny random
causal LMs that transformers wrote, served as an embedder (`/v1/embeddings`), a classifier
(`/classify`, its score head read from `score.weight`) and a reward model (`/pooling` and
SageMaker's `/invocations`: per-token rewards), each against transformers' numbers on the same
checkpoint; the routes of the other pooling kinds answer 400 naming `task`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from tinymodel import make_tiny_decoder_pooler

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs

pytestmark = pytest.mark.anyio
TEXTS = ["What is the capital of France?", "Berlin", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("convert")
    return {
        "embed": make_tiny_decoder_pooler(root / "embed", "Qwen3ForCausalLM"),
        "classify": make_tiny_decoder_pooler(root / "classify", "LlamaForSequenceClassification", num_labels=3),
        "reward": make_tiny_decoder_pooler(root / "reward", "LlamaForCausalLM", seed=1),
    }


@pytest.fixture(scope="module")
def expected(checkpoints: dict[str, Path]) -> dict[str, list[torch.Tensor]]:
    """transformers by hand: the normalised last hidden state, the softmaxed score logits, and
    every token's hidden state softmaxed."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    out: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for kind, path in checkpoints.items():
            tok = AutoTokenizer.from_pretrained(str(path))
            inputs = [tok(t, return_tensors="pt") for t in TEXTS]
            if kind == "classify":
                hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
                out[kind] = [torch.softmax(hf(**x).logits[0], dim=-1) for x in inputs]
                continue
            lm = AutoModelForCausalLM.from_pretrained(str(path)).eval()
            hidden = [lm.model(**x).last_hidden_state[0] for x in inputs]
            if kind == "embed":
                out[kind] = [torch.nn.functional.normalize(h[-1], dim=-1) for h in hidden]
            else:
                out[kind] = [torch.softmax(h, dim=-1) for h in hidden]
    return out


@pytest.fixture(scope="module")
async def apps(checkpoints: dict[str, Path], anyio_backend: str) -> AsyncIterator[dict[str, Any]]:
    async with contextlib.AsyncExitStack() as stack:
        apps = {}
        for kind, path in checkpoints.items():
            overrides = {"architectures": ["LlamaForCausalLM"]} if kind == "classify" else None
            args = EngineArgs(
                model=str(path), runner="pooling", convert=kind, hf_overrides=overrides, multiprocess=False
            )
            llm = await stack.enter_async_context(AsyncLLM.from_engine_args(args))
            apps[kind] = build_app(ServerState(llm, ServerSettings(served_model_names=("m",))))
        yield apps


def client_of(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


def assert_400(response: httpx.Response, param: str, text: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and text in error["message"], error


async def test_convert_embed_serves_embeddings(apps: dict[str, Any], expected: dict[str, list[torch.Tensor]]) -> None:
    async with client_of(apps["embed"]) as client:
        body = (await client.post("/v1/embeddings", json={"model": "m", "input": TEXTS})).json()
        got = torch.tensor([row["embedding"] for row in body["data"]])
        torch.testing.assert_close(got, torch.stack(expected["embed"]), atol=1e-4, rtol=0)
        assert_400(await client.post("/classify", json={"input": "x"}), "task", "'classify' is not supported")


async def test_convert_classify_serves_classes(apps: dict[str, Any], expected: dict[str, list[torch.Tensor]]) -> None:
    async with client_of(apps["classify"]) as client:
        body = (await client.post("/classify", json={"model": "m", "input": TEXTS})).json()
        got = torch.tensor([row["probs"] for row in body["data"]])
        torch.testing.assert_close(got, torch.stack(expected["classify"]), atol=1e-4, rtol=0)
        assert [row["num_classes"] for row in body["data"]] == [3, 3, 3]
        assert_400(await client.post("/v1/embeddings", json={"input": "x"}), "task", "'embed' is not supported")


async def test_convert_reward_serves_token_rewards(
    apps: dict[str, Any], expected: dict[str, list[torch.Tensor]]
) -> None:
    async with client_of(apps["reward"]) as client:
        body = (await client.post("/pooling", json={"model": "m", "input": TEXTS})).json()
        for row, want in zip(body["data"], expected["reward"]):
            torch.testing.assert_close(torch.tensor(row["data"]), want, atol=1e-4, rtol=0)
        sagemaker = (await client.post("/invocations", json={"input": TEXTS[1]})).json()
        torch.testing.assert_close(torch.tensor(sagemaker["data"][0]["data"]), expected["reward"][1], atol=1e-4, rtol=0)
        assert_400(await client.post("/v1/embeddings", json={"input": "x"}), "task", "'embed' is not supported")
        assert_400(await client.post("/pooling", json={"input": "x", "task": "embed"}), "task", "token_classify")
