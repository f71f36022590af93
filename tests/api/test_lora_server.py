"""LoRA adapters on the OpenAI server, as vLLM serves them: `--enable-lora --lora-modules`,
`model: "<adapter>"` on completions and chat, the adapters in `/v1/models` (`root`, `parent`),
`/v1/load_lora_adapter` / `/v1/unload_lora_adapter` behind `VLLM_ALLOW_RUNTIME_LORA_UPDATING`.

The app runs in process (httpx's ASGI transport) on one tiny engine per backend, read through the
official `openai` client where a client would. Plumbing tests check what reaches the engine core
(an input tap); the others compare the tokens with `peft`'s greedy reference.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from lora_adapters import make_peft_adapter, peft_greedy

from triollm.actors.async_llm import AsyncLLM
from triollm.actors.messages import AddRequest, CoreInput
from triollm.api import cli
from triollm.api.app import build_app
from triollm.api.serve_args import serve_options
from triollm.api.serving_models import LoRAModulePath
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs
from triollm.lora.request import LoRARequest
from triollm.testing import InputRecorder

openai = pytest.importorskip("openai")

BASE = "tiny"
N = 6
PROMPT = "The capital of France is"

@pytest.fixture(scope="module", params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora-server")
    out = {
        "a": make_peft_adapter(tiny_model_dir, root / "a", seed=11, r=8),
        "b": make_peft_adapter(
            tiny_model_dir, root / "b", seed=12, r=4, target_modules=("q_proj", "v_proj", "up_proj")
        ),
        "c": make_peft_adapter(tiny_model_dir, root / "c", seed=13, r=8, target_modules=("o_proj", "down_proj")),
        "big": make_peft_adapter(tiny_model_dir, root / "big", seed=14, r=16),
    }
    dora = root / "dora"
    shutil.copytree(out["a"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    out["dora"] = dora
    return out


class Tap(InputRecorder):
    """Records the messages to the core, and calls `on_add` with each `AddRequest`."""

    def __init__(self) -> None:
        super().__init__()
        self.on_add: Callable[[AddRequest], object] | None = None

    def __call__(self, msg: CoreInput) -> CoreInput:
        msg = super().__call__(msg)
        if self.on_add is not None and isinstance(msg, AddRequest):
            self.on_add(msg)
        return msg


@dataclass
class Served:
    llm: AsyncLLM
    state: ServerState
    app: Any
    recorder: Tap

    def added(self, request_id: str) -> list[LoRARequest | None]:
        """The adapters of the core requests added so far for the HTTP request `request_id`
        (core ids `[i_]cmpl-ID-k#tag`, `[i_]chatcmpl-ID#tag`)."""
        return [
            m.request.lora_request
            for m in self.recorder.sent
            if isinstance(m, AddRequest) and any(f"-{request_id}{end}" in m.request.request_id for end in ("-", "#"))
        ]


@pytest.fixture(scope="module")
async def served(tiny_model_dir: Path, adapters: dict[str, Path], anyio_backend: str) -> AsyncIterator[Served]:
    recorder = Tap()
    args = EngineArgs(
        model=str(tiny_model_dir),
        max_model_len=256,
        multiprocess=False,
        seed=0,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    modules = (LoRAModulePath("a", str(adapters["a"])), LoRAModulePath("b", str(adapters["b"]), base_model_name=BASE))
    settings = ServerSettings(served_model_names=(BASE,), lora_modules=modules, allow_runtime_lora_updating=True)
    async with AsyncLLM.from_engine_args(args, input_tap=recorder) as llm:
        state = ServerState(llm, settings)
        yield Served(llm, state, build_app(state), recorder)


@pytest.fixture
async def http(served: Served) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served.app), base_url="http://testserver") as c:
        yield c


@pytest.fixture
def client(http: httpx.AsyncClient) -> Any:
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


async def complete(
    client: Any, model: str, request_id: str, *, extra_body: dict[str, Any] | None = None, **kw: Any
) -> Any:
    kw.setdefault("max_tokens", N)
    extra = {"min_tokens": kw["max_tokens"], "request_id": request_id, **(extra_body or {})}
    return await client.completions.create(model=model, prompt=PROMPT, temperature=0.0, extra_body=extra, **kw)


def token_ids(tokens: list[str]) -> list[int]:
    """`return_tokens_as_token_ids`' "token_id:N" strings as ids."""
    return [int(t.removeprefix("token_id:")) for t in tokens]


