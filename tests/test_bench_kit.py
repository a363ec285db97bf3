"""The bench kit (bench/kit/results.py): every result names its card inside, percentiles and
tables as the benches print them, a failing section recorded while the next one runs. Pure: no
service, no engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.kit.results import Sections, card_tag, median, percentiles, table, write_result


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


def test_a_failing_section_is_recorded_and_the_next_runs(tmp_path: Path) -> None:
    sections = Sections(tmp_path / "r.json", {"run": "test"})
    with sections.section("broken") as r:
        r["before"] = 1
        raise ValueError("no GPU")
    with sections.section("fine") as r:
        r["value"] = 2
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["sections"]["broken"]["error"] == "ValueError: no GPU" and doc["sections"]["broken"]["before"] == 1
    assert doc["sections"]["fine"]["value"] == 2 and "card" in doc
