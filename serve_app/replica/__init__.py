"""The LLM replica: one vLLM engine with the KV-memory connector and its memory shard, per GPU.

Everything that runs in the replica's process lives here: the chat path (server.py), the engine's
construction and in-place restart (engine.py, lifecycle.py), sampling and response shaping, fact
encodes, extraction and reconciliation on the served model, and the shard watchdog. With
connector/, this is the only package that imports vLLM (tests/test_layout.py). Its modules import
vLLM inside the functions that run in the replica: `serve run`'s driver imports the deployment
classes (serve_app.app) to build the application, and should not pay vLLM's import (seconds and
most of a GB: docs/measured.md) for that.
"""
