"""The anyio adapter over pyzmq, on trio and asyncio: two sockets in one process."""

from __future__ import annotations

import logging
import math
from typing import Any

import anyio
import msgspec
import pytest
import zmq

from triollm.actors import zmq_io

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


_peers: list[zmq.Socket[Any]] = []


@pytest.fixture(params=["ipc", "tcp://127.0.0.1", "tcp://[::1]", "insecure tcp://127.0.0.1"])
def endpoints(request: pytest.FixtureRequest):
    insecure, _, address = request.param.rpartition(" ")
    try:
        ends = zmq_io.Endpoints.bind(address, insecure_tcp=bool(insecure))
    except zmq.ZMQError as exc:
        pytest.skip(f"cannot bind {request.param}: {exc}")
    yield ends
    while _peers:
        _peers.pop().close(linger=0)
    for sock in (ends.inputs, ends.outputs):
        sock.close(linger=0)
    ends.close()


class Ping(msgspec.Struct, array_like=True):
    n: int
    text: str = ""


def _peer(ends: zmq_io.Endpoints) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    """The child's side: PULL on the input address, PUSH on the output address."""
    pull = zmq_io.connect(ends.ctx, zmq.PULL, ends.input_address, ends.client_keys)
    push = zmq_io.connect(ends.ctx, zmq.PUSH, ends.output_address, ends.client_keys)
    _peers.extend((pull, push))
    return pull, push


async def test_round_trips(endpoints: zmq_io.Endpoints) -> None:
    pull, push = _peer(endpoints)

    async def echo() -> None:
        while True:
            await zmq_io.send(push, await zmq_io.recv(pull))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(echo)
            for i in range(200):
                await zmq_io.send(endpoints.inputs, b"ping %d" % i)
                assert await zmq_io.recv(endpoints.outputs) == b"ping %d" % i
            tg.cancel_scope.cancel()


async def test_streamed_messages_through_pumps(endpoints: zmq_io.Endpoints) -> None:
    pull, push = _peer(endpoints)
    n = 2000
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(Ping)
    a_send, a_recv = anyio.create_memory_object_stream[Ping](math.inf)
    b_send, b_recv = anyio.create_memory_object_stream[Ping](4)  # bounded: back-pressure
    with a_send, b_recv, anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(zmq_io.pump_to_socket, endpoints.inputs, a_recv, enc.encode)
            tg.start_soon(zmq_io.pump_from_socket, pull, b_send, dec.decode)
            for i in range(n):
                a_send.send_nowait(Ping(i, "x" * (i % 7)))
            got = [msg.n async for msg in _take(b_recv, n)]
            assert got == list(range(n))
            tg.cancel_scope.cancel()
    del push


async def _take(stream, n):
    for _ in range(n):
        yield await stream.receive()


async def test_pump_from_socket_stops_at_until_and_closes_the_stream(
    endpoints: zmq_io.Endpoints,
) -> None:
    pull, push = _peer(endpoints)
    send, recv = anyio.create_memory_object_stream[bytes](10)
    for msg in (b"a", b"b", b"stop", b"after"):
        await zmq_io.send(endpoints.inputs, msg)
    with anyio.fail_after(5):
        last = await zmq_io.pump_from_socket(pull, send, bytes, until=lambda m: m == b"stop")
    assert last == b"stop"
    with recv:
        assert [m async for m in recv] == [b"a", b"b", b"stop"]  # ends: the pump closed the stream
    assert await zmq_io.recv(pull) == b"after"
    del push


async def test_pump_to_socket_ends_with_its_stream(endpoints: zmq_io.Endpoints) -> None:
    pull, push = _peer(endpoints)
    send, recv = anyio.create_memory_object_stream[bytes](10)
    for msg in (b"1", b"2", b"3"):
        send.send_nowait(msg)
    send.close()
    with anyio.fail_after(5):
        await zmq_io.pump_to_socket(endpoints.inputs, recv, bytes)
        assert [await zmq_io.recv(pull) for _ in range(3)] == [b"1", b"2", b"3"]
    del push


