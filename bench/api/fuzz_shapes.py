"""Deep and wide request shapes for the schema fuzz (bench/api/fuzz_api.py), and the read-back of
everything the fuzz stored (issue 36). What is sent and expected: docs/bench.md."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import requests

from serve_app.memory_protocol import MAX_METADATA_BYTES, MAX_METADATA_DEPTH
from serve_app.protocol import MAX_SCHEMA_DEPTH


class Deep:
    """A value nested `levels` arrays (or objects) deep, written out by `body_bytes`: Python's json
    module recurses per level and cannot write 1,000 of them."""

    def __init__(self, levels: int, in_objects: bool = False) -> None:
        self.levels, self.in_objects = levels, in_objects

    def text(self) -> str:
        opening, closing = ('{"k":', "}") if self.in_objects else ("[", "]")
        return opening * self.levels + '"leaf"' + closing * self.levels


def nested(levels: int, in_objects: bool = False) -> Any:
    """A value nested `levels` deep: a real one when json can write it, else a Deep."""
    if levels > 100:
        return Deep(levels, in_objects)
    value: Any = "leaf"
    for _ in range(levels):
        value = {"k": value} if in_objects else [value]
    return value


def body_bytes(body: Any) -> bytes:
    """`body` as JSON, its Deep values written out."""
    deep: list[Deep] = []

    def mark(value: Any) -> str:
        if not isinstance(value, Deep):
            raise TypeError(f"{type(value).__name__} is not JSON")
        deep.append(value)
        return f"@@deep{len(deep) - 1}@@"

    text = json.dumps(body, default=mark)
    for i, value in enumerate(deep):
        text = text.replace(f'"@@deep{i}@@"', value.text())
    return text.encode()


def metadata_shapes() -> list[tuple[str, dict[str, Any], bool]]:
    """(label, metadata, within the bounds)."""
    wide_keys = {f"key{i:04d}": i for i in range(300)}  # ~4 KB compact: at the byte bound
    while len(str(wide_keys).encode()) > MAX_METADATA_BYTES - 200:
        wide_keys.popitem()
    return [
        ("metadata depth at bound", {"a": nested(MAX_METADATA_DEPTH - 1)}, True),
        ("metadata objects at bound", nested(MAX_METADATA_DEPTH, in_objects=True), True),
        ("metadata depth bound + 1", {"a": nested(MAX_METADATA_DEPTH)}, False),
        ("metadata 33 levels", {"a": nested(33)}, False),
        ("metadata 200 levels", {"a": nested(200)}, False),
        ("metadata 300 objects", nested(300, in_objects=True), False),
        ("metadata 1000 levels", {"a": nested(1000)}, False),
        ("metadata wide keys", wide_keys, True),
        ("metadata long key", {"k" * 3000: 1}, True),
        ("metadata long array", {"a": list(range(800))}, True),
        ("metadata past bytes", {f"key{i:04d}": "v" * 20 for i in range(400)}, False),
        ("metadata of floats", {"x": 1e308, "y": -0.0, "z": [1.5, 2, True, None]}, True),
        ("metadata NaN", {"x": float("nan")}, False),  # Python's json reads NaN; no answer could carry it
        ("metadata Infinity", {"x": [float("inf")]}, False),
        ("metadata big integer", {"x": 10**300}, True),
    ]


@dataclass
class ShapeReport:
    sent: int = 0
    status_5xx: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)  # accepted when it should be refused, or the reverse


Case = tuple[str, str, str, "dict[str, Any] | None", "dict[str, Any] | None", "bool | None"]


def shape_cases(user: str) -> list[Case]:
    """(label, method, path, JSON body, query, accepted: True must be 200, False must be 4xx, None
    either) for `user` (the fact id is filled in when sent)."""
    cases: list[Case] = []
    message = [{"role": "user", "content": "I keep bees."}]
    for label, metadata, fits in metadata_shapes():
        cases.append((f"add {label}", "POST", "/v1/memories", {"user_id": user, "facts": [f"Fact with {label}."], "metadata": metadata}, None, fits))
        cases.append((f"mem0 add {label}", "POST", "/v3/memories/add/",
                      {"messages": message, "user_id": user, "infer": False, "metadata": metadata}, None, fits))
        cases.append((f"update {label}", "PUT", "/v1/memories/{fact_id}", {"metadata": metadata}, None, fits))
    for levels in (9, 33, 1000):
        tree = {"AND": [{"user_id": user}, {"OR": nested(levels)}]}
        cases.append((f"mem0 list filters {levels} levels", "POST", "/v3/memories/", {"filters": tree}, None, False))
        cases.append((f"mem0 search filters {levels} levels", "POST", "/v3/memories/search/", {"query": "bees", "filters": tree}, None, False))
        schema_depth = 2 + levels  # the schema and its properties, then `levels` objects (serve_app.protocol.json_depth)
        cases.append((f"chat schema {levels} levels", "POST", "/v1/chat/completions",
                      {"messages": message, "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {
                          "name": "deep", "schema": {"type": "object", "properties": {"a": nested(levels, in_objects=True)}}}}},
                      None, schema_depth <= MAX_SCHEMA_DEPTH))
    cases.append(("search threshold NaN", "POST", "/v1/memories/search", {"user_id": user, "query": "bees", "threshold": float("nan")}, None, False))
    cases.append(("chat 256 messages", "POST", "/v1/chat/completions", {"messages": message * 256, "max_tokens": 2}, None, None))  # the context decides
    cases.append(("chat 257 messages", "POST", "/v1/chat/completions", {"messages": message * 257, "max_tokens": 2}, None, False))
    cases.append(("list with repeated user_id", "GET", "/v1/memories", None, {"user_id": [user, user]}, False))
    cases.append(("list with an undeclared parameter", "GET", "/v1/memories", None, {"user_id": user, "delete_linked": "true"}, False))
    cases.append(("delete_all with an undeclared parameter", "DELETE", "/v1/memories", None, {"user_id": user, "confirm": "no"}, False))
    return cases


def patient(session: requests.Session, method: str, url: str, timeout_s: float, **kwargs: Any) -> requests.Response:
    """The answer to a request, sent again after each 429's Retry-After (at most 10 times), as a client that honours it."""
    for _ in range(10):
        answer = session.request(method, url, timeout=timeout_s, **kwargs)
        if answer.status_code != 429:
            break
        time.sleep(float(answer.headers.get("Retry-After", "1")))
    return answer


