"""Where a chat's time went, as Locust statistics of their own: the time to its first content
chunk (`TTFT chat`), to the end of its stream (`COMPLETE chat`), and the replica's own stages from
the stream's finishing chunk (`SERVER replica_ttft`, `SERVER prepare`, ..., `SERVER outside_replica`).

They are kept apart from Locust's request statistics, so Locust's rows and its "Aggregated" row
count requests only (one chat is one request, not a dozen rows). Each process keeps them in a
locust.stats.RequestStats (Locust's own entries: the same percentiles as its rows); with
`--processes` or workers they travel to the master in Locust's worker reports, as its own
statistics do. At the end the master (or the single process) prints them and, with `--csv
PREFIX`, writes `PREFIX_stages.csv` with the columns of Locust's `PREFIX_stats.csv`.
"""

from __future__ import annotations

import csv
from typing import Any

from locust import events
from locust.env import Environment
from locust.runners import WorkerRunner
from locust.stats import RequestStats, StatsEntry

REPORT_KEY = "kvmem_stages"
PERCENTILES = (0.5, 0.66, 0.75, 0.8, 0.9, 0.95, 0.98, 0.99, 0.999, 0.9999, 1.0)

STAGES = RequestStats(use_response_times_cache=False)


def record(kind: str, name: str, milliseconds: float) -> None:
    """One observation of a stage (`kind`: TTFT, COMPLETE or SERVER)."""
    STAGES.log_request(kind, name, milliseconds, 0)


@events.report_to_master.add_listener
def _send(client_id: str, data: dict[str, Any]) -> None:
    data[REPORT_KEY] = STAGES.serialize_stats()  # what was recorded since the last report (then cleared)


@events.worker_report.add_listener
def _receive(client_id: str, data: dict[str, Any]) -> None:
    for entry in data.get(REPORT_KEY, []):
        STAGES.entries[(entry["name"], entry["method"])].extend(StatsEntry.unserialize(entry, STAGES))


def rows() -> list[dict[str, Any]]:
    """One row per stage, in the columns of Locust's stats CSV (times in ms)."""
    out = []
    for (name, kind), entry in sorted(STAGES.entries.items(), key=lambda item: (item[0][1], item[0][0])):
        if entry.num_requests == 0:
            continue
        row: dict[str, Any] = {
            "Type": kind, "Name": name, "Request Count": entry.num_requests,
            "Median Response Time": entry.median_response_time, "Average Response Time": round(entry.avg_response_time, 3),
            "Min Response Time": entry.min_response_time, "Max Response Time": entry.max_response_time,
        }
        row.update({f"{p * 100:g}%": entry.get_response_time_percentile(p) for p in PERCENTILES})
        out.append(row)
    return out


@events.quitting.add_listener
def _report(environment: Environment, **_: Any) -> None:
    if isinstance(environment.runner, WorkerRunner):
        return  # the master reports the whole run
    table = rows()
    if not table:
        return
    print(f"\n{'stage':<32}{'count':>8}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}")
    for row in table:
        print(f"{row['Type'] + ' ' + row['Name']:<32}{row['Request Count']:>8}{row['Median Response Time']:>10.1f}"
              f"{row['90%']:>10.1f}{row['99%']:>10.1f}")
    prefix = getattr(environment.parsed_options, "csv_prefix", None) if environment.parsed_options else None
    if prefix:
        with open(f"{prefix}_stages.csv", "w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