def assert_error(response: httpx.Response, status: int, param: str, *texts: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == status, error
    assert all(t in error["message"] for t in texts), error


# ------------------------------------------------------------------------------ served adapters


@pytest.mark.anyio
async def test_models_lists_each_adapter_with_its_path_and_parent(
    client: Any, http: httpx.AsyncClient, adapters: dict[str, Path]
) -> None:
    models = (await client.models.list()).data
    assert [m.id for m in models] == [BASE, "a", "b"]
    cards = {card["id"]: card for card in (await http.get("/v1/models")).json()["data"]}
    assert cards["a"]["root"] == str(adapters["a"]) and cards["a"]["parent"] == BASE
    assert cards["b"]["root"] == str(adapters["b"]) and cards["b"]["parent"] == BASE
    assert cards[BASE]["parent"] is None


@pytest.mark.anyio
async def test_model_names_the_adapter_the_engine_runs(client: Any, served: Served, adapters: dict[str, Path]) -> None:
    a, b = served.state.models.lora_request("a"), served.state.models.lora_request("b")
    assert a == LoRARequest("a", 1, str(adapters["a"])) and b is not None and b.lora_int_id == 2
    out = await complete(client, "a", "route-a", n=2)
    assert out.model == "a" and len(out.choices) == 2
    assert served.added("route-a") == [a, a]  # both children
    await complete(client, BASE, "route-base")
    assert served.added("route-base") == [None]
    chat = await client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"request_id": "route-b"}
    )
    assert chat.model == "b" and served.added("route-b") == [b]
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        await complete(client, "nope", "route-nope")


@pytest.mark.anyio
async def test_adapters_give_peft_greedy_tokens_and_the_base_stays_the_base(
    client: Any, served: Served, adapters: dict[str, Path], tiny_model_dir: Path
) -> None:
    tokenizer = served.llm.get_tokenizer()
    ids = tokenizer.encode(PROMPT)
    got = {}
    for model, adapter in (("a", adapters["a"]), ("b", adapters["b"]), (BASE, None)):
        out = await complete(
            client, model, f"peft-{model}", logprobs=0, extra_body={"return_tokens_as_token_ids": True}
        )
        got[model] = token_ids(out.choices[0].logprobs.tokens)
        assert got[model] == peft_greedy(tiny_model_dir, adapter, ids, N), model
    assert len({tuple(t) for t in got.values()}) == 3  # each adapter moves the tokens its own way
    messages = [{"role": "user", "content": "Tell me a story"}]
    _, chat_ids = tokenizer.render_chat(messages, add_generation_prompt=True)
    chat = await client.chat.completions.create(
        model="b", messages=messages, temperature=0.0, max_tokens=N, logprobs=True,
        extra_body={"min_tokens": N, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    assert token_ids([t.token for t in chat.choices[0].logprobs.content]) == peft_greedy(
        tiny_model_dir, adapters["b"], chat_ids, N
    )


# ------------------------------------------------------------------------------ runtime loading


@pytest.mark.anyio
async def test_load_and_unload_at_runtime_while_requests_run(
    client: Any, http: httpx.AsyncClient, served: Served, adapters: dict[str, Path]
) -> None:
    load = "/v1/load_lora_adapter"
    r = await http.post(load, json={"lora_name": "c", "lora_path": str(adapters["c"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' added successfully.", r.text
    c = served.state.models.lora_request("c")
    assert c is not None and c.lora_int_id not in (1, 2)
    cards = {card.id: card for card in (await client.models.list()).data}
    assert cards["c"].parent == BASE  # type: ignore[attr-defined]
    assert_error(
        await http.post(load, json={"lora_name": "c", "lora_path": str(adapters["a"])}),
        400,
        "lora_name",
        "has already been loaded",
    )
    assert_error(
        await http.post(load, json={"lora_name": "x", "lora_path": "/nonexistent/adapter"}),
        400,
        "lora_path",
        "/nonexistent/adapter",
    )
    assert_error(
        await http.post(load, json={"lora_name": "x", "lora_path": str(adapters["dora"])}),
        400,
        "lora_path",
        str(adapters["dora"]),
        "use_dora",
    )
    assert_error(
        await http.post(load, json={"lora_name": "x", "lora_path": str(adapters["big"])}),
        400,
        "lora_path",
        "r=16",
        "max_lora_rank=8",
    )
    assert_error(await http.post(load, json={"lora_name": "x"}), 400, "lora_path", "'lora_path' must be provided")
    assert_error(
        await http.post(load, json={"lora_name": BASE, "lora_path": str(adapters["c"])}), 400, "lora_name", "base model"
    )
    assert [m.id for m in (await client.models.list()).data] == [BASE, "a", "b", "c"]  # nothing half-loaded

    results: dict[str, Any] = {}

    async def run(model: str, rid: str) -> None:
        results[rid] = await complete(client, model, rid, max_tokens=40)

    admitted = anyio.Event()
    served.recorder.on_add = lambda m: "-under-c-" in m.request.request_id and admitted.set()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "c", "under-c")
            tg.start_soon(run, BASE, "beside-c")
            await admitted.wait()  # the request under c is in the engine: now unload c
            served.recorder.on_add = None
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' removed successfully.", r.text
    assert served.added("under-c") == [c]
    for rid in ("under-c", "beside-c"):  # the admitted request finished under c; the other was undisturbed
        choice = results[rid].choices[0]
        assert choice.finish_reason == "length" and results[rid].usage.completion_tokens == 40, rid
    with pytest.raises(openai.NotFoundError):
        await complete(client, "c", "after-unload")
    assert_error(
        await http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}), 404, "lora_name", "cannot be found"
    )
    r = await http.post(load, json={"lora_name": "c", "lora_path": str(adapters["c"])})
    assert r.status_code == 200, r.text
    again = served.state.models.lora_request("c")
    assert again is not None and again.lora_int_id != c.lora_int_id  # ids are never reused
    await http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})


@pytest.mark.anyio
async def test_runtime_routes_exist_only_with_the_setting(served: Served, adapters: dict[str, Path]) -> None:
    app = build_app(ServerState(served.llm, ServerSettings(served_model_names=(BASE,))))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
        r = await http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])})
        assert r.status_code == 404
        assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})).status_code == 404


