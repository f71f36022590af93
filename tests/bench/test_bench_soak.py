"""`triollm bench soak`'s clients of issue 39's surfaces, against the real app in process on the
tiny model (the soak itself starts `triollm serve`): every kind of request gets the status it
must, with nothing counted as a mismatch, a 5xx or a leak; the adapters the soak writes fit the
served model, and its corrupt one is refused naming the file."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.state import ServerSettings, ServerState
from triollm.bench.soak import (
    ADAPTER_WEIGHTS,
    DEEP,
    LORA_RANK,
    SoakOptions,
    Tally,
    _lora_model,
    _nested_bodies,
    _surface_report,
    _Surfaces,
    _write_adapters,
)
from triollm.engine.config import EngineArgs
from triollm.lora.peft import read_adapter_config
from triollm.lora.shapes import ModelShapes

KEYS = ("soak-key-a", "soak-key-b")
# Every kind of request the surfaces send, in one round of each client.
KINDS = {
    "template-benign", "template-file", "template-loops", "template-repeat", "store-own", "store-other-key",
    "lora-load", "lora-corrupt", "lora-request", "lora-unload", "lora-unloaded", "nested-args-chat",
    "nested-args-responses", "nested-args-tokenize",
}  # fmt: skip


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # what `triollm bench soak` runs on


def test_the_soak_adapters_fit_the_model_and_the_corrupt_one_does_not(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, why = _lora_model(SoakOptions(str(tiny_model_dir)))
    assert model is not None, why
    good, corrupt = _write_adapters(model, tmp_path)
    ModelShapes.of(model).check(read_adapter_config(good, max_lora_rank=LORA_RANK))
    with pytest.raises(ValueError, match=ADAPTER_WEIGHTS):
        ModelShapes.of(model).check(read_adapter_config(corrupt, max_lora_rank=LORA_RANK))
    _, why = _lora_model(SoakOptions(str(tiny_model_dir), server_args=("--max-lora-rank", "1")))
    assert "--max-lora-rank 1" in why


def test_the_nested_bodies_are_deep_and_the_report_counts_each_kind() -> None:
    for kind, path, body in _nested_bodies("m"):
        assert kind.startswith("nested-args-") and path.startswith("/")
        assert b"[" * DEEP in body and b"@RAW@" not in body
    report = _surface_report(Tally().surface("x"))
    assert report == {"sent": 0, "statuses": {}, "mismatch": 0, "5xx": 0, "leak": 0, "hung": 0}


@pytest.fixture
async def app_client(tiny_model_dir: Path) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    args = EngineArgs(
        model=str(tiny_model_dir), max_model_len=256, multiprocess=False, seed=0, enable_lora=True, max_loras=1,
        max_lora_rank=LORA_RANK,
    )  # fmt: skip
    settings = ServerSettings(
        served_model_names=("tiny",), api_key=KEYS, trust_request_chat_template=True, allow_runtime_lora_updating=True
    )
    async with AsyncLLM.from_engine_args(args) as llm:
        app = build_app(ServerState(llm, settings))
        headers = {"authorization": f"Bearer {KEYS[0]}"}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", headers=headers) as c:
            yield c, "http://testserver"


@pytest.mark.anyio
@pytest.mark.timeout(240)
async def test_every_surface_gets_the_status_it_must(
    app_client: tuple[httpx.AsyncClient, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    client, root = app_client
    model, _ = _lora_model(SoakOptions(str(tiny_model_dir)))
    adapters = _write_adapters(model, tmp_path / "adapters")
    secret = "SOAK-SECRET-test"
    (tmp_path / "secret.txt").write_text(secret)
    tally, stop = Tally(), anyio.Event()
    surfaces = _Surfaces(
        client, root, "tiny", tally, 60.0, stop, KEYS[1], "canary-not-in-env", tmp_path / "secret.txt", secret,
        adapters,
    )  # fmt: skip
    assert surfaces.leaked(f"x{secret}x") and not surfaces.leaked("/proc/self/environ")
    start = time.monotonic()
    async with anyio.create_task_group() as tg:
        surfaces.start(tg)
        # Until every kind was sent, and the nested bodies went round once.
        while not (KINDS <= tally.surfaces.keys() and tally.surface_total("sent") >= 40):
            assert time.monotonic() - start < 180, tally.surfaces
            await anyio.sleep(0.2)
        stop.set()
    assert tally.errors == {} and tally.hangs == 0, tally.errors
    for key in ("mismatch", "5xx", "leak"):
        assert tally.surface_total(key) == 0, (key, tally.surfaces)
    assert tally.surfaces["store-other-key"]["status 404"] >= 3
    assert tally.surfaces["lora-corrupt"]["status 400"] >= 1
    assert 0 < tally.template_refusal_max_s < 10
