"""The engine core in a real child process over ZMQ, driven from trio and from asyncio.

A child takes ~2 s to start (torch import and model set-up dominate), so tests that leave the
engine usable share one child per backend (`client`); the others start their own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import PIPE

import anyio
import psutil
import pytest

from triollm.actors import process, zmq_io
from triollm.actors.core_client import SHUTDOWN_GRACE_S, CoreClient
from triollm.actors.data_parallel import rank_config
from triollm.actors.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    OutputBatch,
    Ready,
    RequestError,
    UtilityCall,
    UtilityOp,
    UtilityResult,
)
from triollm.actors.process import EngineStartupError, open_process_core
from triollm.engine.config import EngineArgs
from triollm.engine.config_codec import decode_config
from triollm.engine.core_factory import EngineCoreFactory
from triollm.engine.core_protocol import EngineCoreStats
from triollm.engine.execution.scripted_runner import fault_at_step
from triollm.engine.request import EngineCoreRequest, FinishReason
from triollm.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

MAX_LEN = 64


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


def _args(model: Path, **kw: object) -> EngineArgs:
    kw.setdefault("max_model_len", MAX_LEN)
    return EngineArgs(model=str(model), multiprocess=True, **kw)  # type: ignore[arg-type]


def _open(args: EngineArgs, core_factory: EngineCoreFactory | None = None):
    return open_process_core(args.create_engine_config(), core_factory=core_factory)


def _request(rid: str, max_tokens: int = 8, prompt_len: int = 4) -> AddRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return AddRequest(
        EngineCoreRequest(rid, [(7 * i) % 300 + 1 for i in range(prompt_len)], params)
    )


@dataclass
class Results:
    tokens: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[str, FinishReason] = field(default_factory=dict)
    errors: dict[str, RequestError] = field(default_factory=dict)


async def _collect(client: CoreClient, rids: set[str], limit_s: float = 30) -> Results:
    """Receive until every request in `rids` finished or failed."""
    res = Results()
    pending = set(rids)
    with anyio.fail_after(limit_s):
        while pending:
            msg = await client.outputs.receive()
            match msg:
                case OutputBatch():
                    for out in msg.to_outputs():
                        res.tokens[out.request_id].extend(out.new_token_ids)
                        if out.finish_reason is not None:
                            res.finished[out.request_id] = out.finish_reason
                            pending.discard(out.request_id)
                case RequestError(request_id=rid):
                    res.errors[rid] = msg
                    pending.discard(rid)
                case EngineDead():
                    pytest.fail(f"engine died: {msg.message}\n{msg.traceback}")
    return res


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ---------------------------------------------------------------- one child, shared


@pytest.fixture(scope="module")
async def client(anyio_backend: str, tiny_model_dir: Path) -> AsyncIterator[CoreClient]:
    t0 = time.perf_counter()
    async with _open(_args(tiny_model_dir)) as c:
        logging.getLogger("triollm").info(
            "engine core child ready in %.2f s", time.perf_counter() - t0
        )
        yield c
    c.outputs.close()


async def test_ready_and_generation(client: CoreClient, tiny_model_dir: Path) -> None:
    ready = client.ready
    assert isinstance(ready, Ready)
    assert ready.num_kv_blocks > 0 and ready.block_size == 16 and ready.max_model_len == MAX_LEN
    assert ready.vocab_size == _args(tiny_model_dir).create_engine_config().model.vocab_size
    assert client.pid is not None and client.pid in _children()

    wanted = {"gen-a": 1, "gen-b": 5, "gen-c": 17}
    for rid, n in wanted.items():
        client.inputs.send_nowait(_request(rid, max_tokens=n))
    res = await _collect(client, set(wanted))
    assert {rid: len(toks) for rid, toks in res.tokens.items()} == wanted
    assert set(res.finished.values()) == {FinishReason.LENGTH}
    assert not res.errors


async def test_bad_request_fails_alone(client: CoreClient) -> None:
    client.inputs.send_nowait(_request("too-long", prompt_len=MAX_LEN))
    client.inputs.send_nowait(_request("fine", max_tokens=3))
    res = await _collect(client, {"too-long", "fine"})
    err = res.errors["too-long"]
    assert err.kind == "ValueError" and "max_model_len" in err.message
    assert len(res.tokens["fine"]) == 3 and "too-long" not in res.tokens


async def test_abort_and_utility_calls(client: CoreClient) -> None:
    client.inputs.send_nowait(_request("aborted", max_tokens=MAX_LEN - 8))
    with anyio.fail_after(30):
        first = await client.outputs.receive()
    assert isinstance(first, OutputBatch) and first.request_ids == ["aborted"]
    client.inputs.send_nowait(AbortRequests(["aborted"]))
    client.inputs.send_nowait(_request("after-abort", max_tokens=2))
    res = await _collect(client, {"after-abort"})
    assert len(res.tokens["after-abort"]) == 2
    assert "aborted" not in res.finished  # an abort produces no output

    client.inputs.send_nowait(UtilityCall(7, UtilityOp.STATISTICS))
    client.inputs.send_nowait(UtilityCall(8, UtilityOp.CHECK_INTEGRITY))
    with anyio.fail_after(10):
        replies = [await client.outputs.receive() for _ in range(2)]
    assert all(isinstance(r, UtilityResult) for r in replies)
    stats, integrity = replies
    assert isinstance(stats, UtilityResult) and isinstance(stats.result, EngineCoreStats)
    assert stats.call_id == 7 and stats.result.num_running == 0 and stats.result.num_waiting == 0
    assert (
        isinstance(integrity, UtilityResult) and integrity.call_id == 8 and integrity.result is True
    )


# ---------------------------------------------------------------- deaths


async def test_sigkill_mid_generation_yields_engine_dead(tiny_model_dir: Path) -> None:
    async with _open(_args(tiny_model_dir, max_model_len=512)) as c:
        c.inputs.send_nowait(_request("long", max_tokens=500))
        with anyio.fail_after(30):
            assert isinstance(await c.outputs.receive(), OutputBatch)  # it is generating
        assert c.pid is not None
        os.kill(c.pid, signal.SIGKILL)
        with anyio.fail_after(5):
            rest = [msg async for msg in c.outputs]  # ends after EngineDead
        dead = rest[-1]
        assert isinstance(dead, EngineDead) and "SIGKILL" in dead.message
        assert all(isinstance(m, OutputBatch) for m in rest[:-1])
    c.outputs.close()


async def test_exception_in_a_step_sends_the_traceback(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG, logger="triollm")
    async with _open(_args(tiny_model_dir), fault_at_step(2)) as c:
        c.inputs.send_nowait(_request("doomed", max_tokens=10))
        with anyio.fail_after(30):
            msgs = [msg async for msg in c.outputs]
        pid = c.pid
    c.outputs.close()
    assert [type(m) for m in msgs] == [OutputBatch, EngineDead]  # step 1, then the fault
    dead = msgs[-1]
    assert isinstance(dead, EngineDead)
    assert "injected fault" in dead.message
    assert "Traceback" in dead.traceback and "injected fault in the forward pass" in dead.traceback
    assert any(
        f"engine core process {pid} exited with code 1" in r.getMessage() for r in caplog.records
    )
    assert pid is not None and _gone(pid)
    # The child logged what it exits on, with the traceback, on the stderr we forward.
    err = capfd.readouterr().err
    assert f"(engine core pid {pid}) ERROR triollm: the engine core failed" in err
    assert "Traceback" in err and "injected fault in the forward pass" in err


HANG = """
import time

