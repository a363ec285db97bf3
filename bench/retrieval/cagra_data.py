"""The data of bench/retrieval/cagra_index.py: the synthetic facts and queries, exact ground truth
and recall (cagra_index.py's docstring defines them)."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch


def normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def make_data(args: argparse.Namespace) -> dict[str, Any]:
    """Seeded Gaussian mixture (see bench/retrieval/cagra_index.py); generated on the CPU, deterministic."""
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
