"""The Locust load test (loadtest/locustfile.py): its user class, request bodies and checks.

Importing the locustfile imports locust, which monkey-patches socket, ssl and threading with
gevent for the whole process; that would leak into the Ray and vLLM tests of the same pytest
session. So the module is imported in a subprocess, which reports what it built as JSON, and
the bodies are validated here against the service's own request model.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from serve_app.memory_protocol import AddMemoryRequest
from serve_app.protocol import ChatCompletionRequest

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = REPO / "loadtest/locustfile.py"
POOL_SIZE = 5
def _event(content: str | None, role: str | None = None) -> str:
    delta = {k: v for k, v in {"role": role, "content": content}.items() if v is not None}
    return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]})


GOOD_STREAM = [_event("", "assistant"), "", _event("Paris"), "", _event("."), "", "data: [DONE]"]
GOOD_STREAM_EVENTS = [line for line in GOOD_STREAM if line]
RESPONSES = {
    "good": (200, GOOD_STREAM),
    "empty": (200, [_event(None, "assistant"), _event("  "), "data: [DONE]"]),
    "no_done": (200, GOOD_STREAM[:-1]),
    "no_choices": (200, ['data: {"choices": []}', "data: [DONE]"]),
    "not_json": (200, ["data: <html>oops</html>", "data: [DONE]"]),
    "server_error": (500, GOOD_STREAM),
    "no_connection": (0, [""]),
}

# Runs in the subprocess: import the locustfile the way `locust -f` does (by path) and report.
PROBE = """
import importlib.util, json, sys
from locust import HttpUser
spec = importlib.util.spec_from_file_location("locustfile", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
responses = json.loads(sys.argv[2])
print(json.dumps({
    "is_http_user": issubclass(module.ChatUser, HttpUser),
    "tasks": sorted({t.__name__ for t in module.ChatUser.tasks}),
    "users": module.USERS,
    "bodies": [
        [user, question, module.chat_body(user, question)] for user in module.USERS for question in module.QUESTIONS
    ],
    "problems": {name: module.stream_problem(*response) for name, response in responses.items()},
    "facts": module.memory_facts(module.USERS[0], 12),
    "memory_mode": module.MEMORY_MODE,
}))
"""


def run_python(code: str, *args: str, users: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVMEM_LOADTEST_USERS": users}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    result = run_python(PROBE, str(LOCUSTFILE), json.dumps(RESPONSES), users=str(POOL_SIZE))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_user_class_is_an_http_user_that_chats_and_checks_health(probe: dict[str, Any]) -> None:
    assert probe["is_http_user"]
    assert probe["tasks"] == ["chat", "health"]


def test_user_ids_come_from_a_pool_sized_by_the_environment(probe: dict[str, Any]) -> None:
    assert len(probe["users"]) == len(set(probe["users"])) == POOL_SIZE


def test_request_bodies_are_valid_chat_completion_requests(probe: dict[str, Any]) -> None:
    assert probe["bodies"]
    for user, question, body in probe["bodies"]:
        request = ChatCompletionRequest.model_validate(body)
        assert request.user == user
        assert [(m.role, m.content) for m in request.messages] == [("user", question)]
        assert request.max_tokens and request.stream  # streamed: Locust reports time to first token
        assert request.memory.mode == probe["memory_mode"] == "kv"


def test_each_user_is_seeded_with_distinct_facts(probe: dict[str, Any]) -> None:
    facts = probe["facts"]
    assert len(facts) == len(set(facts)) == 12  # distinct: re-adding the same list adds nothing new
    AddMemoryRequest(user_id=probe["users"][0], facts=facts)


def test_only_a_200_stream_with_content_and_done_counts_as_success(probe: dict[str, Any]) -> None:
    problems = probe["problems"]
    assert problems.pop("good") is None
    assert all(problems.values()), problems


def test_an_empty_user_pool_is_refused() -> None:
    result = run_python(f"import runpy; runpy.run_path({str(LOCUSTFILE)!r})", users="0")
    assert result.returncode != 0
    assert "at least one user" in result.stderr


def test_locust_itself_finds_the_user_class() -> None:
    listing = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--list"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listing.returncode == 0, listing.stderr
    assert "ChatUser" in listing.stdout


def test_headless_run_sends_what_the_environment_asks(tmp_path: Path) -> None:
    """`locust --headless` against a loopback server that records every request: the key, the
    session header (the user: routing: direct sends it straight to the user's replica), top_k,
    max_tokens and mode from KVMEM_LOADTEST_*, no seeding with FACTS=0, and a closed loop with
    WAIT_S=0 (many chats per client in a few seconds). The server is a recorder, not the service:
    what is checked is what Locust sends."""
    import http.server
    import threading

    seen: list[tuple[str, dict[str, str], dict[str, Any] | None]] = []
    finishing = json.loads(GOOD_STREAM_EVENTS[-2][len("data: "):]) | {"timings": {"prepare": 0.5, "replica_ttft": 3.25}}
    events = [*GOOD_STREAM_EVENTS[:-2], "data: " + json.dumps(finishing), GOOD_STREAM_EVENTS[-1]]
    stream = "\n\n".join(events).encode() + b"\n\n"

    class Recorder(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            length = int(self.headers.get("content-length", 0))
            seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, json.loads(self.rfile.read(length) or b"null")))
            if self.path == "/v1/chat/completions":
                self._answer(stream, "text/event-stream")
            else:
                self._answer(b'{"results": []}', "application/json")

        def do_GET(self) -> None:  # noqa: N802
            seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, None))
            self._answer(b'{"status": "ok"}', "application/json")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {**os.environ, "KVMEM_LOADTEST_USERS": "3", "KVMEM_LOADTEST_FACTS": "0", "KVMEM_LOADTEST_MEMORY_MODE": "prompt",
           "KVMEM_LOADTEST_TOP_K": "7", "KVMEM_LOADTEST_MAX_TOKENS": "5", "KVMEM_LOADTEST_WAIT_S": "0",
           "KVMEM_LOADTEST_API_KEY": "kvm-locust-test"}
    try:
        run = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "2", "-r", "2", "-t", "4s",
             "--host", f"http://127.0.0.1:{server.server_address[1]}", "--only-summary", "--csv", str(tmp_path / "run")],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )
    finally:
        server.shutdown()
    assert run.returncode == 0, run.stderr[-2000:]
    chats = [(headers, body) for path, headers, body in seen if path == "/v1/chat/completions"]
    assert len(chats) >= 20, len(chats)  # closed loop: no think time between chats
    assert not [path for path, _, _ in seen if path.startswith("/v1/memories")]  # FACTS=0: no seeding
    for headers, body in chats:
        assert headers["authorization"] == "Bearer kvm-locust-test"
        assert headers["x-session-id"] == body["user"]
        assert body["memory"] == {"mode": "prompt", "top_k": 7} and body["max_tokens"] == 5
    # the replica's stage timings from the finishing chunk are statistics of their own, and so is the rest of TTFT
    stages = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(tmp_path / "run_stages.csv"))}
    assert float(stages[("SERVER", "replica_ttft")]["Median Response Time"]) == 3.25
    assert float(stages[("SERVER", "prepare")]["Median Response Time"]) == 0.5
    assert int(stages[("SERVER", "outside_replica")]["Request Count"]) == int(stages[("TTFT", "chat")]["Request Count"]) >= 20
    assert "SERVER replica_ttft" in run.stdout  # printed at the end too
    # ... so Locust's own rows, and its Aggregated row, count requests only: one row per route
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(tmp_path / "run_stats.csv"))}
    assert set(rows) <= {("POST", "chat"), ("GET", "health"), ("", "Aggregated")}, set(rows)
    count = {key: int(row["Request Count"]) for key, row in rows.items()}
    assert count[("", "Aggregated")] == count[("POST", "chat")] + count.get(("GET", "health"), 0)


def test_the_varied_question_set_asks_400_different_questions() -> None:
    from loadtest.users import varied_questions

    questions = varied_questions()
    assert len(questions) == len(set(questions)) == 400
    probe = "import importlib.util, sys\nspec = importlib.util.spec_from_file_location('locustfile', sys.argv[1])\n" \
            "module = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(module)\nprint(len(module.ASKED))"
    for setting, asked in (("varied", 400), ("", 8)):
        env = {**os.environ, "KVMEM_LOADTEST_QUESTIONS": setting}
        done = subprocess.run([sys.executable, "-c", probe, str(REPO / "loadtest" / "locustfile.py")], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert int(done.stdout.strip().splitlines()[-1]) == asked
