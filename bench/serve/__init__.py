"""Serving benchmarks: the Ray Serve application as a user meets it, through HTTP. serve_h200.py
starts `serve run config.gpu.yaml` on a GPU (or the CPU config with `--cpu`) and measures it part
by part: the README's examples, time to first token per memory mode and k against the engine's own
and Ray Serve's floor (serve_parts.py, serve_path_parts.py and the no-op applications of
serve_floor.py), Locust QPS, turn-by-turn ingest, py-spy profiles under load (serve_profile.py)
and the prefix-cache peer (peer_parts.py); faults_h200.py (with faults_parts.py) kills the engine
core, the replica and the shard actor and stops Redis under load, one fault at a time, and says
what each cost; serve_load_diagnosis.sh splits a chat's time under load
on a service serve_h200.py left running; shard_hop.py times the replica -> shard actor hop by
itself. Stage with `.venv/bin/python -m bench.serve.serve_h200 --prepare` here, then run
`python3 -m bench.serve.serve_h200 --out $OUT --parts ttft` on the GPU machine (docs/gpu.md);
`.venv/bin/python -m bench.serve.shard_hop` runs anywhere. Results go to bench/results/.
"""
