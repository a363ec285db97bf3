"""Numbers and where they go: the card a run measured, percentiles, result files and tables. Every
result JSON names the card (or CPU) it was measured on inside the file (`"card"`)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


def card() -> str:
    """The GPU as nvidia-smi names it (with its memory), else the CPU and its core count."""
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        if name:
            return name[0]
    except (OSError, subprocess.SubprocessError):
        pass
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU: {model}, {os.cpu_count()} cores"


def card_tag(name: str | None = None) -> str:
    """A short name of the card for file names: h100, h200, gpu or cpu."""
    name = card() if name is None else name
    return "h200" if "H200" in name else "h100" if "H100" in name else "cpu" if name.startswith("CPU") else "gpu"


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentiles(values: Sequence[float], qs: Iterable[float] = (50, 90, 99), scale: float = 1.0, digits: int = 3,
                unit: str = "", n: bool = False) -> dict[str, Any]:
    """{"p50<unit>": ..., ...} of `values` times `scale`, rounded (None when there are none); with
    `n`, also the count."""
    out: dict[str, Any] = {}
    for q in qs:
        value = percentile(values, q)
        out[f"p{q:g}{unit}"] = None if value is None else round(value * scale, digits)
    if n:
        out["n"] = len(values)
    return out


def median(values: Sequence[float], scale: float = 1.0, digits: int = 3) -> float | None:
    """The median times `scale`, rounded; None for no values."""
    return round(statistics.median(values) * scale, digits) if values else None


def write_result(path: Path, payload: dict[str, Any], card_name: str | None = None, quiet: bool = False) -> dict[str, Any]:
    """Write `payload` as JSON to `path` with `"card"` first (given, the payload's own, or this
    machine's); the parents are made. Returns what was written."""
    doc = {"card": card_name or payload.get("card") or card(), **{k: v for k, v in payload.items() if k != "card"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if not quiet:
        print(f"wrote {path}", flush=True)
    return doc


def read_json(path: Path, default: Any = None) -> Any:
    """The JSON at `path`, or `default` when there is no file."""
    return json.loads(path.read_text()) if path.exists() else default


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], floats: str = ".2f") -> str:
    """A plain aligned text table: numbers right-aligned, anything else left-aligned."""
    def cell(value: Any) -> str:
        return "-" if value is None else format(value, floats) if isinstance(value, float) else str(value)

    def number(value: Any) -> bool:
        return value is None or isinstance(value, (int, float))

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    right = [i > 0 and all(number(row[i]) for row in rows) for i in range(len(headers))]
    lines = ["  ".join(str(h).rjust(w) if r else str(h).ljust(w) for h, w, r in zip(headers, widths, right)).rstrip()]
    lines += ["  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)).rstrip() for row in cells]
    return "\n".join(lines)


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
    """A progress bar (tqdm) over `iterable`, or one to update by hand (`total=`)."""
    from tqdm import tqdm

    return tqdm(iterable, **kwargs)


def tail(path: Path, lines: int = 60) -> str:
    """The last lines of a log file ("" when there is none)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def timed(fn: Callable[..., Any], calls: Sequence[tuple], warmup: int = 0, qs: Iterable[float] = (50, 95)) -> dict[str, Any]:
    """Percentiles in ms (and the count) of `fn(*call)` for each call, after `warmup` untimed calls."""
    for call in calls[:warmup]:
        fn(*call)
    times = []
    for call in calls:
        started = time.perf_counter()
        fn(*call)
        times.append(time.perf_counter() - started)
    return percentiles(times, qs, 1e3, 4, "_ms", n=True)
