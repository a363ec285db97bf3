"""Serving benchmarks: the Ray Serve application as a user meets it, through HTTP (TTFT, QPS, faults,
starts, tenants). What each module measures and how to stage and run them: docs/bench.md."""
