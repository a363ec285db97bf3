"""The plan channel: a chat request's memory plan from the shard over a local ZeroMQ socket.

Planning is on every chat request's path, and a Ray actor call costs a round trip through
Ray's task machinery (bench/serve/shard_hop.py; docs/measured.md). The shard actor is pinned to its
replica's node, so the replica can ask it over a Unix socket instead, several times faster. This
module is that one call, typed (memory.chat_query.ChatQuery in, memory.planner.ChatPlan out), and
nothing else: every other shard call stays a Ray call (actors.shard_client).

- PlanServer runs in the shard actor's process, on a thread of its own; each request runs
  under the lock that also serializes the actor's Ray calls (actors.shard_actor.ShardActor), so
  the shard still runs one call at a time. Each request carries its client's deadline: one whose
  client has given up by the time it is read, or by the time it gets the lock, is answered
  PlanExpired without being planned, so a shard that was slow or restarting does not work
  through a backlog of plans nobody waits for. The address is a Unix socket file beside the shard's
  arena (for a long arena path, in this account's 0700 folder), readable and writable by its
  owner only: the channel answers with users' facts and takes pickles, so no other local account
  may connect, nor put its own socket in the shard's place (an abstract socket would have no
  permissions at all). A restarted shard replaces the file.
- PlanClient is the replica's end: one DEALER socket, many requests in flight, one reader task
  that hands each reply to its waiting request. A request that gets no answer within the
  client's timeout raises PlanChannelTimeout (the shard is restarting, or busy for longer): the
  chat is answered 503 with Retry-After. It is not asked again through Ray: that doubled the
  shard's work exactly when it was behind. ZeroMQ reconnects to a restarted shard by itself.

ZeroMQ (pyzmq, already a vLLM dependency) rather than a hand-written socket protocol: framing,
reconnects and many-to-one routing are what it does. Messages are pickled, as Ray's are.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import pickle
import stat
import struct
import tempfile
import threading
import time
from typing import Any, Callable

import zmq
import zmq.asyncio

from memory.chat_query import ChatQuery
from memory.planner import ChatPlan

logger = logging.getLogger(__name__)

_POLL_MS = 200  # how often the server thread checks whether it should stop


class PlanChannelTimeout(TimeoutError):
    """The shard did not answer on the plan channel within the client's timeout."""


class PlanExpired(TimeoutError):
    """The shard read a plan request after its client's deadline and did not plan it."""


_DEADLINE = struct.Struct("<d")  # the client's deadline, wall-clock seconds (both ends share a host)


_MAX_SOCKET_PATH = 100  # sockaddr_un holds 107 bytes


def plan_channel_address(arena_path: str) -> str:
    """The channel of the shard whose arena is at `arena_path`: a socket file beside it, or, for
    an arena path too long for a Unix socket, one named by its hash in this account's private
    folder (private_socket_folder): never in a folder where another account could put its own
    socket first and be asked for plans (and answer with pickles) in the shard's place."""
    path = f"{arena_path}.plan.sock"
    if len(path) > _MAX_SOCKET_PATH:
        name = f"kvmem-plan-{hashlib.sha1(arena_path.encode()).hexdigest()[:24]}.sock"
        path = os.path.join(private_socket_folder(), name)
    return f"ipc://{path}"


