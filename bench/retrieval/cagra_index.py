"""CAGRA (cuVS) vector index on a GPU: build, recall@k against exact search, latency, extend and
delete, over 100k synthetic facts of 50 users. Data, sections and usage: docs/bench.md."""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import memory.index as vi
from bench.kit.results import RESULTS, Sections
from bench.kit.results import timed as timeit
from bench.retrieval.cagra_data import exact_topk, make_data, recall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / "cagra_h200.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n-users", type=int, default=50)
    ap.add_argument("--per-user", type=int, default=2000)
    ap.add_argument("--clusters", type=int, default=4000)
    ap.add_argument("--clusters-per-user", type=int, default=100)
    ap.add_argument("--noise", type=float, default=1.0)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--k", type=int, default=50)
    ap.add_argument("--itopk", default="64,128,256,512", help="itopk_size values for the recall sweep")
    ap.add_argument("--default-itopk", type=int, default=128)
    ap.add_argument("--exact-user-max", type=int, default=20_000)
    ap.add_argument("--extend-rows", type=int, default=1000)
    ap.add_argument("--delete-rows", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    device = torch.device(args.device if (args.device != "cuda" or torch.cuda.is_available()) else "cpu")
    meta: dict[str, Any] = {
        "command": " ".join(["python3 -m bench.retrieval.cagra_index"] + sys.argv[1:]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        import cuvs

        meta["cuvs"] = getattr(cuvs, "__version__", "?")
    except Exception as exc:
        meta["cuvs"] = f"not importable: {type(exc).__name__}: {exc}"
    rec = Sections(args.out, meta)
    k = args.k
    itopks = [int(x) for x in args.itopk.split(",") if x]
    S: dict[str, Any] = {}  # shared state between sections

    with rec.section("data") as r:
        t0 = time.perf_counter()
        D = make_data(args)
        r["generate_s"] = round(time.perf_counter() - t0, 3)
        r["rows"], r["dim"], r["users"] = int(D["X"].shape[0]), args.dim, len(D["users"])
        r["description"] = (
            f"Gaussian mixture on the unit sphere: {args.clusters} centres, noise {args.noise}/sqrt(d), "
            f"{args.clusters_per_user} topic clusters per user, {args.per_user} facts per user, seed {args.seed}"
        )
        X, ids, owner = D["X"], D["fact_ids"], D["owner"]
        same = (X[:2000] @ X[:2000].T).fill_diagonal_(0)
        r["mean_cosine_first_2000"] = round(float(same.sum() / (2000 * 1999)), 4)
        # Ground truth: exact top-k, unfiltered and per user.
        t0 = time.perf_counter()
        gt_all = exact_topk(D["Q"], X, k, device)
        S["gt_all"] = [[ids[j] for j in row] for row in gt_all.tolist()]
        gt_user = []
        for qi in range(len(D["QU"])):
            u = int(D["q_user"][qi])
            rows = np.flatnonzero(owner == u)
            top = exact_topk(D["QU"][qi : qi + 1], X[rows], k, device)[0]
            gt_user.append([ids[rows[j]] for j in top.tolist()])
        S["gt_user"] = gt_user
        r["ground_truth_s"] = round(time.perf_counter() - t0, 3)

    with rec.section("exact_baseline") as r:
        ex = vi.ExactIndex(args.dim, device)
        t0 = time.perf_counter()
        ex.add(ids, [D["users"][u] for u in owner.tolist()], X)
        r["add_s"] = round(time.perf_counter() - t0, 3)
        users_q = [D["users"][int(u)] for u in D["q_user"]]
        hits = [ex.search(users_q[i], D["QU"][i], k)[0] for i in range(len(users_q))]
        r[f"recall@{k}_user_filtered"] = recall(hits, S["gt_user"], k)  # sanity: 1.0
        calls = [(users_q[i], D["QU"][i].numpy(), k) for i in range(len(users_q))]
        r["single_query_per_user"] = timeit(ex.search, calls, warmup=50)
        b = args.batch
        bcalls = [(D["users"][j % len(D["users"])], D["QU"][(j * b) % len(D["QU"]) :][:b].numpy(), k) for j in range(100)]
        r[f"batch{b}_per_user"] = timeit(ex.search, bcalls, warmup=5)
        del ex

    with rec.section("build") as r:
        idx = vi.CagraIndex(
            args.dim,
            device,
            cagra_min_vectors=10_000,
            exact_user_max_vectors=args.exact_user_max,
            itopk_size=args.default_itopk,
            extend_min_vectors=10**9,  # the extend section flushes explicitly
        )
        S["idx"] = idx
        t0 = time.perf_counter()
        idx.add(ids, [D["users"][u] for u in owner.tolist()], X)
        r["add_total_s"] = round(time.perf_counter() - t0, 3)
        r["graph_build_s"] = round(idx.stats["last_build_s"], 3)
        r["has_graph"], r["graph_rows"] = idx.has_graph, idx.graph_rows
        r["last_error"] = idx.last_error
        r["params"] = {"graph_degree": idx.graph_degree, "intermediate_graph_degree": idx.intermediate_graph_degree, "build_algo": idx.build_algo, "metric": "sqeuclidean on unit vectors"}
        if not idx.has_graph:
            raise RuntimeError(f"no CAGRA graph: {idx.last_error}")

    users_q = [D["users"][int(u)] for u in D["q_user"]]
    with rec.section("recall") as r:
        idx = S["idx"]
        for it in itopks:
            idx.set_itopk_size(it)
            hits = idx.search_all(D["Q"], k)
            r[f"itopk{it}_unfiltered_recall@{k}"] = round(recall(hits, S["gt_all"], k), 4)
        for it in itopks:
            idx.set_itopk_size(it)
            hits = []
            for u in sorted(set(users_q)):
                sel = [i for i, x in enumerate(users_q) if x == u]
                out = idx.search(u, D["QU"][sel], k, route="cagra")
                hits.extend(zip(sel, out))
            hits = [h for _, h in sorted(hits, key=lambda t: t[0])]
            r[f"itopk{it}_user_filtered_recall@{k}"] = round(recall(hits, S["gt_user"], k), 4)
        idx.set_itopk_size(args.default_itopk)
        hits = [idx.search(users_q[i], D["QU"][i], k)[0] for i in range(len(users_q))]
        r[f"routed_user_filtered_recall@{k}"] = round(recall(hits, S["gt_user"], k), 4)
        r["routed_path_for_2000_fact_user"] = idx.route(users_q[0], k)
        # Isolation check on the graph path: every hit belongs to the asking user.
        r["foreign_hits_on_graph_path"] = int(
            sum(idx.user_of(h.fact_id) != users_q[i] for i in range(len(users_q)) for h in idx.search(users_q[i], D["QU"][i], k, route="cagra")[0])
        )

    with rec.section("latency") as r:
        idx = S["idx"]
        idx.set_itopk_size(args.default_itopk)
        r["k"], r["itopk"] = k, args.default_itopk
        Q, QU = D["Q"], D["QU"]
        Qd = Q.to(device)
        one_all = [(Q[i].numpy(), k) for i in range(len(Q))]
        one_user = [(users_q[i], QU[i].numpy(), k) for i in range(len(QU))]
        r["single_cagra_unfiltered"] = timeit(lambda q, kk: idx.search_all(q, kk), one_all, 50)
        r["single_cagra_user_filtered"] = timeit(lambda u, q, kk: idx.search(u, q, kk, route="cagra"), one_user, 50)
        r["single_exact_per_user_routed"] = timeit(lambda u, q, kk: idx.search(u, q, kk), one_user, 50)
        r["single_exact_all_rows"] = timeit(lambda q, kk: idx.search_all(q, kk, route="exact"), one_all, 50)
        r["single_raw_cagra_search_unfiltered"] = timeit(lambda i: idx.raw_search(Qd[i : i + 1], k), [(i,) for i in range(len(Q))], 50)
        b = args.batch
        nb = max(1, len(Q) // b)
        ball = [(Q[j * b : (j + 1) * b].numpy(), k) for j in range(nb)] * max(1, 100 // nb)
        buser = []
        for j in range(100):
            u = D["users"][j % len(D["users"])]
            buser.append((u, D["draw"](D["topics"][j % len(D["users"]), torch.randint(args.clusters_per_user, (b,))]).numpy(), k))
        r[f"batch{b}_cagra_unfiltered"] = timeit(lambda q, kk: idx.search_all(q, kk), ball, 5)
        r[f"batch{b}_cagra_user_filtered"] = timeit(lambda u, q, kk: idx.search(u, q, kk, route="cagra"), buser, 5)
        r[f"batch{b}_exact_per_user_routed"] = timeit(lambda u, q, kk: idx.search(u, q, kk), buser, 5)
        r[f"batch{b}_raw_cagra_search_unfiltered"] = timeit(lambda j: idx.raw_search(Qd[j * b : (j + 1) * b], k), [(j % nb,) for j in range(100)], 5)

    with rec.section("extend") as r:
        idx = S["idx"]
        XE = D["XE"]
        ext_ids = [f"{D['users'][int(u)]}/new{i:05d}" for i, u in enumerate(D["ext_user"].tolist())]
        ext_users = [D["users"][int(u)] for u in D["ext_user"].tolist()]
        S["ext_ids"], S["ext_users"] = ext_ids, ext_users
        t0 = time.perf_counter()
        idx.add(ext_ids, ext_users, XE)
        r["add_pending_s"] = round(time.perf_counter() - t0, 4)
        r["pending_before_flush"] = idx.pending_rows
        # Pending rows are already searchable (exact side path).
        top1 = idx.search_all(XE[:100], 1)
        r["self_top1_while_pending"] = float(np.mean([h[0].fact_id == ext_ids[i] for i, h in enumerate(top1)]))
        t0 = time.perf_counter()
        idx.flush()
        r["extend_s"] = round(time.perf_counter() - t0, 4)
        r["extends"], r["graph_rows"], r["pending_after"] = idx.stats["extends"], idx.graph_rows, idx.pending_rows
        r["last_error"] = idx.last_error
        top1 = idx.search_all(XE, 1)
        r["self_top1_unfiltered"] = float(np.mean([h[0].fact_id == ext_ids[i] for i, h in enumerate(top1)]))
        top1u = [idx.search(ext_users[i], XE[i], 1, route="cagra")[0] for i in range(len(ext_ids))]
        r["self_top1_user_filtered"] = float(np.mean([h and h[0].fact_id == ext_ids[i] for i, h in enumerate(top1u)]))
        allX = torch.cat([D["X"], XE])
        all_ids = D["fact_ids"] + ext_ids
        gt = exact_topk(D["Q"], allX, k, device)
        S["all_ids"], S["allX"] = all_ids, allX
        r[f"unfiltered_recall@{k}_after_extend"] = round(recall(idx.search_all(D["Q"], k), [[all_ids[j] for j in row] for row in gt.tolist()], k), 4)

    with rec.section("delete") as r:
        idx = S["idx"]
        rng = np.random.default_rng(args.seed)
        n_half = args.delete_rows // 2
        ext_ids = S.get("ext_ids", [])
        old_pick = rng.choice(len(D["fact_ids"]), args.delete_rows - min(n_half, len(ext_ids)), replace=False)
        victims = [D["fact_ids"][i] for i in old_pick.tolist()] + list(ext_ids[:n_half])
        victim_vecs = torch.cat([D["X"][torch.as_tensor(old_pick)], D["XE"][:n_half][: len(victims) - len(old_pick)]])
        victim_users = [idx.user_of(v) for v in victims]
        t0 = time.perf_counter()
        removed = idx.remove(victims)
        r["remove_s"], r["removed"], r["tombstones"] = round(time.perf_counter() - t0, 4), removed, idx.tombstones
        dead = set(victims)
        leaks_all = sum(h.fact_id in dead for hs in idx.search_all(victim_vecs, k) for h in hs)
        leaks_graph = sum(
            h.fact_id in dead for i in range(len(victims)) for h in idx.search(victim_users[i], victim_vecs[i], k, route="cagra")[0]
        )
        leaks_exact = sum(h.fact_id in dead for i in range(len(victims)) for h in idx.search(victim_users[i], victim_vecs[i], k, route="exact")[0])
        r["deleted_ids_returned"] = {"unfiltered": int(leaks_all), "user_filtered_graph": int(leaks_graph), "user_filtered_exact": int(leaks_exact)}
        # Round trip: re-add the same ids (pending side path, then flushed into the graph).
        t0 = time.perf_counter()
        idx.add(victims, victim_users, victim_vecs)
        idx.flush()
        r["readd_and_extend_s"] = round(time.perf_counter() - t0, 4)
        top1 = idx.search_all(victim_vecs, 1)
        r["readded_self_top1"] = float(np.mean([h[0].fact_id == victims[i] for i, h in enumerate(top1)]))
        # Rebuild: delete until tombstones pass the threshold.
        builds0 = idx.stats["builds"]
        frac = idx.rebuild_tombstone_fraction
        n_more = int((frac + 0.02) * (idx.graph_rows + idx.pending_rows)) - idx.tombstones
        alive_old = [f for f in D["fact_ids"] if f in idx]
        more = [alive_old[i] for i in rng.choice(len(alive_old), max(n_more, 1), replace=False).tolist()]
        t0 = time.perf_counter()
        idx.remove(more)
        r["remove_triggering_rebuild_s"] = round(time.perf_counter() - t0, 3)
        r["rebuilt"] = idx.stats["builds"] > builds0
        r["rebuild_graph_build_s"] = round(idx.stats["last_build_s"], 3)
        r["rows_after_rebuild"], r["tombstones_after"] = idx.graph_rows, idx.tombstones
        live_ids = [f for f in S.get("all_ids", D["fact_ids"]) if f in idx]
        allX = S.get("allX", D["X"])
        pos = {f: i for i, f in enumerate(S.get("all_ids", D["fact_ids"]))}
        liveX = allX[torch.as_tensor([pos[f] for f in live_ids])]
        gt = exact_topk(D["Q"], liveX, k, device)
        r[f"unfiltered_recall@{k}_after_rebuild"] = round(recall(idx.search_all(D["Q"], k), [[live_ids[j] for j in row] for row in gt.tolist()], k), 4)

    with rec.section("small") as r:
        small = vi.CagraIndex(args.dim, device)
        small.add([f"s{i}" for i in range(100)], ["u"] * 100, D["X"][:100])
        r["has_graph_at_100"] = small.has_graph
        r["self_top1_at_100"] = float(np.mean([small.search("u", D["X"][i], 1)[0][0].fact_id == f"s{i}" for i in range(100)]))
        try:
            cagra = small.cagra
            cagra.build(cagra.IndexParams(metric="sqeuclidean"), D["X"][:100].to(device).contiguous())
            r["direct_cagra_build_100"] = "ok"
        except Exception as exc:
            r["direct_cagra_build_100"] = f"{type(exc).__name__}: {exc}"

    rec.data["meta"]["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    rec.write()
    print(rec.table())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
