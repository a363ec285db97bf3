"""The bench kit: what every benchmark shares. results.py (the card a run measured, percentiles,
result JSON that names its card, printed tables, progress bars), service.py (the CPU service
started in this process as the tests start it, and `serve run` of a config in a process of its
own as the GPU runs start it) and stage.py (repository paths, the ignored staging folders, LoCoMo's
path, running a bench's parts each in a process of its own)."""