def build(config, **kwargs):
    time.sleep(3600)  # a load that never ends
"""


async def test_a_child_that_never_answers_the_handshake_is_killed(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "hang_factory.py").write_text(HANG)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setattr(process, "HANDSHAKE_TIMEOUT_S", 4.0)
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(EngineStartupError, match=r"HANDSHAKE_TIMEOUT_S=4 s") as info:
        with anyio.fail_after(30):
            async with _open(_args(tiny_model_dir), EngineCoreFactory("hang_factory:build")):
                pytest.fail("the engine started")
    assert "neither Ready nor StartupError" in info.value.message
    assert time.monotonic() - t0 < 4.0 + process.TERM_GRACE_S + 5
    assert _children() == before  # killed and reaped


# ---------------------------------------------------------------- start-up failures


async def _expect_startup_error(args: EngineArgs) -> EngineStartupError:
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(EngineStartupError) as info:
        with anyio.fail_after(30):
            async with open_process_core(args.create_engine_config()):
                pytest.fail("the engine started")
    assert time.monotonic() - t0 < 15
    assert _children() == before  # no child left behind
    return info.value


async def test_startup_failure_corrupt_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"\xde\xad\xbe\xef garbage" * 64)
    err = await _expect_startup_error(_args(bad))
    assert "failed to start" in err.message and "SafetensorError" in err.message
    assert "Traceback" in err.child_traceback and "SafetensorError" in str(err)


async def test_startup_failure_bad_model_dir(tiny_model_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "vanishing"
    shutil.copytree(tiny_model_dir, bad)
    args = _args(bad)
    config = args.create_engine_config()
    (bad / "config.json").unlink()  # gone between the parent's check and the child's load
    before = _children()
    with pytest.raises(EngineStartupError, match="has no config.json"):
        with anyio.fail_after(30):
            async with open_process_core(config):
                pytest.fail("the engine started")
    assert _children() == before


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("echo 'fatal: no engine here' >&2; exit 3", "exited with code 3 before it was ready"),
        (
            "echo 'fatal: no engine here' >&2; kill -KILL $$",
            "was killed by signal SIGKILL before it was ready",
        ),
    ],
)
async def test_child_dies_before_the_handshake(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    script: str,
    expected: str,
) -> None:
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    err = await _expect_startup_error(_args(tiny_model_dir))
    assert expected in err.message
    assert "fatal: no engine here" in err.child_traceback  # the tail of its stderr


# ---------------------------------------------------------------- clean exit


class _Boom(Exception):
    pass


async def test_clean_exit_leaves_nothing_behind(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG, logger="triollm")
    # No grace for last words: a watcher left running at teardown could report the exit at once.
    monkeypatch.setattr(process, "LAST_WORDS_S", 0)
    me = psutil.Process()

    # Warm-up (lasting event-loop threads start here), and an error in the body passes through
    # unwrapped while a request is in flight.
    with pytest.raises(_Boom) as info:
        async with _open(_args(tiny_model_dir, zmq_address="tcp://127.0.0.1")) as c:
            c.inputs.send_nowait(_request("busy", max_tokens=MAX_LEN - 8))
            with anyio.fail_after(30):
                await c.outputs.receive()
            raise _Boom from KeyError("the cause")
    c.outputs.close()
    assert isinstance(info.value.__cause__, KeyError)
    assert c.pid is not None and _gone(c.pid)
    fds, threads = me.num_fds(), me.num_threads()

    async with _open(_args(tiny_model_dir)) as c:  # ipc
        c.inputs.send_nowait(_request("one", max_tokens=3))
        res = await _collect(c, {"one"})
        assert len(res.tokens["one"]) == 3
        c.inputs.send_nowait(_request("in-flight", max_tokens=40))
        c.inputs.close()  # the user closes theirs: Shutdown must still go through
        t0 = time.monotonic()
    elapsed = time.monotonic() - t0
    with anyio.fail_after(1):
        rest = [msg async for msg in c.outputs]  # the stream ended
    c.outputs.close()

    assert not any(isinstance(m, EngineDead) for m in rest)
    assert elapsed < SHUTDOWN_GRACE_S  # Shutdown worked: no SIGTERM needed
    assert c.pid is not None and _gone(c.pid) and c.pid not in _children()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    # No more threads or fds than before (fewer is fine: idle worker threads of the warm-up
    # expire). Polled: asyncio's child-watcher thread ends just after the child.
    with anyio.move_on_after(5):
        while me.num_threads() > threads or me.num_fds() > fds:  # noqa: ASYNC110 (polling)
            await anyio.sleep(0.05)
    assert me.num_threads() <= threads and me.num_fds() <= fds


# ---------------------------------------------------------------- tcp: CURVE or opt-in


@pytest.mark.parametrize("insecure", [False, True], ids=["curve", "insecure-opt-in"])
async def test_tcp_child_is_curve_or_explicitly_insecure(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, insecure: bool
) -> None:
    if not insecure and not zmq_io.curve_available():
        pytest.skip("this libzmq has no CURVE")
    # The opt-in is the setting alone: the environment variable it replaced changes nothing.
    monkeypatch.setenv("TRIOLLM_ZMQ_INSECURE_TCP", "1")
    args = _args(tiny_model_dir, zmq_address="tcp://127.0.0.1", zmq_insecure_tcp=insecure)
    async with _open(args) as c:
        assert c.pid is not None
        child = psutil.Process(c.pid)
        keys = child.environ().get(process.CURVE_KEYS_ENV)
        assert (keys is None) == insecure
        if keys is not None:  # handed over in the environment, never on the command line
            assert not any(part in arg for part in keys.split(",") for arg in child.cmdline())
        c.inputs.send_nowait(_request("tcp", max_tokens=3))
        res = await _collect(c, {"tcp"})
        assert len(res.tokens["tcp"]) == 3
    c.outputs.close()


# ---------------------------------------------------------------- parent death

PARENT = """
import sys, anyio
from triollm.actors.process import open_process_core
from triollm.engine.config import EngineArgs

