"""The bench kit (bench/kit/results.py): every result names its card inside, percentiles and
tables as the benches print them. Pure: no service, no engine. And bench/ as a whole (issue 35):
every runnable bench answers `--help`, none imports tests/."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kit.results import card_tag, median, percentiles, table, write_result


def test_a_result_names_its_card_first(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "result.json"
    write_result(path, {"x": 1, "card": "NVIDIA H200, 143771 MiB"}, quiet=True)
    doc = json.loads(path.read_text())
    assert list(doc) == ["card", "x"] and doc["card"] == "NVIDIA H200, 143771 MiB"
    write_result(path, {"x": 2}, quiet=True)  # no card given: this machine's
    assert json.loads(path.read_text())["card"]


@pytest.mark.parametrize(("name", "tag"), [("NVIDIA H200, 143771 MiB", "h200"), ("NVIDIA H100 80GB HBM3, 81559 MiB", "h100"),
                                           ("NVIDIA L4, 23034 MiB", "gpu"), ("CPU: AMD EPYC, 2 cores", "cpu")])
def test_card_tag(name: str, tag: str) -> None:
    assert card_tag(name) == tag


def test_percentiles_and_median() -> None:
    assert percentiles([0.001, 0.002, 0.003, 0.004], (50, 95), 1e3, 2, "_ms", n=True) == {"p50_ms": 2.5, "p95_ms": 3.85, "n": 4}
    assert percentiles([], (50,)) == {"p50": None}
    assert median([0.1, 0.3], 1e3) == 200.0 and median([]) is None


def test_table_aligns_columns() -> None:
    lines = table([["kv", 1.234, None], ["prompt", 10.0, 3]], ["mode", "ms", "n"]).splitlines()
    assert lines[0].split() == ["mode", "ms", "n"] and lines[1].split() == ["kv", "1.23", "-"]
    assert len({len(line) for line in lines}) == 1


BENCH = Path(__file__).resolve().parent.parent / "bench"
RUNNABLE = sorted(p for p in BENCH.rglob("*.py") if 'if __name__ == "__main__":' in p.read_text())


RUNNABLE_NAMES = {  # the benches run as modules (issue 35's retired ones: docs/bench.md names their last commit)
    "api/fuzz_api", "engine/engine_ttft", "ingest/add_latency", "ingest/ingest_locomo", "quality/extraction_locomo", "quality/locomo_qa",
    "retrieval/locomo_recall", "serve/crash_recovery", "serve/gpu_fit", "serve/ingress_variants", "serve/serve_http", "serve/shard_hop",
    "serve/start_phases", "serve/tenants_flood",
}


def test_every_bench_module_is_found() -> None:
    assert {str(p.relative_to(BENCH).with_suffix("")) for p in RUNNABLE} == RUNNABLE_NAMES


@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: str(p.relative_to(BENCH.parent)))
def test_every_bench_answers_help(path: Path) -> None:
    """Each runnable bench imports and parses `--help` (exit 0) without a GPU, a service or data."""
    module = ".".join(path.relative_to(BENCH.parent).with_suffix("").parts)
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=BENCH.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{module} --help: {done.stderr[-2000:]}"
    assert "usage:" in done.stdout


def test_no_bench_module_imports_tests() -> None:
    offenders = []
    for path in BENCH.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(BENCH.parent)}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert offenders == []
