"""The HTTP ingress: the routes, who may call them, and which replica serves a user.

Runs in Serve's proxy and the ChatAPI ingress replicas (`routing: router`), which import neither
torch, vLLM nor redis-py (tests/test_layout.py): they start in a second and stay small. Redis is
reached through memory.directory and memory.key_store. With `routing: direct` the same routes
run inside each LLM replica (serve_app.direct_ingress).
"""
