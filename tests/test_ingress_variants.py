"""bench/serve/ingress_variants.py: one variant's serve_<card>.json reduced to the figures issue 39
compares, and the variants' folders merged with their environments. Pure: no service."""

from __future__ import annotations

import json
from pathlib import Path

from bench.serve.ingress_variants import merge, report, summary

RESULT = {
    "card": "NVIDIA H100 80GB HBM3, 81559 MiB", "startup_s": 115.6, "serve_floor_ms": 14.4,
    "http_ttft_ms": {"kv": {"50": 29.0}}, "engine_ttft_ms": {"kv": {"50": 14.2}},
    "stages_ms": {"kv": {"50": {"shard_hop": 0.7}}},
    "locust_qps_varied": {"kv": {"100": 69.3}, "prompt": {"100": 24.6}, "none": {"100": 86.5}},
    "locust_server_ms_varied": {"kv": {"10": {"outside_replica": [30.0, 50.0]},
                                       "100": {"outside_replica": [480.0, 900.0], "shard_hop": [120.0, 460.0]}}},
}


def test_summary_takes_the_most_users_and_the_one_at_a_time_hop() -> None:
    s = summary(RESULT)
    assert s["locust_users"] == 100 and s["qps"] == {"kv": 69.3, "prompt": 24.6, "none": 86.5}
    assert s["kv_over_prompt"] == 2.82 and s["outside_replica_p50_ms"] == 480.0
    assert s["shard_hop_p50_ms"] == {"one_at_a_time": 0.7, "under_load": 120.0}
    assert (s["http_ttft_kv_k50_ms"], s["engine_ttft_kv_k50_ms"]) == (29.0, 14.2)


def test_a_variant_that_measured_nothing_has_no_figures() -> None:
    s = summary({"startup_s": None, "errors": {"locust": "TimeoutError"}})
    assert s["qps"] == {} and s["kv_over_prompt"] is None and s["shard_hop_p50_ms"]["under_load"] is None
    assert s["errors"] == {"locust": "TimeoutError"}


def test_merge_names_each_variant_with_its_environment(tmp_path: Path) -> None:
    for name, env in (("router", ""), ("direct", "KVMEM_ROUTING=direct\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "serve_h100.json").write_text(json.dumps(RESULT))
        (tmp_path / name / "environment").write_text(env)
    merged = merge(tmp_path)
    assert merged["card"] == RESULT["card"] and sorted(merged["variants"]) == ["direct", "router"]
    assert merged["variants"]["direct"]["environment"] == ["KVMEM_ROUTING=direct"] and merged["variants"]["router"]["environment"] == []
    assert "direct" in report(merged) and "69.3" in report(merged)


def test_each_variant_of_the_script_sets_what_its_name_says(tmp_path: Path) -> None:
    """bench/serve/ingress_variants.sh with a stand-in for serve_http (PYTHON): each variant's
    environment reaches the measuring process (a variant once named `router` set nothing while the
    shipped config routes direct, so the router was never measured)."""
    import os
    import subprocess

    stand_in = tmp_path / "python"
    stand_in.write_text('#!/bin/sh\necho "routing=$KVMEM_ROUTING tput=$RAY_SERVE_THROUGHPUT_OPTIMIZED ingress=$KVMEM_INGRESS_REPLICAS"\n')
    stand_in.chmod(0o755)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVMEM_", "RAY_SERVE_"))}
    script = Path(__file__).resolve().parents[1] / "bench" / "serve" / "ingress_variants.sh"
    subprocess.run(["bash", str(script), str(out), "shipped", "router", "direct", "direct_tput", "router8"],
                   env={**env, "PYTHON": str(stand_in)}, check=True, timeout=60)
    seen = {v: (out / v / "serve_http.log").read_text().strip() for v in ("shipped", "router", "direct", "direct_tput", "router8")}
    assert seen == {"shipped": "routing= tput= ingress=", "router": "routing=router tput= ingress=",
                    "direct": "routing=direct tput= ingress=", "direct_tput": "routing=direct tput=1 ingress=",
                    "router8": "routing=router tput= ingress=8"}
    assert "all done" in (out / "progress").read_text()