async def main():
    args = EngineArgs(model=sys.argv[1], max_model_len=64, multiprocess=True)
    async with open_process_core(args.create_engine_config()) as c:
        print(c.pid, flush=True)
        await anyio.sleep(60)

anyio.run(main, backend=sys.argv[2])
"""


async def test_child_exits_when_the_parent_is_killed(
    anyio_backend: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    child_pid = None
    async with await anyio.open_process(
        [sys.executable, str(script), str(tiny_model_dir), anyio_backend], stdout=PIPE, stderr=PIPE
    ) as parent:
        try:
            assert parent.stdout is not None
            with anyio.fail_after(30):
                line = b""
                while not line.endswith(b"\n"):
                    line += await parent.stdout.receive()
            child_pid = int(line)
            assert not _gone(child_pid)
            parent.kill()
            await parent.wait()
            t0 = time.monotonic()
            with anyio.fail_after(3):
                while not _gone(child_pid):  # noqa: ASYNC110 (polling the OS)
                    await anyio.sleep(0.02)
            logging.getLogger("triollm").info("orphan exited in %.3f s", time.monotonic() - t0)
        finally:
            if child_pid is not None and not _gone(child_pid):
                os.kill(child_pid, signal.SIGKILL)
            if parent.returncode is None:
                parent.kill()


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 2), (4, 4), (5, 4), (16, 15)])
def test_the_engine_takes_every_core_of_a_small_machine_and_leaves_one_on_a_large_one(
    monkeypatch: pytest.MonkeyPatch, cores: int, expected: int
) -> None:
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert process.default_num_threads() == expected


# ---------------------------------------------------------------- the child runs the parent's config

REPORT = """
import torch
from pathlib import Path

