"""Serving benchmarks: the Ray Serve application as a user meets it, through HTTP. serve_http.py
starts `serve run config.gpu.yaml` on a GPU (or the CPU config with `--cpu`; bench.kit.service.
ServeRun) and measures it (http_measures.py): the README's examples, time to first token per memory
mode and k against the engine's own and Ray Serve's floor (the no-op applications of
serve_floor.py), Locust QPS, turn-by-turn ingest, py-spy profiles under load (serve_profile.py) and
the prefix-cache peer (prefix_peer.py); crash_recovery.py (with crash_watch.py) kills the engine
core, the replica and the shard actor and stops Redis under load, one fault at a time, and says
what each cost; gpu_fit.py traces what each process holds on the card through a start and times a
refused one; start_phases.py times the CPU service's start phase by phase; tenants_flood.py (with
hostile_clients.py) and admission_spread.py measure one tenant against another on the CPU service;
serve_load_diagnosis.sh splits a chat's time under load on a service serve_http.py left running;
shard_hop.py times the replica -> shard actor hop by itself. Stage with `.venv/bin/python -m
bench.serve.serve_http --prepare` here, then run `python3 -m bench.serve.serve_http --out $OUT
--parts ttft` on the GPU machine (docs/gpu.md); `.venv/bin/python -m bench.serve.shard_hop` runs
anywhere. Each result names the card it ran on inside ("card").
"""
