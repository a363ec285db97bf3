"""Does memory answer well? LoCoMo question answering through the RUNNING service's HTTP API, in
memory modes kv / prompt / none. Usage and scoring: docs/bench.md."""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.kit.client import stream_once
from bench.kit.results import RESULTS, percentiles, progress, write_result
from bench.kit.stage import DEFAULT_LOCOMO
from bench.quality.locomo_scoring import CATEGORIES, category_means, evidence_ids, evidence_recall, score_answer, starts_like_list

MODES = ("kv", "prompt", "none", "full")
HEADLINE = {"k": 10, "window": 5}
RUN_KEY = ("k", "window", "neighbours", "embedder", "model", "conversations", "run_tag", "extract", "max_turns", "max_questions", "max_tokens")


@dataclass
class Conversation:
    """One LoCoMo conversation as one memory user."""

    sample_id: str
    user_id: str
    turns: list[Any]  # memory.fact_store.Turn
    facts_by_turn: dict[str, list[str]]
    questions: list[dict[str, Any]]
    facts_without_turn: int = 0
    fact_turns: dict[str, set[str]] = field(default_factory=dict)  # fact id -> source dia_ids


class Service:
    """The service's HTTP API; every call is bounded by the client's timeouts."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float, connections: int) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.client = httpx.Client(
            base_url=url.rstrip("/"), headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits
        )

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.client.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise RuntimeError(f"{method} {path}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json()

    def chat_stream(self, body: dict[str, Any]) -> tuple[str, float | None, dict[str, Any] | None]:
        """(answer, seconds to the first content chunk or None, the memory report)."""
        sample = stream_once(self.client, "/v1/chat/completions", body, raise_on_error=True)
        return sample["content"], None if sample["content_ms"] is None else sample["content_ms"] / 1e3, sample["memory"]


def load_conversations(path: Path, indices: list[int] | None, run_tag: str, max_turns: int | None,
                       max_questions: int | None) -> list[Conversation]:
    """The chosen conversations: turns, facts grouped by source turn, questions to ask."""
    from bench.ingest.ingest_locomo import conversation_turns, observation_facts  # imports the memory domain

    data = json.loads(path.read_text())
    conversations = []
    for index in indices if indices is not None else range(len(data)):
        sample = data[index]
        every = conversation_turns(sample)
        turns = every[:max_turns]
        ids, all_ids = {t.turn_id for t in turns}, {t.turn_id for t in every}
        by_turn: dict[str, list[str]] = {}
        orphans = 0
        for fact in observation_facts(sample):
            if fact.source_id in ids:
                by_turn.setdefault(fact.source_id, []).append(fact.text)
            elif fact.source_id not in all_ids:
                orphans += 1  # a source naming no turn: it cannot be sent with its turn (none in locomo8)
        questions = []
        for qa in sample["qa"]:
            if qa["category"] not in CATEGORIES:
                continue
            evidence = evidence_ids(qa.get("evidence", []))
            if max_turns is not None and not (evidence and set(evidence) <= ids):
                continue  # its evidence was not ingested
            questions.append({"conversation": sample["sample_id"], "question": qa["question"], "answer": qa.get("answer"), "category": qa["category"],
                              "evidence": evidence})
        conversations.append(Conversation(sample["sample_id"], f"locomo-{run_tag}-{sample['sample_id']}", turns,
                                          by_turn, questions[:max_questions], orphans))
    return conversations


def ingest(service: Service, conversations: list[Conversation], extract: bool) -> dict[str, Any]:
    """One add per turn, in order, each answered once durable (not waiting for its KV); returns
    counts and add latencies."""
    latencies: list[float] = []
    with_facts: list[float] = []  # adds that carried (or extracted) at least one fact
    facts = 0
    started = time.perf_counter()
    with progress(total=sum(len(c.turns) for c in conversations), desc="ingest", unit="turn") as bar:
        for conv in conversations:
            existing = service.call("GET", "/v1/memories", params={"user_id": conv.user_id})["results"]
            if existing:
                raise SystemExit(f"{conv.user_id} already holds {len(existing)} facts: choose another --run-tag")
            for turn in conv.turns:
                sent: list[str] = []
                if extract:
                    when = f"[{turn.session_time}] " if turn.session_time else ""
                    body: dict[str, Any] = {"user_id": conv.user_id,
                                            "messages": [{"role": "user", "content": f"{when}{turn.speaker}: {turn.text}"}]}
                else:
                    sent = conv.facts_by_turn.get(turn.turn_id, [])
                    body = {"user_id": conv.user_id, "turns": [{"turn_id": turn.turn_id, "speaker": turn.speaker,
                                                                "text": turn.text, "session_time": turn.session_time}]}
                    if sent:
                        body |= {"facts": sent, "source_id": turn.turn_id}
                body["wait_for_kv"] = False
                t0 = time.perf_counter()
                results = service.call("POST", "/v1/memories", json=body)["results"]
                latencies.append(time.perf_counter() - t0)
                if results:
                    with_facts.append(latencies[-1])
                if not extract and len(results) != len(sent):
                    raise RuntimeError(f"{conv.user_id} {turn.turn_id}: {len(sent)} facts sent, {len(results)} results")
                for result in results:
                    conv.fact_turns.setdefault(result["id"], set()).add(turn.turn_id)
                facts += len(results)
                bar.update(1)
    return {"adds": len(latencies), "facts": facts, "seconds": round(time.perf_counter() - started, 1),
            "facts_without_turn": sum(c.facts_without_turn for c in conversations),
            "add_latency_ms": percentiles(latencies, scale=1e3, digits=1),
            "adds_with_facts": len(with_facts),
            "add_with_facts_latency_ms": percentiles(with_facts, (50, 90), scale=1e3, digits=1)}


def wait_for_encodes(service: Service, timeout_s: float, poll_s: float = 2.0, report_s: float = 10.0) -> dict[str, Any]:
    """Poll GET /v1/shards every `poll_s` until no shard has pending encodes (saying how many are
    left every `report_s`); the seconds that took and the shards' totals then."""
    started = last_report = time.monotonic()
    while True:
        shards = service.call("GET", "/v1/shards")["results"]
        pending = sum(s.get("pending_encodes", 0) for s in shards)
        if pending == 0:
            break
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{pending} encodes still pending after {timeout_s:.0f} s")
        if time.monotonic() - last_report >= report_s:
            print(f"  waiting for {pending} encodes ...", file=sys.stderr)
            last_report = time.monotonic()
        time.sleep(poll_s)
    totals = {f"shard_{key}": sum(s.get(key, 0) for s in shards) for key in ("facts", "facts_with_kv", "encode_failed")}
    return {"encode_wait_s": round(time.monotonic() - started, 2), "shards": len(shards), **totals}