from triollm.engine.config_codec import encode_config
from triollm.engine.execution.scripted_runner import scripted_engine_core


def build(config, *, path):
    Path(path).write_bytes(encode_config(config))  # what the child builds its core with
    Path(path + ".threads").write_text(str(torch.get_num_threads()))
    return scripted_engine_core(config)
"""


@pytest.mark.parametrize("model", ["bundled", "tiny"])
async def test_the_child_runs_the_parents_resolved_config(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    model: str,
) -> None:
    """The child builds its core with the config the parent resolved (the default bundled GGUF
    once ran fp32 in the child while the parent chose quantized), changed only where the parent
    says (multiprocess off, the threads counted), and does not warn about ignored arguments
    again."""
    (tmp_path / "report_factory.py").write_text(REPORT)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    # The default model is the bundled GGUF: quantized with a bf16 KV cache on a VNNI CPU.
    args = EngineArgs(multiprocess=True, trust_remote_code=True) if model == "bundled" else _args(
        tiny_model_dir, trust_remote_code=True, kv_cache_dtype="bfloat16"
    )
    config = args.create_engine_config()
    assert config.ignored_args == ("trust_remote_code",) and config.actor.multiprocess
    capfd.readouterr()
    report = tmp_path / "config.msgpack"
    factory = EngineCoreFactory("report_factory:build", {"path": str(report)})
    async with open_process_core(config, core_factory=factory) as c:
        assert c.ready.max_model_len == config.model.max_model_len
        assert c.ready.vocab_size == config.model.vocab_size
    c.outputs.close()
    child = decode_config(report.read_bytes())
    threads = config.num_threads or process.default_num_threads()
    assert child == process.child_config(config)
    assert child == dataclasses.replace(
        config, num_threads=threads, actor=dataclasses.replace(config.actor, multiprocess=False)
    )
    assert (child.model.dtype, child.model.quantization, child.model.cache_dtype) == (
        config.model.dtype,
        config.model.quantization,
        config.model.cache_dtype,
    )
    assert int((tmp_path / "config.msgpack.threads").read_text()) == threads
    child_lines = [line for line in capfd.readouterr().err.splitlines() if "(engine core pid" in line]
    assert not [line for line in child_lines if "trust_remote_code" in line], child_lines


def test_child_and_rank_configs_change_only_their_own_fields(tiny_model_dir: Path) -> None:
    config = _args(tiny_model_dir, num_threads=5, data_parallel_size=2).create_engine_config()
    child = process.child_config(config)
    assert child.num_threads == 5 and not child.actor.multiprocess
    assert child == dataclasses.replace(config, actor=dataclasses.replace(config.actor, multiprocess=False))
    unset = process.child_config(dataclasses.replace(config, num_threads=None))
    assert unset.num_threads == process.default_num_threads()

    rank = rank_config(config, 1)
    assert rank.num_threads == 2  # its share of 5
    assert (rank.actor.data_parallel_size, rank.actor.data_parallel_rank, rank.actor.data_parallel_world) == (1, 1, 2)
    assert rank.model == config.model and rank.cache == config.cache and rank.scheduler == config.scheduler
    assert dataclasses.replace(
        rank,
        num_threads=config.num_threads,
        actor=dataclasses.replace(rank.actor, data_parallel_size=2, data_parallel_rank=0, data_parallel_world=2),
    ) == config