def run_shapes(base_url: str, auth_header: str, user: str, timeout_s: float = 300.0) -> ShapeReport:
    """Sends shape_cases (a 429 waited out as a client would: `patient`)."""
    session = requests.Session()
    session.headers["Authorization"] = auth_header
    added = session.post(f"{base_url}/v1/memories", json={"user_id": user, "facts": ["A fact the shape cases update."]}, timeout=timeout_s)
    added.raise_for_status()
    fact_id = added.json()["results"][0]["id"]
    report = ShapeReport()
    statuses: Counter[str] = Counter()
    for label, method, path, body, query, fits in shape_cases(user):
        data = None if body is None else body_bytes(body)
        headers = {"Content-Type": "application/json"} if data is not None else {}
        answer = patient(session, method, base_url + path.format(fact_id=fact_id), timeout_s, data=data, params=query, headers=headers)
        report.sent += 1
        statuses[str(answer.status_code)] += 1
        report.status_5xx += answer.status_code >= 500
        accepted = answer.status_code == 200
        if (fits is not None and accepted != fits) or answer.status_code >= 500:
            report.unexpected.append(f"{label}: {answer.status_code} {answer.text[:200]}")
    report.statuses = dict(sorted(statuses.items()))
    return report


@dataclass
class ReadBack:
    records: int = 0
    requests: int = 0
    status_5xx: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def read_back(base_url: str, auth_header: str, user: str, timeout_s: float = 300.0) -> ReadBack:
    """Every read route over every stored record of `user` (module docstring)."""
    session = requests.Session()
    session.headers["Authorization"] = auth_header
    report = ReadBack()
    statuses: Counter[str] = Counter()

    def ask(method: str, path: str, **kwargs: Any) -> requests.Response:
        answer = patient(session, method, base_url + path, timeout_s, **kwargs)
        report.requests += 1
        statuses[str(answer.status_code)] += 1
        if answer.status_code != 200:
            report.status_5xx += answer.status_code >= 500
            report.failures.append(f"{method} {path}: {answer.status_code} {answer.text[:200]}")
        return answer

    listed = ask("GET", "/v1/memories", params={"user_id": user})
    records = listed.json().get("results", []) if listed.status_code == 200 else []
    report.records = len(records)
    for record in records:
        ask("GET", f"/v1/memories/{record['id']}")
        ask("GET", f"/v1/memories/{record['id']}/history")
    for page_size in (1, 7, 1000):
        pages = max(1, -(-len(records) // page_size)) if page_size < 1000 else 1
        for page in range(1, min(pages, 50) + 1):
            ask("POST", "/v3/memories/", params={"page": page, "page_size": page_size}, json={"filters": {"user_id": user}})
    ask("POST", "/v1/memories/search", json={"user_id": user, "query": "fact", "limit": 200})
    ask("POST", "/v3/memories/search/", json={"query": "bees", "filters": {"user_id": user}, "top_k": 200})
    report.statuses = dict(sorted(statuses.items()))
    return report
