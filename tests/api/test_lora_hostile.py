"""LoRA adapters as a careless or hostile client brings them (issue 39), through the real server.

- A corrupt safetensors file, a truncated one, a wrong-shaped adapter, a tensor of NaNs and a
  directory without `adapter_config.json` are refused at `/v1/load_lora_adapter` with a 400
  naming the file, and nothing is loaded; the same adapters are `ValueError`s at the first
  `AsyncLLM.generate` / `LLM.generate` that uses them, and stop `triollm serve --lora-modules`
  before it reports ready.
- The load route gives one answer for every path that is not an adapter (missing, a file, a
  directory without a config): it does not tell which server paths exist.
- An adapter that breaks after it was loaded (its files deleted) fails the request that uses it
  with an error naming the adapter, streamed or not, and under beam search, instead of HTTP 200
  with empty text.
- The frontend's table of checked adapters is bounded (LRU), and the load route's log line
  escapes a name with a newline.

Adapters are written by hand (safetensors, PEFT's names), so no test here needs peft.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch
from anyio.abc import TaskStatus
from safetensors.torch import save_file

from triollm import LLM
from triollm.actors.async_llm import AsyncLLM
from triollm.actors.errors import unwrap_single_error
from triollm.api.app import build_app
from triollm.api.server import ServeOptions, bind_socket, serve
from triollm.api.serving_models import LoRAModulePath
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs, LoRAConfig
from triollm.engine.frontend.lora import LoRAChecker
from triollm.engine.sampling_params import SamplingParams
from triollm.lora.request import LoRARequest

BASE = "tiny"
LOAD = "/v1/load_lora_adapter"
WEIGHTS = "adapter_model.safetensors"
KEY = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight"


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def lora_args(model: Path, **kw: Any) -> EngineArgs:
    return EngineArgs(
        model=str(model), max_model_len=128, multiprocess=False, seed=0, enable_lora=True, max_loras=2,
        max_lora_rank=8, **kw,
    )  # fmt: skip


def write_adapter(
    path: Path, hidden: int, q_out: int, v_out: int, *, layers: int = 2, r: int = 4, fill: float | None = None
) -> Path:
    """A PEFT adapter on q_proj and v_proj of a model with these sizes (random, or `fill`)."""
    path.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        for module, out in (("q_proj", q_out), ("v_proj", v_out)):
            for ab, shape in (("A", (r, hidden)), ("B", (out, r))):
                t = torch.randn(shape, generator=g) * 0.05
                tensors[KEY.format(layer, module, ab)] = t.fill_(fill) if fill is not None else t
    save_file(tensors, str(path / WEIGHTS))
    return path


@dataclass
class Adapters:
    good: Path
    root: Path
    bad: dict[str, tuple[Path, str]]  # case -> (adapter, what the refusal must say)

    def fresh_good(self, name: str) -> Path:
        """A copy of the good adapter that a test may break."""
        return Path(shutil.copytree(self.good, self.root / name))


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    layers = cfg["num_hidden_layers"]
    root = tmp_path_factory.mktemp("lora-hostile")
    good = write_adapter(root / "good", hidden, heads * head_dim, kv * head_dim, layers=layers)
    # Written for a model with half the hidden size: every lora_A is too narrow.
    narrow = write_adapter(root / "narrow", hidden // 2, heads * head_dim, kv * head_dim, layers=layers)
    nan = write_adapter(root / "nan", hidden, heads * head_dim, kv * head_dim, layers=layers, fill=float("nan"))
    corrupt = Path(shutil.copytree(good, root / "corrupt"))
    (corrupt / WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    truncated = Path(shutil.copytree(good, root / "truncated"))
    data = (truncated / WEIGHTS).read_bytes()
    (truncated / WEIGHTS).write_bytes(data[: len(data) - 64])
    no_config = Path(shutil.copytree(good, root / "no-config"))
    (no_config / "adapter_config.json").unlink()
    bad = {
        "corrupt": (corrupt, f"{WEIGHTS} could not be read"),
        "truncated": (truncated, f"{WEIGHTS} could not be read"),
        "wrong_shape": (
            narrow,
            f"{WEIGHTS}: tensor layers.0.q_proj.lora_A has shape (4, {hidden // 2}); the model's q_proj takes "
            f"{hidden} inputs",
        ),
        "nan": (nan, f"{WEIGHTS}: tensor {KEY.format(0, 'q_proj', 'A')!r} holds NaN or infinite values"),
        "no_config": (no_config, "is not a LoRA adapter directory"),
    }
    return Adapters(good, root, bad)


@dataclass
class Served:
    llm: AsyncLLM
    state: ServerState
    app: Any


@pytest.fixture(scope="module")
async def served(tiny_model_dir: Path, adapters: Adapters, anyio_backend: str) -> AsyncIterator[Served]:
    settings = ServerSettings(
        served_model_names=(BASE,),
        lora_modules=(LoRAModulePath("good", str(adapters.good)),),
        allow_runtime_lora_updating=True,
    )
    async with AsyncLLM.from_engine_args(lora_args(tiny_model_dir)) as llm:
        state = ServerState(llm, settings)
        yield Served(llm, state, build_app(state))


@pytest.fixture
async def http(served: Served) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served.app), base_url="http://testserver") as c:
        yield c


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == status, error
    return error


async def served_names(http: httpx.AsyncClient) -> list[str]:
    return [m["id"] for m in (await http.get("/v1/models")).json()["data"]]


def completion_body(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0, **kw}


# ------------------------------------------------------------------------------ refused at load


@pytest.mark.anyio
@pytest.mark.parametrize("case", ["corrupt", "truncated", "wrong_shape", "nan", "no_config"])
async def test_a_broken_adapter_is_refused_at_load_naming_the_file(
    http: httpx.AsyncClient, served: Served, adapters: Adapters, case: str
) -> None:
    path, says = adapters.bad[case]
    before = await served_names(http)
    error = error_of(await http.post(LOAD, json={"lora_name": f"bad-{case}", "lora_path": str(path)}), 400)
    assert error["param"] == "lora_path", error
    assert error["message"].startswith(f"lora_path: {str(path)!r}"), error
    assert says in error["message"], error
    assert await served_names(http) == before and served.state.models.lora_request(f"bad-{case}") is None
    # The server goes on: the good adapter still answers.
    r = await http.post("/v1/completions", json=completion_body("good"))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


@pytest.mark.anyio
async def test_async_generate_refuses_a_broken_adapter_at_first_use(served: Served, adapters: Adapters) -> None:
    for lid, case in enumerate(("corrupt", "wrong_shape", "no_config"), start=100):
        path, says = adapters.bad[case]
        lora = LoRARequest(f"direct-{case}", lid, str(path))
        with pytest.raises(ValueError, match="^lora_path: ") as err:
            async for _ in served.llm.generate("Hi", SamplingParams(max_tokens=2), f"direct-{case}", lora_request=lora):
                pass
        assert says in str(err.value), case
    assert served.llm.num_unfinished_requests == 0


def test_llm_generate_refuses_a_wrong_shaped_adapter(tiny_model_dir: Path, adapters: Adapters) -> None:
    path, says = adapters.bad["wrong_shape"]
    with LLM.from_engine_args(lora_args(tiny_model_dir)) as llm:
        with pytest.raises(ValueError, match="^lora_path: ") as err:
            llm.generate(["Hi"], SamplingParams(max_tokens=2), lora_request=LoRARequest("narrow", 1, str(path)))
        assert says in str(err.value)
        good = LoRARequest("good", 2, str(adapters.good))
        [out] = llm.generate(["Hi"], SamplingParams(max_tokens=2), lora_request=good)
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.anyio
async def test_serve_stops_before_ready_on_a_wrong_shaped_lora_module(tiny_model_dir: Path, adapters: Adapters) -> None:
    path, says = adapters.bad["wrong_shape"]
    settings = ServerSettings(served_model_names=(BASE,), lora_modules=(LoRAModulePath("narrow", str(path)),))
    options = ServeOptions(settings=settings, playground=False)
    with bind_socket("127.0.0.1", 0) as sock:

        async def run(*, task_status: TaskStatus[str]) -> None:
            await serve(lora_args(tiny_model_dir), options, sock, task_status=task_status)

        with anyio.fail_after(120), pytest.raises(ValueError, match=r"^--lora-modules narrow: lora_path: ") as err:
            with unwrap_single_error():
                async with anyio.create_task_group() as tg:
                    await tg.start(run)
                    tg.cancel_scope.cancel()  # it reported ready: the adapter was not checked
        assert says in str(err.value)


# ------------------------------------------------------------------------------ what paths exist


@pytest.mark.anyio
async def test_the_load_route_does_not_tell_which_paths_exist(
    http: httpx.AsyncClient, tmp_path: Path, adapters: Adapters
) -> None:
    a_file = tmp_path / "secret.txt"
    a_file.write_text("not an adapter")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    paths = [tmp_path / "missing", a_file, empty_dir, adapters.bad["no_config"][0], tmp_path / "missing" / "deeper"]
    answers = set()
    for path in paths:
        r = await http.post(LOAD, json={"lora_name": "probe", "lora_path": str(path)})
        error = error_of(r, 400)
        assert error["param"] == "lora_path"
        answers.add((r.status_code, error["type"], error["message"].replace(repr(str(path)), "<path>")))
    assert len(answers) == 1, answers


# ------------------------------------------------------------------------------ broken after load


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["plain", "stream", "beam"])
async def test_an_adapter_deleted_after_load_is_an_error_not_an_empty_answer(
    http: httpx.AsyncClient, served: Served, adapters: Adapters, mode: str
) -> None:
    stream = mode == "stream"
    name = f"gone-{mode}-{served.llm.num_unfinished_requests}"
    path = adapters.fresh_good(f"{name}-{id(served)}")
    r = await http.post(LOAD, json={"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 200, r.text
    shutil.rmtree(path)  # the engine core reads it at first use: it is gone by then
    extra: dict[str, Any] = {"use_beam_search": True, "n": 2} if mode == "beam" else {"stream": stream}
    r = await http.post("/v1/completions", json=completion_body(name, **extra))
    if r.status_code == 200:  # a stream that started: an error event, and no answer that looks finished
        assert stream and r.headers["content-type"].startswith("text/event-stream"), r.text
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert "error" in events[-1] and repr(str(path)) in events[-1]["error"]["message"], events
        assert not any(c.get("finish_reason") == "abort" for e in events for c in e.get("choices", []))
    else:
        error = error_of(r, 500)
        assert repr(str(path)) in error["message"], error
    await http.post("/v1/unload_lora_adapter", json={"lora_name": name})
    r = await http.post("/v1/completions", json=completion_body("good"))
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------ the table, the log


def test_the_checked_table_is_bounded_and_keeps_the_recent_ids(adapters: Adapters) -> None:
    checker = LoRAChecker(LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2, dtype="float32"))
    bound = checker.max_checked
    total = bound + 50
    for lid in range(1, total + 1):
        checker.check(LoRARequest(f"a{lid}", lid, str(adapters.good)))
    assert len(checker) == bound
    assert checker.needs_io(LoRARequest("a1", 1, str(adapters.good)))  # pushed out: checked again
    assert not checker.needs_io(LoRARequest(f"a{total}", total, str(adapters.good)))
    with pytest.raises(ValueError, match=f"^lora_int_id: {total} is already the id"):
        checker.check(LoRARequest("other", total, str(adapters.bad["no_config"][0])))


@pytest.mark.anyio
async def test_the_load_log_line_escapes_a_name_with_a_newline(
    http: httpx.AsyncClient, adapters: Adapters, caplog: pytest.LogCaptureFixture
) -> None:
    name = "ok\nINFO triollm: forged line"
    caplog.set_level(logging.INFO, logger="triollm")
    r = await http.post(LOAD, json={"lora_name": name, "lora_path": str(adapters.good)})
    assert r.status_code == 200, r.text
    await http.post("/v1/unload_lora_adapter", json={"lora_name": name})
    lines = [rec.getMessage() for rec in caplog.records if "forged line" in rec.getMessage()]
    assert len(lines) == 2 and all("\n" not in line and "ok\\nINFO" in line for line in lines), lines
