"""The bench kit: what every benchmark shares. results.py (the card a run measured, percentiles,
result JSON that names its card, printed tables, progress bars, timing), service.py (the CPU
service started in this process as the tests start it, and `serve run` of a config in a process
of its own as the GPU runs start it), client.py (a streamed chat timed through HTTP, a user's
memory seeded) and stage.py (repository paths, the ignored staging folders and the GPU visit's
wheels, LoCoMo's path, a bench's parts each in a process of its own)."""
