"""connector.parent_watch with real processes: an engine-like child stops (through its SIGTERM
handler, as vLLM's engine core shuts down) once its parent is SIGKILLed, and not before; one
that ignores SIGTERM is killed after the grace period."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from connector.parent_watch import watch_parent

    def stop(signum, frame):  # what vLLM's engine core does on SIGTERM: shut down, then exit
        open(sys.argv[1], "w").write("stopped")
        sys.exit(0)

    # a wedged engine (argv[2] == "wedged") does not stop on SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[2] == "wedged" else stop)
    assert watch_parent(poll_s=0.1, grace_s=1.0) is not None
    assert watch_parent() is None  # one watch per process
    print("ready", flush=True)
    while True:
        time.sleep(1)
    """
)
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def _wait_gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _orphan(tmp_path: Path, behaviour: str) -> tuple[int, Path]:
    """Starts parent -> child (the child in `behaviour`), checks the child stays while its parent
    lives, SIGKILLs the parent; returns the child's pid and its marker file."""
    marker = tmp_path / "stopped"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(marker), behaviour], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)
        assert psutil.Process(child).is_running() and not marker.exists()  # its parent lives: it stays
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
    return child, marker


def test_an_engine_process_stops_once_its_parent_is_killed(tmp_path: Path) -> None:
    child, marker = _orphan(tmp_path, "clean")
    assert _wait_gone(child, within_s=5.0), "the orphaned child still runs"
    assert marker.read_text() == "stopped"  # stopped through its own SIGTERM handler, not killed


def test_a_wedged_engine_process_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    child, marker = _orphan(tmp_path, "wedged")
    time.sleep(0.5)
    assert psutil.Process(child).is_running()  # SIGTERM ignored: still there within the grace period
    assert _wait_gone(child, within_s=5.0), "the wedged orphan was not killed"
    assert not marker.exists()