async def test_two_messages_queued_before_the_receiver_waits(endpoints: zmq_io.Endpoints) -> None:
    """The edge-triggered fd trap: both queued messages arrive, then a later one still wakes us."""
    pull, push = _peer(endpoints)
    await zmq_io.send(push, b"one")
    await zmq_io.send(push, b"two")
    await anyio.sleep(0.1)  # both are in the receiver's queue; the fd's edge has fired already
    with anyio.fail_after(5):
        assert await zmq_io.recv(endpoints.outputs) == b"one"
        assert await zmq_io.recv(endpoints.outputs) == b"two"

        async def later() -> None:
            await anyio.sleep(0.05)
            await zmq_io.send(push, b"three")

        async with anyio.create_task_group() as tg:
            tg.start_soon(later)
            assert await zmq_io.recv(endpoints.outputs) == b"three"
    del pull


async def test_send_waits_for_a_peer(endpoints: zmq_io.Endpoints) -> None:
    """A bound PUSH has no pipe before a peer connects: send waits, then goes through."""
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(zmq_io.send, endpoints.inputs, b"hello")
            await anyio.sleep(0.05)
            pull = zmq_io.connect(endpoints.ctx, zmq.PULL, endpoints.input_address, endpoints.client_keys)
            _peers.append(pull)
            assert await zmq_io.recv(pull) == b"hello"


async def test_close_wakes_a_waiting_receiver(endpoints: zmq_io.Endpoints) -> None:
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def closer() -> None:
                await anyio.sleep(0.05)
                zmq_io.close(endpoints.outputs)

            tg.start_soon(closer)
            with pytest.raises(anyio.ClosedResourceError):
                await zmq_io.recv(endpoints.outputs)
    with pytest.raises(anyio.ClosedResourceError):
        await zmq_io.recv(endpoints.outputs)  # and stays closed
    zmq_io.close(endpoints.outputs)  # idempotent


async def test_close_wakes_a_waiting_sender(endpoints: zmq_io.Endpoints) -> None:
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def closer() -> None:
                await anyio.sleep(0.05)
                zmq_io.close(endpoints.inputs)

            tg.start_soon(closer)
            with pytest.raises(anyio.ClosedResourceError):
                await zmq_io.send(endpoints.inputs, b"nobody listens")  # no peer: it waits


async def test_cancelled_receive_loses_no_message(endpoints: zmq_io.Endpoints) -> None:
    pull, push = _peer(endpoints)
    with anyio.move_on_after(0.05):
        await zmq_io.recv(endpoints.outputs)
    await zmq_io.send(push, b"kept")
    with anyio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(anyio.get_cancelled_exc_class()):
            await zmq_io.recv(endpoints.outputs)  # cancelled before it touched the socket
    with anyio.fail_after(5):
        assert await zmq_io.recv(endpoints.outputs) == b"kept"
    del pull


async def test_close_removes_the_ipc_directory() -> None:
    ends = zmq_io.Endpoints.bind("ipc")
    assert ends.tmpdir is not None and await anyio.Path(ends.tmpdir).is_dir()
    assert ends.input_address.startswith("ipc://")
    ends.close()
    ends.close()
    assert not await anyio.Path(ends.tmpdir).exists()


def test_bad_address() -> None:
    with pytest.raises(ValueError, match="zmq_address"):
        zmq_io.Endpoints.bind("udp://x")


async def test_ipc_directories_of_dead_owners_are_reclaimed(tmp_path, monkeypatch) -> None:
    # A server that was SIGKILLed could not remove its directory: the next bind does.
    import os
    import sys
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = await anyio.run_process([sys.executable, "-c", "import os; print(os.getpid())"])
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"triollm-{dead_pid}-abc123"
    stale.mkdir()
    (stale / "in.sock").write_bytes(b"")
    alive = tmp_path / "triollm-1-keepme"  # pid 1 runs: not ours to judge
    alive.mkdir()
    other = tmp_path / "triollm-notapid"
    other.mkdir()
    ends = zmq_io.Endpoints.bind("ipc")
    try:
        assert ends.tmpdir is not None
        assert ends.tmpdir.startswith(str(tmp_path / f"triollm-{os.getpid()}-"))
        assert not stale.exists()
        assert alive.is_dir() and other.is_dir()
    finally:
        ends.close()
    assert not await anyio.Path(ends.tmpdir).exists()