# ------------------------------------------------------------------------------ flags


def parse(*words: str) -> Any:
    parser = cli.build_parser()
    return parser.parse_args(cli.expand_argv(parser, ["serve", *words]))


def test_serve_flags_and_the_runtime_env(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--help")
    text = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--enable-lora",
        "--lora-modules",
        "--max-loras",
        "--max-lora-rank",
        "--max-cpu-loras",
        "--lora-dtype",
    ):
        assert flag in text, flag
    ns = parse(
        "m",
        "--enable-lora",
        "--lora-modules",
        "a=/x=y",
        '{"name": "b", "path": "/y", "base_model_name": "tiny"}',
        "--lora-modules",
        "c=/z",
    )
    for value, want in (("true", True), ("1", True), ("0", False), ("", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        settings = serve_options(ns, (BASE,), 20).settings
        assert settings is not None and settings.allow_runtime_lora_updating is want, value
    assert settings.lora_modules == (
        LoRAModulePath("a", "/x=y"),
        LoRAModulePath("b", "/y", "tiny"),
        LoRAModulePath("c", "/z"),
    )
    for bad, message in (
        ("{bad", "invalid JSON"),
        ('{"name": "b"}', "needs the keys name and path"),
        ("noequals", "is not name=path"),
    ):
        with pytest.raises(SystemExit):
            parse("m", "--enable-lora", "--lora-modules", bad)
        assert message in capsys.readouterr().err, bad


def test_bad_lora_modules_stop_the_server_before_it_starts(
    tiny_model_dir: Path, adapters: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(tiny_model_dir)
    cases = [
        (["--lora-modules", f"a={adapters['a']}"], "--lora-modules: LoRA is not enabled; add --enable-lora"),
        (
            ["--enable-lora", "--lora-modules", "a=/nonexistent"],
            "--lora-modules a: '/nonexistent' is not a LoRA adapter directory",
        ),
        (
            ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"a={adapters['big']}"],
            "r=16 is above max_lora_rank=8",
        ),
        (
            ["--enable-lora", "--lora-modules", f"a={adapters['a']}", f"a={adapters['b']}"],
            "--lora-modules a: the name is given twice",
        ),
        (
            ["--enable-lora", "--served-model-name", "a", "--lora-modules", f"a={adapters['a']}"],
            "--lora-modules a: the name is the base model's",
        ),
    ]
    for words, message in cases:
        assert cli.main(["serve", model, "--port", "0", *words]) == 2, words
        assert message in capsys.readouterr().err, words
