"""What the replica -> shard actor hop costs by itself (issue 10: planning's "shard hop"). Usage:
docs/bench.md."""

from __future__ import annotations

import argparse
import os
import pickle
import time
from pathlib import Path

from bench.kit.results import median, table, timed, write_result

FACT = "Caroline went to the LGBTQ support group on 7 May 2023 and found it powerful."


def make_plan(k: int):
    from memory.planner import ChatPlan
    from memory.records import MemoryHit

    hits = [MemoryHit(f"{i:032x}", FACT, 0.5, f"D{i}:3") for i in range(k)]
    tokens = 22 * k + 60  # LoCoMo facts are ~20 tokens, plus the instruction and the question
    params = {"kvmem": {"inject": [[i, 1, 22 * i] for i in range(k + 1)]}}
    return ChatPlan(prompt_token_ids=list(range(tokens)), mode="kv", kv_transfer_params=params, cache_salt="s" * 40,
                    facts=hits, injected_tokens=tokens - 40, timings={"shard_embed": 1.0, "shard_search": 1.0})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=lambda v: [int(x) for x in v.split(",")], default=[10, 50])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("bench/results/shard_hop_cpu.json"))
    args = parser.parse_args()
    import ray

    from actors.shard_actor import SHARD_ACTOR_OPTIONS

    plans = {k: make_plan(k) for k in args.k}

    @ray.remote
    class PlanningShard:
        def noop(self) -> None:
            return None

        def serve_ipc(self, address: str) -> None:
            """The same plans over a ZeroMQ socket served by a thread of the actor's process."""
            import threading

            import zmq

            socket = zmq.Context.instance().socket(zmq.REP)
            socket.bind(address)

            def serve() -> None:
                while True:
                    k = int(socket.recv())
                    socket.send(pickle.dumps(plans[k]) if k else b"")

            threading.Thread(target=serve, daemon=True).start()

        def plan(self, k: int):
            return plans[k]

    @ray.remote(num_cpus=0)
    class Replica:
        async def round_trips_ms(self, shard, ks: list[int], calls: int) -> dict[str, float]:
            async def timed(make_ref) -> float:
                for _ in range(20):
                    await make_ref()
                samples = []
                for _ in range(calls):
                    started = time.perf_counter()
                    await make_ref()
                    samples.append(time.perf_counter() - started)
                return median(samples, 1e3)

            out = {"noop": await timed(lambda: shard.noop.remote())}
            for k in ks:
                out[f"plan_k{k}"] = await timed(lambda k=k: shard.plan.remote(k))
            import zmq
            import zmq.asyncio

            address = f"ipc:///tmp/kvmem-shard-hop-{os.getpid()}"
            await shard.serve_ipc.remote(address)
            socket = zmq.asyncio.Context.instance().socket(zmq.REQ)
            socket.connect(address)

            async def over_ipc(k: int):
                await socket.send(str(k).encode())
                reply = await socket.recv()
                return pickle.loads(reply) if reply else None

            out["ipc_noop"] = await timed(lambda: over_ipc(0))
            for k in ks:
                out[f"ipc_plan_k{k}"] = await timed(lambda k=k: over_ipc(k))
            return out

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        shard = PlanningShard.options(**SHARD_ACTOR_OPTIONS).remote()
        hop = ray.get(Replica.remote().round_trips_ms.remote(shard, args.k, args.calls))
    finally:
        ray.shutdown()
    pickling = {f"plan_k{k}": round(timed(lambda k=k: pickle.loads(pickle.dumps(plans[k])), [()] * 500, 1, (50,))["p50_ms"] * 1e3, 1)
                for k in args.k}
    sizes = {f"plan_k{k}": len(pickle.dumps(plans[k])) for k in args.k}
    print(table([[name, ms, pickling.get(name), sizes.get(name)] for name, ms in hop.items()],
                ["call", "round trip ms", "pickle+unpickle us", "bytes"], ".3f"))
    write_result(args.out, {"round_trip_ms_median": hop, "pickle_unpickle_us_median": pickling, "pickled_bytes": sizes,
                            "calls": args.calls, "ray": ray.__version__, "command": "python -m bench.serve.shard_hop"})


if __name__ == "__main__":
    main()