async def test_tcp_is_curve_unless_opted_out() -> None:
    if not zmq_io.curve_available():
        pytest.skip("this libzmq has no CURVE")
    ends = zmq_io.Endpoints.bind("tcp://127.0.0.1")
    socks: list[zmq.Socket[Any]] = []
    try:
        keys = ends.client_keys
        assert keys is not None and zmq_io.ClientKeys.decode(keys.encode()) == keys
        assert ends.inputs.curve_server and ends.outputs.curve_server
        # A peer without the server's key (plain, or CURVE with a guessed key) hears nothing.
        intruder_pub, intruder_sec = zmq.curve_keypair()
        wrong = zmq_io.ClientKeys(intruder_pub, intruder_pub, intruder_sec)
        for curve in (None, wrong):
            socks.append(zmq_io.connect(ends.ctx, zmq.PULL, ends.input_address, curve))
        socks.append(zmq_io.connect(ends.ctx, zmq.PULL, ends.input_address, keys))
        with anyio.fail_after(10):
            for i in range(3):
                await zmq_io.send(ends.inputs, b"secret %d" % i)
            for i in range(3):  # PUSH round-robins over the peers that completed the handshake
                assert await zmq_io.recv(socks[2]) == b"secret %d" % i
        with anyio.move_on_after(0.3):
            await zmq_io.recv(socks[0])
            pytest.fail("a plain peer received a message")
        with anyio.move_on_after(0.3):
            await zmq_io.recv(socks[1])
            pytest.fail("a peer with the wrong server key received a message")
    finally:
        for sock in socks:
            zmq_io.close(sock)
        ends.close()


async def test_only_the_childs_client_key_may_connect(
    no_leaks: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that knows the server's public key but has a client key pair of its own is refused
    by the ZAP handler: it receives nothing and what it sends never arrives, while the rightful
    client does both. The handler's thread ends with `close()` (`no_leaks`)."""
    if not zmq_io.curve_available():
        pytest.skip("this libzmq has no CURVE")
    ends = zmq_io.Endpoints.bind("tcp://127.0.0.1")
    socks: list[zmq.Socket[Any]] = []
    try:
        keys = ends.client_keys
        assert keys is not None
        impostor_public, impostor_secret = zmq.curve_keypair()
        impostor = zmq_io.ClientKeys(keys.server_public, impostor_public, impostor_secret)
        bad_pull = zmq_io.connect(ends.ctx, zmq.PULL, ends.input_address, impostor)
        bad_push = zmq_io.connect(ends.ctx, zmq.PUSH, ends.output_address, impostor)
        socks += [bad_pull, bad_push]
        bad_push.send(b"forged", zmq.NOBLOCK)  # queued on its side until a handshake succeeds
        await anyio.sleep(0.2)  # its handshakes are under way first
        good_pull = zmq_io.connect(ends.ctx, zmq.PULL, ends.input_address, keys)
        good_push = zmq_io.connect(ends.ctx, zmq.PUSH, ends.output_address, keys)
        socks += [good_pull, good_push]
        with anyio.fail_after(10):
            for i in range(3):
                await zmq_io.send(ends.inputs, b"secret %d" % i)
            for i in range(3):  # all of them: the impostor is no peer of the PUSH socket
                assert await zmq_io.recv(good_pull) == b"secret %d" % i
            await zmq_io.send(good_push, b"rightful")
            assert await zmq_io.recv(ends.outputs) == b"rightful"
        with anyio.move_on_after(0.5):
            got = await zmq_io.recv(ends.outputs)
            pytest.fail(f"the server received {got!r} from a peer with another client key")
        with anyio.move_on_after(0.3):
            got = await zmq_io.recv(bad_pull)
            pytest.fail(f"a peer with another client key received {got!r}")
    finally:
        for sock in socks:
            zmq_io.close(sock)
        ends.close()
    # Refused again at every reconnection (every 100 ms), but said once at WARNING.
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unknown client key" in warnings[0].getMessage()


def test_insecure_tcp_is_an_explicit_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    ends = zmq_io.Endpoints.bind("tcp://127.0.0.1", insecure_tcp=True)
    assert ends.client_keys is None and not ends.inputs.curve_server
    for sock in (ends.inputs, ends.outputs):
        sock.close(linger=0)
    ends.close()
    # Without CURVE in libzmq, tcp (loopback or not) is refused unless opted in; ipc is fine.
    monkeypatch.setattr(zmq_io, "curve_available", lambda: False)
    for address in ("tcp://127.0.0.1", "tcp://0.0.0.0"):
        with pytest.raises(ValueError, match=r"zmq_insecure_tcp=True \(--zmq-insecure-tcp\)"):
            zmq_io.Endpoints.bind(address)
