"""Awaiting pyzmq sockets from anyio, on trio and on asyncio.

A deliberately small adapter; each rule below was found by measurement on a 2-core machine:

- **One owning task per socket, one direction per socket** (PUSH or PULL). The ZMQ file
  descriptor is shared by every operation on a socket: a `send()` from another task consumes
  the edge a receiver waits for, and two waiters on one fd raise `BusyResourceError`.
- **Try first, then wait.** `ZMQ_FD` is edge-triggered and means "the socket's state changed",
  not "readable". So: try the operation with `NOBLOCK`; on `zmq.Again` read `EVENTS` (which also
  re-arms the edge); only if the wanted flag is still clear, wait for the fd; repeat. Waiting on
  the fd first hangs with two messages already queued.
- **Checkpoints without losing messages.** An operation checks for cancellation before it
  touches the socket and yields (shielded) after it succeeded, as trio's own primitives do: a busy
  socket cannot starve the other tasks, and a cancelled receive never drops a message it took.
  The pumps win the throughput back by draining everything queued after each wake-up.
- **Closing** is `notify_closing(fd)` then `close(linger=0)`: a task waiting on the socket gets
  `ClosedResourceError` instead of hanging. Every socket made here has `LINGER=0`, so
  `Context.term()` never hangs; a sender that must flush its last words passes `linger` to
  `close()` (bounded).

Rejected: the `zmq-anyio` package (a helper task or more per message, slower here) and
blocking calls in worker threads (slower, and a blocked thread ignores `fail_after`).
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import zmq
from anyio.abc import ObjectSendStream
from anyio.streams.memory import MemoryObjectReceiveStream
from zmq.auth.thread import ThreadAuthenticator

__all__ = [
    "ClientKeys",
    "Endpoints",
    "close",
    "connect",
    "curve_available",
    "pump_from_socket",
    "pump_to_socket",
    "reclaim_stale_ipc_dirs",
    "recv",
    "send",
]

T = TypeVar("T")

log = logging.getLogger("triollm")

_CLOSED_ERRNOS = (zmq.ENOTSOCK, zmq.ETERM)


def _closed(exc: zmq.ZMQError) -> Exception:
    if exc.errno in _CLOSED_ERRNOS:
        return anyio.ClosedResourceError()
    return exc


async def _wait_for(sock: zmq.Socket[Any], flag: int) -> None:
    """Return once `EVENTS` has `flag`: re-read the flag, and wait on the fd only while clear."""
    while True:
        try:
            if sock.getsockopt(zmq.EVENTS) & flag:  # type: ignore[operator]
                return
            fd = sock.FD
        except zmq.ZMQError as exc:
            raise _closed(exc) from None
        await anyio.wait_readable(fd)


async def _recv(sock: zmq.Socket[Any]) -> bytes:
    """One message; no checkpoint when one is already queued (the caller provides it)."""
    while True:
        try:
            return sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            await _wait_for(sock, zmq.POLLIN)
        except zmq.ZMQError as exc:
            raise _closed(exc) from None


async def _send(sock: zmq.Socket[Any], data: bytes) -> None:
    """Queue one message; no checkpoint when there is room (the caller provides it)."""
    while True:
        try:
            sock.send(data, zmq.NOBLOCK)
            return
        except zmq.Again:
            await _wait_for(sock, zmq.POLLOUT)
        except zmq.ZMQError as exc:
            raise _closed(exc) from None


async def recv(sock: zmq.Socket[Any]) -> bytes:
    """Receive one message. Raises `ClosedResourceError` if the socket is (or gets) closed."""
    await anyio.lowlevel.checkpoint_if_cancelled()
    data = await _recv(sock)
    await anyio.lowlevel.cancel_shielded_checkpoint()
    return data


async def send(sock: zmq.Socket[Any], data: bytes) -> None:
    """Send one message (waits while the high-water mark is reached or no peer is connected)."""
    await anyio.lowlevel.checkpoint_if_cancelled()
    await _send(sock, data)
    await anyio.lowlevel.cancel_shielded_checkpoint()


async def pump_to_socket(
    sock: zmq.Socket[Any],
    stream: MemoryObjectReceiveStream[T],
    encode: Callable[[T], bytes],
    on_encode_error: Callable[[T, Exception], Awaitable[None]] | None = None,
) -> None:
    """Send every message of `stream` to `sock` until the stream ends (then close the stream).

    After each wake-up everything already queued is sent without waiting again: one checkpoint
    per batch (the stream's `receive()`), not per message. A message that does not encode goes
    to `on_encode_error` (which may fail just the request it carried) and is not sent; without
    it the error propagates.
    """

    async def put(msg: T) -> None:
        try:
            data = encode(msg)
        except Exception as exc:
            if on_encode_error is None:
                raise
            await on_encode_error(msg, exc)
            return
        await _send(sock, data)

    async with stream:
        async for msg in stream:
            await put(msg)
            while True:
                try:
                    msg = stream.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
                await put(msg)


async def pump_from_socket(
    sock: zmq.Socket[Any],
    stream: ObjectSendStream[T],
    decode: Callable[[bytes], T],
    *,
    until: Callable[[T], bool] | None = None,
) -> T | None:
    """Decode every message of `sock` into `stream`; close the stream when done.

    Returns the first message for which `until(msg)` is true (after forwarding it), or None
    when the receiving side of `stream` was closed. A decode error propagates.
    """
    async with stream:
        while True:
            msg = decode(await _recv(sock))
            try:
                await stream.send(msg)  # the checkpoint of this iteration
            except anyio.BrokenResourceError:
                return None
            if until is not None and until(msg):
                return msg


def close(sock: zmq.Socket[Any], linger: int = 0) -> None:
    """Wake any task waiting on `sock` (with `ClosedResourceError`), then close it.

    Call from the event loop's thread. `linger` (ms) bounds how long queued messages may still
    be delivered (it makes `Context.term()` wait as long); 0 drops them. Idempotent.
    """
    if sock.closed:
        return
    anyio.notify_closing(sock.FD)
    sock.close(linger=linger)


def _socket(ctx: zmq.Context[Any], kind: int, ipv6: bool = False) -> zmq.Socket[Any]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if ipv6:
        sock.setsockopt(zmq.IPV6, 1)
    return sock


def connect(
    ctx: zmq.Context[Any], kind: int, address: str, curve: ClientKeys | None = None
) -> zmq.Socket[Any]:
    """A new socket of `kind` (LINGER=0) connected to `address`, as a CURVE client when `curve`
    is given (the peer must be the `Endpoints` those keys came from)."""
    sock = _socket(ctx, kind, ipv6="[" in address)
    try:
        if curve is not None:
            sock.curve_serverkey = curve.server_public
            sock.curve_publickey = curve.public
            sock.curve_secretkey = curve.secret
        sock.connect(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


@dataclass(frozen=True)
class ClientKeys:
    """What the engine-core child needs to connect over CURVE-secured tcp (Z85-encoded keys):
    the parent's public server key and the child's own key pair. Secret: handed to the child
    through its environment (readable only by its user), never on a command line, never logged.
    The parent's ZAP handler admits only `public` (see `Endpoints.bind`)."""

    server_public: bytes
    public: bytes
    secret: bytes

    def encode(self) -> str:
        return b",".join((self.server_public, self.public, self.secret)).decode()  # no "," in Z85

    @classmethod
    def decode(cls, text: str) -> ClientKeys:
        parts = text.encode().split(b",")
        if len(parts) != 3 or any(len(p) != 40 for p in parts):
            raise ValueError("CURVE keys: expected three Z85-encoded 32-byte keys")
        return cls(*parts)


def curve_available() -> bool:
    return bool(zmq.has("curve"))


IPC_DIR_PREFIX = "triollm-"
_IPC_DIR_NAME = re.compile(re.escape(IPC_DIR_PREFIX) + r"(\d+)-\w+")


def make_ipc_dir() -> str:
    """A private temporary directory for the socket files, named after our pid
    (`triollm-PID-XXXXXXXX`), after removing those of owners that are gone.

    `Endpoints.close()` removes the directory; a parent that is SIGKILLed cannot, so the next
    start reclaims it instead (`reclaim_stale_ipc_dirs`).
    """
    reclaim_stale_ipc_dirs()
    return tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-")


def reclaim_stale_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove our user's `triollm-PID-*` directories in `root` (the temp directory) whose PID
    no longer runs. Returns the paths removed. A PID that was reused keeps its directory (the
    safe mistake); directories of other users are never touched."""
    root = tempfile.gettempdir() if root is None else root
    removed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        match = _IPC_DIR_NAME.fullmatch(entry.name)
        if match is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        if _pid_running(int(match.group(1))):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


# The ZAP domain of the engine-core sockets. With ZAP_ENFORCE_DOMAIN a handshake fails when no
# handler answers for it, so a missing or stopped handler shuts everyone out rather than in.
_ZAP_DOMAIN = "triollm-engine-core"


class _ClientKeyCheck:
    """The ZAP handler's credentials provider: only the child's client public key may connect.
    Called in the authenticator's thread with the peer's Z85-encoded key."""

    def __init__(self, allowed: bytes) -> None:
        self._allowed = allowed
        self._refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self._allowed):
            return True
        self._refused += 1
        # Once at WARNING: a peer retrying every 100 ms must not flood the log.
        level = logging.WARNING if self._refused == 1 else logging.DEBUG
        log.log(level, "engine-core link: refused a CURVE peer with an unknown client key")
        return False


def _start_authenticator(ctx: zmq.Context[Any], client_public: bytes) -> ThreadAuthenticator:
    """A ZAP handler (pyzmq's, in a thread of its own: the same on trio and asyncio) for `ctx`
    that admits CURVE peers with the key `client_public` only. Stop it before `ctx.term()`."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("triollm.zap"))
    auth.configure_curve_callback(_ZAP_DOMAIN, credentials_provider=_ClientKeyCheck(client_public))
    try:
        auth.start()
    except BaseException:
        auth.stop()  # a socket left open would make ctx.term() hang
        raise
    return auth


@dataclass
class Endpoints:
    """The parent's side of an engine-core link: a PUSH socket for inputs and a PULL socket for
    outputs, both bound, and the addresses the child connects to.

    `address` is "ipc" (socket files in a private temporary directory, removed by `close()`, or
    by the next start if this process is killed first: see `make_ipc_dir`) or
    "tcp://HOST" (random free ports on HOST, an IP address or an interface; a wildcard host is
    reached through the loopback address; IPv6 hosts in brackets).
    """

    ctx: zmq.Context[Any]
    inputs: zmq.Socket[Any]
    outputs: zmq.Socket[Any]
    input_address: str
    output_address: str
    tmpdir: str | None = None
    client_keys: ClientKeys | None = field(default=None, repr=False)
    authenticator: ThreadAuthenticator | None = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)

    @classmethod
    def bind(cls, address: str, *, insecure_tcp: bool = False) -> Endpoints:
        """Bind both sockets. tcp is CURVE-encrypted with fresh key pairs per link unless
        `insecure_tcp`, and authenticated both ways: a peer must know the server's public key
        to complete the handshake, and a ZAP handler (a thread, stopped by `close()`) admits
        only the child's client key (`client_keys`, which only the child gets). Without CURVE
        in libzmq, tcp needs `insecure_tcp`. ipc (files in a private directory) needs neither."""
        curve: ClientKeys | None = None
        if address.startswith("tcp://") and not insecure_tcp:
            if not curve_available():
                raise ValueError(
                    f"zmq_address: {address!r} would be unauthenticated, unencrypted tcp (this "
                    "libzmq has no CURVE); use 'ipc', or opt in with zmq_insecure_tcp=True "
                    "(--zmq-insecure-tcp)"
                )
            server_public, server_secret = zmq.curve_keypair()
            client_public, client_secret = zmq.curve_keypair()
            curve = ClientKeys(server_public, client_public, client_secret)
        ctx: zmq.Context[Any] = zmq.Context()
        tmpdir: str | None = None
        socks: list[zmq.Socket[Any]] = []
        auth: ThreadAuthenticator | None = None
        try:
            if curve is not None:  # before any socket exists: no handshake without it
                auth = _start_authenticator(ctx, curve.public)
            ipv6 = address.startswith("tcp://[")
            inputs = _socket(ctx, zmq.PUSH, ipv6)
            socks.append(inputs)
            outputs = _socket(ctx, zmq.PULL, ipv6)
            socks.append(outputs)
            if curve is not None:
                for sock in socks:
                    sock.curve_server = True
                    sock.curve_secretkey = server_secret
                    sock.zap_domain = _ZAP_DOMAIN.encode()
                    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            if address == "ipc":
                tmpdir = make_ipc_dir()
                in_addr = f"ipc://{os.path.join(tmpdir, 'in.sock')}"
                out_addr = f"ipc://{os.path.join(tmpdir, 'out.sock')}"
                inputs.bind(in_addr)
                outputs.bind(out_addr)
            elif address.startswith("tcp://"):
                host = address.removeprefix("tcp://")
                peer = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
                in_addr = f"tcp://{peer}:{inputs.bind_to_random_port(address)}"
                out_addr = f"tcp://{peer}:{outputs.bind_to_random_port(address)}"
            else:
                raise ValueError(f"zmq_address: {address!r} is not 'ipc' or 'tcp://HOST'")
        except BaseException:
            for sock in socks:
                sock.close(linger=0)
            if auth is not None:
                auth.stop()
            ctx.term()
            if tmpdir is not None:
                shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        return cls(ctx, inputs, outputs, in_addr, out_addr, tmpdir, curve, auth)

    def close(self) -> None:
        """Close both sockets (waking their waiters), the ZAP handler, the context, and the
        temporary directory. Call from the event loop's thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        close(self.inputs)
        close(self.outputs)
        if self.authenticator is not None:
            self.authenticator.stop()  # joins its thread (it answers at once)
        self.ctx.term()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