def ask_all(service: Service, conversations: list[Conversation], mode: str, k: int, max_tokens: int,
            concurrency: int, prefill_top_m: int | None = None) -> list[dict[str, Any]]:
    """Every question of every conversation in one memory mode; one record per question, in order.
    prefill_top_m: mode kv with the cross-fact repair (the m most relevant facts prefilled)."""
    jobs = [(conv, q) for conv in conversations for q in conv.questions]
    memory_options: dict[str, Any] = {"mode": mode, "top_k": k}
    if prefill_top_m is not None:
        memory_options["prefill_top_m"] = prefill_top_m

    def one(conv: Conversation, q: dict[str, Any]) -> dict[str, Any]:
        body = {"user": conv.user_id, "messages": [{"role": "user", "content": q["question"]}],
                "max_tokens": max_tokens, "temperature": 0.0, "memory": memory_options}
        try:
            answer, ttft, memory = service.chat_stream(body)
        except Exception as exc:  # scored as an empty answer, counted as an error
            return {"answer": "", "ttft_s": None, "fact_ids": [], "recall": None, "error": str(exc)[:300]}
        fact_ids = list((memory or {}).get("fact_ids", []))
        turns = {dia for fact_id in fact_ids for dia in conv.fact_turns.get(fact_id, ())}
        recall = evidence_recall(q["evidence"], turns) if mode != "none" else None
        return {"answer": answer, "ttft_s": ttft, "fact_ids": fact_ids, "recall": recall, "error": None}

    out: list[dict[str, Any] | None] = [None] * len(jobs)
    label = mode if prefill_top_m is None else f"{mode}+m{prefill_top_m}"
    with ThreadPoolExecutor(max_workers=concurrency) as pool, progress(total=len(jobs), desc=f"ask {label} k={k}", unit="q") as bar:
        futures = {pool.submit(one, conv, q): i for i, (conv, q) in enumerate(jobs)}
        for future in as_completed(futures):
            out[futures[future]] = future.result()
            bar.update(1)
    return [r for r in out if r is not None]