def private_socket_folder() -> str:
    """`kvmem-<uid>` in $XDG_RUNTIME_DIR (else the temporary folder), made 0700 by this account.
    Raises PermissionError when it exists but is not a folder of this account closed to others
    (another account made it first): the shard then fails to start, with this reason, rather
    than talk through a folder someone else controls. Both ends check it."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = os.path.join(runtime if runtime and os.path.isdir(runtime) else tempfile.gettempdir(), f"kvmem-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"{folder} must be a folder owned by uid {os.getuid()} that no one else may use (mode 0700): "
            "remove it, or give memory.arena_dir a shorter path"
        )
    return folder


def _reply(outcome: tuple[str, Any]) -> bytes:
    try:
        return pickle.dumps(outcome)
    except Exception as exc:  # an exception that does not pickle travels as its text
        return pickle.dumps(("error", RuntimeError(f"{type(outcome[1]).__name__}: {outcome[1]} ({exc})")))


class PlanServer:
    """Answers ChatQuery objects with `plan(query)` under `lock`, on its own thread (module docstring)."""

    def __init__(self, plan: Callable[[ChatQuery], ChatPlan], address: str, lock: threading.RLock) -> None:
        self.plan = plan
        self.address = address
        self.lock = lock
        self.bound = threading.Event()
        self._stop = threading.Event()
        self.expired = 0  # requests not planned: their clients had given up
        self._socket: zmq.Socket | None = None
        self._inode: int | None = None
        self._thread = threading.Thread(target=self._serve, name="kvmem-plan-channel", daemon=True)

    def start(self) -> "PlanServer":
        """Bind now (in the caller's thread: the umask change below must not race the thread's
        start), then serve on the thread, which takes the socket over."""
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._bind(self._socket)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        path = self.address[len("ipc://"):]
        with contextlib.suppress(OSError):  # its own file only, not a successor's
            if self._inode is not None and os.stat(path).st_ino == self._inode:
                os.unlink(path)

    def _bind(self, socket: zmq.Socket) -> None:
        """Bind the socket file, owner-only; a file left by a dead predecessor is replaced."""
        path = self.address[len("ipc://"):]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        previous = os.umask(0o177)  # the file is created 0600: no window where others may connect
        try:
            socket.bind(self.address)
        finally:
            os.umask(previous)
        self._inode = os.stat(path).st_ino
        self.bound.set()

    def _serve(self) -> None:
        socket = self._socket
        try:
            while not self._stop.is_set():
                if not socket.poll(_POLL_MS):
                    continue
                frames = socket.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != _DEADLINE.size:  # not one of our clients' messages: dropped
                    logger.warning("plan channel %s: dropped a message of %d frames", self.address, len(frames))
                    continue
                client, request_id, deadline, payload = frames
                socket.send_multipart([client, request_id, _reply(self._answer(_DEADLINE.unpack(deadline)[0], payload))])
        except Exception:  # the shard's health says so, and the replica's watchdog restarts the shard
            logger.exception("plan channel %s stopped", self.address)
        finally:
            socket.close()

    def _answer(self, deadline: float, payload: bytes) -> tuple[str, Any]:
        """The plan, the shard's own error (raised again in the replica), or PlanExpired when the
        client's deadline passed before the plan could start."""
        try:
            if time.time() > deadline:
                raise PlanExpired("the plan request reached the shard after its client gave up")
            request = pickle.loads(payload)
            with self.lock:
                if time.time() > deadline:
                    raise PlanExpired("the plan request waited past its client's deadline for the shard")
                return ("ok", self.plan(request))
        except Exception as exc:
            self.expired += isinstance(exc, PlanExpired)
            return ("error", exc)

    def serving(self) -> bool:
        """Whether the channel's thread still answers (it stops only on an error of its own)."""
        return self._thread.is_alive() and not self._stop.is_set()


class PlanClient:
    """The replica's end of a shard's plan channel (module docstring). Use from one event loop."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._socket: zmq.asyncio.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task | None = None
        self._waiting: dict[bytes, asyncio.Future] = {}
        self._ids = itertools.count()

    def _connect(self) -> zmq.asyncio.Socket:
        loop = asyncio.get_running_loop()
        if self._socket is None or self._loop is not loop or self._reader is None or self._reader.done():
            self.close()
            self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection, not a dead shard's
            self._socket.connect(self.address)
            self._loop = loop
            self._reader = loop.create_task(self._read(self._socket))
        return self._socket

    async def _read(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            request_id, reply = await socket.recv_multipart()
            waiting = self._waiting.get(request_id)
            if waiting is not None and not waiting.done():  # else: it timed out already
                waiting.set_result(reply)

    async def plan(self, request: ChatQuery) -> ChatPlan:
        """The shard's plan; the shard's exception if planning failed; PlanChannelTimeout if no
        answer came within timeout_s."""
        socket = self._connect()
        request_id = next(self._ids).to_bytes(8, "little")
        answer = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = answer

        try:
            # asyncio.timeout, not wait_for: no task of its own per request (one loop turn fewer)
            async with asyncio.timeout(self.timeout_s):
                deadline = _DEADLINE.pack(time.time() + self.timeout_s)
                await socket.send_multipart([request_id, deadline, pickle.dumps(request)])
                reply = await answer
        except TimeoutError:
            raise PlanChannelTimeout(f"no plan from {self.address} within {self.timeout_s:g} s") from None
        finally:
            self._waiting.pop(request_id, None)
        status, value = pickle.loads(reply)
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        if self._reader is not None and not self._reader.done():
            try:
                self._reader.cancel()
            except RuntimeError:  # its event loop is closed already
                pass
        if self._socket is not None:
            self._socket.close()
        self._socket = self._reader = None
