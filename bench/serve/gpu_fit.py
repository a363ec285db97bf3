"""Issue 34's start checks on the GPU: what each process of the service holds on the card through a
start (nvidia-smi per process, every second), and a start whose plan cannot fit the card."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from bench.kit.results import read_json, write_result

QUERY = "--query-compute-apps=pid,used_memory"


class GpuMemoryTrace:
    """nvidia-smi's per-process GPU memory every second into `path` (module docstring)."""

    def __init__(self, path: Path, period_s: float = 1.0) -> None:
        self.path = path
        self.period_s = period_s
        self.started = time.time()
        self.titles: dict[int, str] = {}
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> "GpuMemoryTrace":
        if shutil.which("nvidia-smi") is None:
            self.path.write_text("no nvidia-smi on this machine\n")
            return self
        script = (f"while true; do t=$(date +%s.%N); nvidia-smi {QUERY} --format=csv,noheader,nounits | "
                  f"sed \"s/^/$t, /\"; sleep {self.period_s}; done")
        self._process = subprocess.Popen(["bash", "-c", script], stdout=open(self.path, "w"), start_new_session=True)
        return self

    def name_processes(self) -> None:
        """Remember the titles of the pids on the card now (a process may be gone by the end)."""
        for pid in self._pids():
            try:
                self.titles.setdefault(pid, " ".join(psutil.Process(pid).cmdline())[:120] or psutil.Process(pid).name())
            except psutil.Error:
                pass

    def __exit__(self, *exc: object) -> None:
        self.name_processes()
        if self._process is not None:
            os.killpg(self._process.pid, signal.SIGTERM)
            self._process.wait(10)

    def _rows(self) -> list[tuple[float, int, int]]:
        rows = []
        for line in self.path.read_text().splitlines() if self.path.exists() else []:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and parts[1].isdigit():
                rows.append((float(parts[0]), int(parts[1]), int(parts[2])))
        return rows

    def _pids(self) -> set[int]:
        return {pid for _, pid, _ in self._rows()}

    def summary(self) -> dict[str, Any]:
        """Per process: its title, peak MiB and the second (from the trace's start) it was reached."""
        peaks: dict[int, tuple[int, float]] = {}
        for at, pid, mib in self._rows():
            if mib >= peaks.get(pid, (-1, 0.0))[0]:
                peaks[pid] = (mib, at - self.started)
        return {str(pid): {"process": self.titles.get(pid, "?"), "peak_mib": mib, "at_s": round(at, 1)}
                for pid, (mib, at) in sorted(peaks.items())}


def started_with(service: Any) -> dict[str, Any]:
    """The memory plan and the start's phases each replica reports (/v1/shards), and the plan's log line."""
    import httpx

    try:
        shards = httpx.get(f"{service.url}/v1/shards", headers={"Authorization": f"Bearer {service.admin_key}"}, timeout=30).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"shards_error": repr(exc)}
    log = (service.out / service.log_name).read_text(errors="replace").splitlines()
    return {"memory_plan": [s.get("memory_plan") for s in shards.get("results", [])],
            "start_phases": [s.get("start_phases") for s in shards.get("results", [])],
            "plan_lines": [line[:400] for line in log if "memory plan" in line][:4]}


DEPLOY_FAILED_MARKS = ("failed with exception", "DEPLOY_FAILED", "Deploying app 'kvmem' failed")


def refused_start(out: Path, device_pages: int = 10_000_000, timeout_s: float = 180.0) -> dict[str, Any]:
    """`serve run config.gpu.yaml` with an HBM tier far past the card: seconds until it ends, its exit
    code and the lines that name the refusal."""
    from bench.kit.service import ServeRun, llama8b_dummy_overrides

    overrides = {**llama8b_dummy_overrides(), "KVMEM_MEMORY__ARENA__DEVICE_PAGES": str(device_pages)}
    service = ServeRun(out, overrides=overrides, fresh=True, log_name="refusal-serve.log")
    log_path = out / service.log_name
    started = time.monotonic()
    process = service.launch()
    ended = failed = None  # `serve run` stays up after its application is DEPLOY_FAILED: the log says when
    try:
        while ended is None and time.monotonic() - started < timeout_s:
            if process.poll() is not None:
                ended = round(time.monotonic() - started, 1)
            elif failed is None and any(mark in log_path.read_text(errors="replace") for mark in DEPLOY_FAILED_MARKS):
                failed = round(time.monotonic() - started, 1)
                break
            time.sleep(0.5)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            process.wait(60)
        service.stop()
    lines = [line for line in log_path.read_text(errors="replace").splitlines()
             if any(word in line for word in ("PlanRefused", "does not fit", "memory plan", "device_pages"))]
    first = failed if failed is not None else ended
    return {"device_pages": device_pages, "deploy_failed_after_s": failed, "serve_run_ended_after_s": ended,
            "exit_code": process.returncode, "within_60_s": first is not None and first <= 60, "message_lines": lines[-6:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu-fit-out"))
    parser.add_argument("--refusal", action="store_true", help="a start with device_pages far past the card")
    parser.add_argument("--device-pages", type=int, default=10_000_000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_fit.json"
    result = read_json(path, {})
    if args.refusal:
        result["refusal"] = refused_start(args.out, args.device_pages)
        print(json.dumps(result["refusal"], indent=1))
    write_result(path, result)


if __name__ == "__main__":
    main()