def summarize(questions: list[dict[str, Any]], answers: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode and category: F1, identical kv/prompt answers, list-shaped answers, recall, TTFT."""
    cats = [q["category"] for q in questions]
    out: dict[str, Any] = {"questions": {key: (len(cats) if key == "overall" else cats.count(int(key)))
                                         for key in category_means([])}}
    out["f1"] = {m: category_means((q["category"], score_answer(a["answer"], q["answer"], q["category"]))
                                   for q, a in zip(questions, rows)) for m, rows in answers.items()}
    if "kv" in answers and "prompt" in answers:
        out["identical_kv_prompt"] = category_means(
            (c, None if a["error"] or b["error"] else float(a["answer"].strip() == b["answer"].strip()))
            for c, a, b in zip(cats, answers["kv"], answers["prompt"]))
    out["list_item_share"] = {m: category_means((c, float(starts_like_list(a["answer"]))) for c, a in zip(cats, rows))
                              for m, rows in answers.items()}
    out["evidence_recall"] = {m: category_means((c, a["recall"]) for c, a in zip(cats, rows))
                              for m, rows in answers.items() if m not in ("none", "full")}  # full: no retrieval
    out["ttft_ms"] = {}
    for m, rows in answers.items():
        out["ttft_ms"][m] = percentiles([a["ttft_s"] for a in rows if a["ttft_s"] is not None], (50, 90), 1e3, 1, n=True)
    out["errors"] = {m: sum(1 for a in rows if a["error"]) for m, rows in answers.items()}
    return out


def merge_run(doc: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Add a run to a results document: a run with the same settings key is replaced; the top
    level repeats the latest run at k=10, w=5 if any, else the latest run."""
    key = {name: run["settings"].get(name) for name in RUN_KEY}
    runs = [r for r in doc.get("runs", []) if {name: r["settings"].get(name) for name in RUN_KEY} != key] + [run]
    headline = [r for r in runs if all(r["settings"].get(n) == v for n, v in HEADLINE.items())] or runs
    return {**headline[-1], "runs": runs}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_report(run: dict[str, Any]) -> None:
    from tabulate import tabulate

    modes = list(run["f1"])
    rows = []
    for key in ["1", "2", "3", "4", "5", "overall"]:
        label = f"{key} {CATEGORIES[int(key)]}" if key != "overall" else "overall"
        row = [label, run["questions"][key]] + [_fmt(run["f1"][m][key]) for m in modes]
        row.append(_fmt(run.get("identical_kv_prompt", {}).get(key)))
        row += [_fmt(run["list_item_share"][m][key]) for m in modes]
        row += [_fmt(run["evidence_recall"][m][key]) for m in run["evidence_recall"]]
        rows.append(row)
    head = ["category", "n"] + [f"F1 {m}" for m in modes] + ["kv==prompt"] + [f"list {m}" for m in modes]
    head += [f"recall@{run['settings']['k']} {m}" for m in run["evidence_recall"]]
    print(tabulate(rows, headers=head, tablefmt="github"))
    ttft = [[m, t["p50"], t["p90"], t["n"], run["errors"][m]] for m, t in run["ttft_ms"].items()]
    print(tabulate(ttft, headers=["mode", "TTFT p50 ms", "TTFT p90 ms", "n", "errors"], tablefmt="github"))


def plot(run: dict[str, Any], path: Path) -> None:
    """Grouped bars: F1 per category (and overall) per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install .[bench]): no plot", file=sys.stderr)
        return
    keys = ["1", "2", "3", "4", "5", "overall"]
    modes = list(run["f1"])
    width = 0.8 / max(len(modes), 1)
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, mode in enumerate(modes):
        values = [run["f1"][mode][key] or 0.0 for key in keys]
        ax.bar([x + (i - (len(modes) - 1) / 2) * width for x in range(len(keys))], values, width, label=mode)
    ax.set_xticks(range(len(keys)), [f"{k}\n{CATEGORIES[int(k)]}" if k != "overall" else k for k in keys])
    s = run["settings"]
    ax.set_ylabel("LoCoMo F1")
    ax.set_title(f"LoCoMo QA: {s['model']}, k={s['k']}, w={s['window']}, {len(s['conversations'])} conversations")
    ax.legend(title="memory")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://localhost:8000", help="the service's base URL")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer (an admin key: GET /v1/shards)")
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO, required=DEFAULT_LOCOMO is None, help="LoCoMo JSON (locomo10.json of snap-research/locomo, or a subset such as locomo8.json); default: $KVMEM_LOCOMO")
    parser.add_argument("--conversations", type=int, nargs="+", default=None, help="indices (default: all)")
    parser.add_argument("--max-turns", type=int, default=None, help="first N turns of each conversation only")
    parser.add_argument("--max-questions", type=int, default=None, help="first N questions per conversation")
    parser.add_argument("--extract", action="store_true", help="send turns as messages; the service extracts facts")
    parser.add_argument("--run-tag", default=time.strftime("%Y%m%d-%H%M%S"), help="part of the user ids")
    parser.add_argument("--k", type=int, nargs="+", default=[10], help="top_k; several values: one run each")
    parser.add_argument("--window", type=int, required=True, help="the service's memory.window_turns (recorded)")
    parser.add_argument("--neighbours", type=int, default=None, help="the service's memory.encode_neighbours (recorded)")
    parser.add_argument("--embedder", default=None, help="the service's memory.embedding_model (recorded; None: the default MiniLM)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES[:3]))
    parser.add_argument("--repair-m", type=int, nargs="*", default=[],
                        help="also ask in mode kv with memory.prefill_top_m = m, one run per m (reported as kv+m<m>)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per HTTP read")
    parser.add_argument("--encode-timeout", type=float, default=3600.0, help="seconds to wait for pending encodes")
    parser.add_argument("--out", type=Path, default=RESULTS / "locomo_qa.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "locomo_qa.png")
    parser.add_argument("--answers", type=Path, default=None, help="also write every answer as JSON lines here")
    parser.add_argument("--fresh", action="store_true", help="start --out anew instead of appending the run")
    parser.add_argument("--cleanup", action="store_true", help="delete the run's users' memories at the end")
    args = parser.parse_args()

    service = Service(args.url, args.api_key, args.timeout, args.concurrency + 2)
    service.call("GET", "/health")
    model = service.call("GET", "/v1/models")["data"][0]["id"]
    conversations = load_conversations(args.locomo, args.conversations, args.run_tag, args.max_turns, args.max_questions)
    ingest_stats = ingest(service, conversations, args.extract)
    ingest_stats |= wait_for_encodes(service, args.encode_timeout)
    print(f"ingest: {ingest_stats}")
    questions = [q for conv in conversations for q in conv.questions]
    doc = {} if args.fresh or not args.out.exists() else json.loads(args.out.read_text())
    for k in args.k:
        modes = [m for m in args.modes if m != "full" or k == args.k[0]]  # `full` ignores top_k: asked once
        answers = {mode: ask_all(service, conversations, mode, k, args.max_tokens, args.concurrency) for mode in modes}
        for m in args.repair_m:
            answers[f"kv+m{m}"] = ask_all(service, conversations, "kv", k, args.max_tokens, args.concurrency, prefill_top_m=m)
        settings = {"k": k, "window": args.window, "neighbours": args.neighbours, "embedder": args.embedder, "model": model, "conversations": [c.sample_id for c in conversations],
                    "run_tag": args.run_tag, "extract": args.extract, "max_turns": args.max_turns,
                    "max_questions": args.max_questions, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                    "repair_m": args.repair_m,
                    "url": args.url, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        run = {"settings": settings, **summarize(questions, answers), "ingest": ingest_stats}
        print(f"\nLoCoMo QA, {model}, k={k}, w={args.window}, {len(questions)} questions")
        print_report(run)
        doc = merge_run(doc, run)
        if args.answers:
            with args.answers.open("a") as fh:
                for i, q in enumerate(questions):
                    fh.write(json.dumps({"k": k, "run_tag": args.run_tag, **q,
                                         **{m: answers[m][i] for m in answers}}) + "\n")
        doc = write_result(args.out, doc)  # after each k: a run cut short keeps what it has
    plot(doc, args.plot)
    if args.cleanup:
        for conv in conversations:
            service.call("DELETE", "/v1/memories", params={"user_id": conv.user_id})


if __name__ == "__main__":
    main()
