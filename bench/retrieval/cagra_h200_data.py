"""Helpers of bench/retrieval/cagra_h200.py: the synthetic data, exact ground truth, recall, timing,
and the section recorder that writes the JSON (see bench/retrieval/cagra_h200.py for the definitions)."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    """Sections that record their error instead of aborting; JSON rewritten after each."""

    def __init__(self, out: Path, meta: dict) -> None:
        self.out = out
        self.data: dict[str, Any] = {"meta": meta, "sections": {}}

    @contextlib.contextmanager
    def section(self, name: str):
        rec: dict[str, Any] = self.data["sections"].setdefault(name, {})
        t0 = time.perf_counter()
        print(f"--- {name}", flush=True)
        try:
            yield rec
        except Exception as exc:  # record and go on
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["traceback"] = traceback.format_exc(limit=6)
            print(f"[{name}] FAILED: {rec['error']}", flush=True)
        rec["section_s"] = round(time.perf_counter() - t0, 3)
        self.write()

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.data, indent=2, default=str) + "\n")


def normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def make_data(args: argparse.Namespace) -> dict[str, Any]:
    """Seeded Gaussian mixture (see bench/retrieval/cagra_h200.py); generated on the CPU, deterministic."""
    g = torch.Generator().manual_seed(args.seed)
    d = args.dim
    centres = normalize(torch.randn(args.clusters, d, generator=g))

    def draw(cluster_ids: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(len(cluster_ids), d, generator=g) * (args.noise / d**0.5)
        return normalize(centres[cluster_ids] + noise)

    users = [f"user{u:03d}" for u in range(args.n_users)]
    topics = torch.stack([torch.randperm(args.clusters, generator=g)[: args.clusters_per_user] for _ in users])
    fact_cluster = torch.cat(
        [topics[u][torch.randint(args.clusters_per_user, (args.per_user,), generator=g)] for u in range(len(users))]
    )
    X = draw(fact_cluster)
    owner = np.repeat(np.arange(len(users)), args.per_user)
    fact_ids = [f"{users[u]}/f{i:05d}" for u, i in zip(owner.tolist(), np.tile(np.arange(args.per_user), len(users)).tolist())]
    # Unfiltered queries: any cluster. Filtered queries: a random user, one of its topics.
    Q = draw(torch.randint(args.clusters, (args.queries,), generator=g))
    q_user = torch.randint(len(users), (args.queries,), generator=g)
    q_topic = topics[q_user, torch.randint(args.clusters_per_user, (args.queries,), generator=g)]
    QU = draw(q_topic)
    # Rows for the extend section (new facts of random users, from their topics).
    ext_user = torch.randint(len(users), (args.extend_rows,), generator=g)
    XE = draw(topics[ext_user, torch.randint(args.clusters_per_user, (args.extend_rows,), generator=g)])
    return {
        "users": users,
        "X": X,
        "owner": owner,
        "fact_ids": fact_ids,
        "Q": Q,
        "QU": QU,
        "q_user": q_user.numpy(),
        "XE": XE,
        "ext_user": ext_user.numpy(),
        "draw": draw,
        "topics": topics,
    }


def exact_topk(Q: torch.Tensor, X: torch.Tensor, k: int, device: torch.device, chunk: int = 256) -> np.ndarray:
    """Row indices of the exact top-k inner products (torch on `device`)."""
    Xd = X.to(device)
    out = []
    for i in range(0, len(Q), chunk):
        s = Q[i : i + chunk].to(device) @ Xd.T
        out.append(torch.topk(s, min(k, X.shape[0]), dim=1).indices.cpu())
    return torch.cat(out).numpy()


def recall(approx: list[list[Any]], exact_ids: list[list[str]], k: int) -> float:
    vals = []
    for hits, ref in zip(approx, exact_ids):
        got = {h.fact_id for h in hits[:k]}
        vals.append(len(got & set(ref[:k])) / max(1, min(k, len(ref))))
    return float(np.mean(vals)) if vals else float("nan")


def pct(ts: list[float]) -> dict[str, float]:
    a = np.asarray(ts) * 1e3
    return {"p50_ms": round(float(np.percentile(a, 50)), 4), "p95_ms": round(float(np.percentile(a, 95)), 4), "n": len(ts)}


def timeit(fn, calls: list[tuple], warmup: int) -> dict[str, float]:
    for c in calls[:warmup]:
        fn(*c)
    ts = []
    for c in calls:
        t0 = time.perf_counter()
        fn(*c)
        ts.append(time.perf_counter() - t0)
    return pct(ts)


def print_table(sections: dict[str, dict]) -> None:
    print("\n| section | metric | value |\n|---|---|---|")
    for name, rec in sections.items():
        for key, val in rec.items():
            if key in ("traceback",):
                continue
            if isinstance(val, dict):
                val = ", ".join(f"{a}={b}" for a, b in val.items())
            print(f"| {name} | {key} | {val} |")
