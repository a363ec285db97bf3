"""FactArena life cycle: allocation, pins, release, generations (no engine)."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from kvarena.arena import ArenaError, ArenaFull, ArenaGeometry, EntryRef, FactArena

GEOMETRY = ArenaGeometry(num_layers=2, num_kv_heads=2, head_size=32, dtype="float32", page_tokens=8, num_pages=8, max_entries=4, max_pages_per_entry=4)


@pytest.fixture()
def arena(tmp_path):
    a = FactArena.create(tmp_path / "arena", GEOMETRY)
    yield a
    a.close()


def test_pinned_entry_is_not_freed_until_unpinned(arena: FactArena) -> None:
    ref = arena.allocate(list(range(20)), encode_start=5)
    arena.commit(ref)
    view = arena.pin(ref.entry_id, ref.generation)
    assert view is not None and view.n_tokens == 20 and view.encode_start == 5
    assert arena.release(ref) is False
    assert arena.state_of(ref) == "retired"
    assert arena.usage()["pages_used"] == 3  # its pages are still held
    assert arena.pin(ref.entry_id, ref.generation) is None  # no new request may pin it
    arena.unpin(ref.entry_id, ref.generation)
    assert arena.state_of(ref) == "free"
    assert arena.usage()["pages_used"] == 0


def test_reused_entry_gets_a_new_generation(arena: FactArena) -> None:
    first = arena.allocate([1, 2, 3], 0)
    arena.commit(first)
    arena.release(first)
    second = arena.allocate([4, 5], 0)
    assert second.entry_id == first.entry_id and second.generation == first.generation + 1
    arena.commit(second)
    assert arena.pin(first.entry_id, first.generation) is None
    with pytest.raises(ArenaError):
        arena.commit(first)


def test_capacity_limits_are_enforced(arena: FactArena) -> None:
    with pytest.raises(ArenaError):
        arena.allocate(list(range(33)), 0)  # over max_pages_per_entry * page_tokens
    refs = [arena.allocate(list(range(16)), 0) for _ in range(4)]  # 8 pages in all
    with pytest.raises(ArenaFull):
        arena.allocate([1], 0)
    arena.release(refs[0])
    arena.allocate([1], 0)


def test_token_ids_round_trip_and_out_of_range_pins(arena: FactArena) -> None:
    ref = arena.allocate([7, 8, 9, 10, 11, 12, 13, 14, 15], 0)
    arena.commit(ref)
    view = arena.pin(ref.entry_id, ref.generation)
    assert arena.entry_token_ids(view).tolist() == [7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert arena.pin(999, 1) is None and arena.pin(-1, 1) is None


def _child_writes(path: str, entry: int, generation: int) -> None:
    child = FactArena.open(path)
    view = child.writing_view(entry, generation)
    child.kv[:, view.token_slots] = 3.0
    child.close()


def test_another_process_sees_the_same_bytes(arena: FactArena) -> None:
    ref = arena.allocate([1, 2, 3, 4], 0)
    process = mp.get_context("spawn").Process(target=_child_writes, args=(str(arena.path), ref.entry_id, ref.generation))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    arena.commit(ref)
    view = arena.pin(ref.entry_id, ref.generation)
    assert np.all(arena.entry_kv(view).numpy() == 3.0)


def test_open_checks_geometry(tmp_path) -> None:
    FactArena.create(tmp_path / "a", GEOMETRY).close()
    with pytest.raises(ArenaError):
        FactArena.create(tmp_path / "a", ArenaGeometry(num_layers=3, num_kv_heads=2, head_size=32, dtype="float32"), exist_ok=True)
    with pytest.raises(ArenaError):
        FactArena.open(tmp_path / "missing")


def test_worker_skips_a_capture_whose_entry_was_released_and_reallocated(tmp_path) -> None:
    """A capture planned for (entry, generation) must not write once the owner (say, a restarted
    shard) released that entry and gave its pages to another fact."""
    from connector.worker import KVMemoryWorker
    from connector.metadata import CaptureOp, KVMemoryConnectorMetadata

    arena = FactArena.create(tmp_path / "arena", ArenaGeometry(num_layers=1, num_kv_heads=1, head_size=4, dtype="float32", page_tokens=4, num_pages=4, max_entries=4))
    stale = arena.allocate([1, 2, 3], encode_start=0)
    arena.release(stale)
    fresh = arena.allocate([7, 8, 9], encode_start=0)
    assert fresh.entry_id == stale.entry_id and fresh.generation == stale.generation + 1
    view = arena.writing_view(fresh.entry_id, fresh.generation)
    arena.kv[0, view.token_slots] = 5.0
    worker = KVMemoryWorker(arena, repositioner=None)
    op = CaptureOp("req", np.arange(3), view.token_slots, stale.entry_id, stale.generation)
    worker.capture(KVMemoryConnectorMetadata(captures=[op]))  # would need a paged cache if it wrote
    assert torch.equal(arena.kv[0, view.token_slots], torch.full((3, 2, 1, 4), 5.0))


def test_pin_many_counts_an_entry_placed_twice_and_the_last_unpin_frees_it(arena: FactArena) -> None:
    ref = arena.allocate(list(range(10)), encode_start=3)
    arena.commit(ref)
    other = arena.allocate(list(range(5)), encode_start=0)
    arena.commit(other)
    views = arena.pin_many([(ref.entry_id, ref.generation), (other.entry_id, other.generation), (ref.entry_id, ref.generation)])
    assert [v.entry_id for v in views] == [ref.entry_id, other.entry_id, ref.entry_id]
    assert views[0].n_tokens == 10 and views[0].encode_start == 3 and len(views[0].token_slots) == 10
    np.testing.assert_array_equal(arena.entry_token_ids(views[0]), np.arange(10))
    assert int(arena.entries[ref.entry_id]["pins"]) == 2
    assert arena.release(ref) is False  # retired: two pins left
    arena.unpin_many([(ref.entry_id, ref.generation), (other.entry_id, other.generation)])
    assert arena.state_of(ref) == "retired"
    with pytest.raises(ArenaError):
        arena.unpin_many([(ref.entry_id, ref.generation), (ref.entry_id, ref.generation)])  # only one pin left
    arena.unpin_many([(ref.entry_id, ref.generation)])
    assert arena.state_of(ref) == "free" and arena.usage()["pages_used"] == 1


def test_scheduler_falls_back_when_an_entry_would_move_beyond_the_rotary_table(arena: FactArena) -> None:
    """The worker cannot rotate keys farther than its table: the scheduler refuses such an
    injection up front (a prefill, entries unpinned) instead of failing the engine step."""
    import types

    from connector.scheduler import KVMemoryScheduler
    from kvarena.params import EntryPlacement, KVMemoryParams

    tokens = list(range(7, 19))
    side = KVMemoryScheduler(arena, block_size=8, max_distance=20)

    def offered(encode_start: int) -> tuple[int, int]:
        ref = arena.allocate(tokens, encode_start=encode_start)
        arena.commit(ref)
        params = KVMemoryParams(inject=[EntryPlacement(entry=ref.entry_id, generation=ref.generation, start=0)])
        request = types.SimpleNamespace(
            request_id=f"r{encode_start}", kv_transfer_params=params.to_kv_transfer_params(), prompt_token_ids=tokens + [2],
            cache_salt="salt", num_prompt_tokens=len(tokens) + 1,
        )  # fmt: skip
        granted = side.get_num_new_matched_tokens(request, 0)
        return granted, int(arena.entries[ref.entry_id]["pins"])

    assert offered(encode_start=20) == (12, 1)  # moved by -20: within the table, pinned and offered
    assert offered(encode_start=21) == (0, 0)  # one beyond: prefilled, nothing left pinned
    assert side.fallbacks == 1


def test_usage_reports_bytes_per_tier(arena: FactArena) -> None:
    ref = arena.allocate(list(range(20)), 0)  # 3 pages
    arena.commit(ref)
    view = arena.pin(ref.entry_id, ref.generation)
    pages = np.unique(view.token_slots // GEOMETRY.page_tokens)
    usage = arena.usage()
    assert usage["pages_used"] == 3 and usage["device_pages_resident"] == 0 and usage["bytes_device"] == 0
    assert usage["bytes_host"] == 3 * arena.page_bytes == 3 * GEOMETRY.kv_bytes() // GEOMETRY.num_pages
    arena.publish_residency(pages[:2], np.array([5, 9]))
    assert arena.usage()["device_pages_resident"] == 2 and arena.usage()["bytes_device"] == 2 * arena.page_bytes
    other = FactArena.open(arena.path)  # the owner sees what the worker published
    assert other.usage()["device_pages_resident"] == 2
    arena.unpin(ref.entry_id, ref.generation)
    arena.release(ref)  # freeing pages forgets their residency
    assert other.usage()["device_pages_resident"] == 0 and (other.page_device[pages] == -1).all()
    other.close()


def test_arena_tables_of_another_layout_are_refused(tmp_path) -> None:
    """An arena written by another version (other table layout) is refused with ArenaError, which
    the shard answers by replacing it (its KV is derived from Redis)."""
    FactArena.create(tmp_path / "old", GEOMETRY).close()
    tables = tmp_path / "old" / "tables.bin"
    with open(tables, "r+b") as f:  # e.g. an arena written before the residency table existed
        f.truncate(tables.stat().st_size - GEOMETRY.num_pages * 4)
    with pytest.raises(ArenaError, match="this version expects"):
        FactArena.open(tmp_path / "old")


def test_pin_many_is_all_or_nothing(arena: FactArena) -> None:
    a, b = arena.allocate([1, 2], 0), arena.allocate([3, 4], 0)
    arena.commit(a)
    arena.commit(b)
    views = arena.pin_many([(a.entry_id, a.generation), (b.entry_id, b.generation + 1)])
    assert views[0] is not None and views[1] is None
    assert arena.entries[a.entry_id]["pins"] == 0  # nothing stays pinned
    views = arena.pin_many([(a.entry_id, a.generation), (b.entry_id, b.generation)])
    assert all(v is not None for v in views)
    arena.unpin_many([(a.entry_id, a.generation), (b.entry_id, b.generation)])
    assert arena.entries[a.entry_id]["pins"] == 0 and arena.entries[b.entry_id]["pins"] == 0


def test_a_new_scheduler_clears_the_pins_a_dead_engine_left_and_frees_what_they_held(arena: FactArena) -> None:
    """Pins live in shared memory: requests of an engine that died never unpin. The next engine's
    scheduler (the arena's only pinner) clears them, and the retired entries they held are freed."""
    from connector.scheduler import KVMemoryScheduler

    kept, dropped = arena.allocate([1, 2, 3], 0), arena.allocate(list(range(10)), 0)
    arena.commit(kept)
    arena.commit(dropped)
    arena.pin_many([(kept.entry_id, kept.generation), (dropped.entry_id, dropped.generation), (kept.entry_id, kept.generation)])
    assert arena.release(dropped) is False and arena.usage()["pins"] == 3  # the dead engine's requests hold them
    full = arena.usage()["pages_used"]
    KVMemoryScheduler(arena, block_size=8)
    usage = arena.usage()
    assert usage["pins"] == 0 and usage["entries_retired"] == 0 and usage["pages_used"] == full - 2
    assert arena.state_of(kept) == "live" and arena.state_of(dropped) == "free"
    assert arena.pin(kept.entry_id, kept.generation) is not None  # still injectable


def test_live_entries_carry_their_owners_tags_and_tokens(arena: FactArena) -> None:
    digest = bytes(range(15)) + b"\0"  # a digest may end in zero bytes: they are kept
    tagged = arena.allocate([5, 6, 7], 2, tag=digest)
    arena.commit(tagged)
    short = arena.allocate([4], 0, tag=b"fact-b:1")
    arena.commit(short)
    arena.allocate([8, 9], 0, tag=b"writing")  # not live: never offered for adoption
    (ref, tag, tokens), (_, short_tag, _) = arena.live_entries()
    assert ref == tagged and tag == digest and tokens.tolist() == [5, 6, 7]
    assert short_tag == b"fact-b:1".ljust(16, b"\0")
    arena.release(tagged)
    arena.release(short)
    assert arena.live_entries() == [] and bytes(arena.entries[tagged.entry_id]["tag"]) == bytes(16)
    with pytest.raises(ArenaError):
        arena.allocate([1], 0, tag=b"x" * 17)
    other = arena.allocate([1], 0, tag=b"b")
    assert arena.is_pinned(other) is False
    arena.commit(other)
    arena.pin(other.entry_id, other.generation)
    assert arena.is_pinned(other) is True and arena.is_pinned(EntryRef(other.entry_id, other.generation + 1)) is False


def test_pin_columns_gives_each_entrys_token_slots_concatenated_in_the_order_asked(arena: FactArena) -> None:
    """Entries of 3, 1 and 2 pages: the columns hold each entry's slots (of its pages only), in order."""
    texts = [list(range(100, 120)), list(range(200, 205)), list(range(300, 310))]
    refs = [arena.allocate(tokens, encode_start=i) for i, tokens in enumerate(texts)]
    for ref in refs:
        arena.commit(ref)
    asked = [refs[2], refs[0], refs[1], refs[2]]
    pinned, ok = arena.pin_columns(np.array([r.entry_id for r in asked]), np.array([r.generation for r in asked]))
    assert pinned is not None and ok.all()
    assert pinned.n_tokens.tolist() == [10, 20, 5, 10] and pinned.encode_starts.tolist() == [2, 0, 1, 2]
    expected = np.concatenate([arena.pin(r.entry_id, r.generation).token_slots for r in asked])
    np.testing.assert_array_equal(pinned.token_slots, expected)
    np.testing.assert_array_equal(arena.token_ids[pinned.token_slots], np.concatenate([texts[2], texts[0], texts[1], texts[2]]))
    arena.unpin_columns(pinned.entry_ids, pinned.generations)
    arena.unpin_many([(r.entry_id, r.generation) for r in asked])  # the pins pin() took above
    assert int(arena.entries["pins"].sum()) == 0
    stale = arena.pin_columns(np.array([refs[0].entry_id, refs[1].entry_id]), np.array([refs[0].generation, refs[1].generation + 1]))
    assert stale[0] is None and stale[1].tolist() == [True, False] and int(arena.entries["pins"].sum()) == 0


def _write_kv(arena: FactArena, ref: EntryRef, value: float) -> None:
    view = arena.writing_view(ref.entry_id, ref.generation)
    arena.kv[:, torch.from_numpy(view.token_slots)] = value  # what the worker's capture does


def test_a_freed_entry_leaves_no_token_ids_or_kv_bytes_in_the_arena_files(arena: FactArena) -> None:
    """Erasure: freeing an entry (release, the last unpin of a retired entry, pins cleared by a new
    scheduler) zeroes its token ids in tables.bin and its KV in kv.bin; a kept entry is untouched.
    The files are read back as bytes, as another process (or an attacker with the files) would."""
    from connector.scheduler import KVMemoryScheduler

    def tokens(base: int, n: int) -> list[int]:
        return list(range(base, base + n))

    kept, released, retired, cleared = (arena.allocate(tokens(1000 * (i + 1), 10), 0) for i in range(4))
    for i, ref in enumerate((kept, released, retired, cleared)):
        _write_kv(arena, ref, 1.5 + i)  # each entry's KV a value of its own
        arena.commit(ref)

    def in_files(ref_tokens: list[int], kv_value: float) -> tuple[bool, bool]:
        tables = (arena.path / "tables.bin").read_bytes()
        kv = np.fromfile(arena.path / "kv.bin", dtype=np.float32)
        return np.asarray(ref_tokens, dtype="<i4").tobytes() in tables, bool((kv == kv_value).any())

    assert all(in_files(tokens(1000 * (i + 1), 10), 1.5 + i) == (True, True) for i in range(4))  # the scan finds them
    assert arena.release(released) is True
    arena.pin(retired.entry_id, retired.generation)
    assert arena.release(retired) is False  # retired: a request still reads it, nothing is zeroed yet
    assert in_files(tokens(3000, 10), 3.5) == (True, True)
    arena.unpin(retired.entry_id, retired.generation)  # the last unpin frees it
    arena.pin(cleared.entry_id, cleared.generation)
    arena.release(cleared)
    KVMemoryScheduler(arena, block_size=8)  # a new engine's scheduler clears the dead one's pins
    for i in (1, 2, 3):
        assert in_files(tokens(1000 * (i + 1), 10), 1.5 + i) == (False, False)
    assert in_files(tokens(1000, 10), 1.5) == (True, True)  # the kept entry is whole
    view = arena.pin(kept.entry_id, kept.generation)
    assert arena.entry_token_ids(view).tolist() == tokens(1000, 10) and bool((arena.entry_kv(view) == 1.5).all())


def test_engines_of_one_arena_pin_in_their_own_slots_and_a_successor_clears_only_its_own(arena: FactArena) -> None:
    """Two engines serve one shard's arena (replicas of one shard): engine 0 dies with pins held;
    its successor in slot 0 clears them, engine 1's pins stay, and the entry retired meanwhile is
    freed only when engine 1 unpins it too."""
    from connector.scheduler import KVMemoryScheduler

    ref = arena.allocate(list(range(10)), 0)
    arena.commit(ref)
    pinned0, _ = arena.pin_columns(np.array([ref.entry_id, ref.entry_id]), np.array([ref.generation] * 2), engine=0)
    pinned1, _ = arena.pin_columns(np.array([ref.entry_id]), np.array([ref.generation]), engine=1)
    assert pinned0 is not None and pinned1 is not None and arena.usage()["pins"] == 3
    with pytest.raises(ArenaError, match="engine 1 has not pinned"):  # an engine never drops another's pin
        arena.unpin_columns(np.array([ref.entry_id] * 2), np.array([ref.generation] * 2), engine=1)
    assert arena.release(ref) is False and arena.state_of(ref) == "retired"
    KVMemoryScheduler(arena, block_size=8, engine_slot=0)  # engine 0's successor starts
    assert arena.usage()["pins"] == 1 and arena.state_of(ref) == "retired"  # engine 1 still reads it
    arena.unpin(ref.entry_id, ref.generation, engine=1)
    assert arena.state_of(ref) == "free" and arena.usage()["pins"] == 0


def test_each_engine_publishes_its_own_hbm_residency(arena: FactArena) -> None:
    ref = arena.allocate(list(range(16)), 0)  # two pages
    arena.commit(ref)
    pages = np.array(arena.entries[ref.entry_id]["pages"][:2], dtype=np.int64)
    arena.publish_residency(pages, np.array([0, 1], dtype=np.int32), engine=0)
    arena.publish_residency(pages[:1], np.array([5], dtype=np.int32), engine=1)
    assert arena.usage()["device_pages_resident"] == 3  # HBM held, counted per engine
    arena.forget_residency(0)  # engine 0 restarted: its tier is empty
    assert arena.usage()["device_pages_resident"] == 1
    arena.release(ref)
    assert arena.usage()["device_pages_resident"] == 0
    with pytest.raises(ArenaError, match="engine slot"):
        arena.publish_residency(pages, np.array([0, 1], dtype=np.int32), engine=4)


def test_connector_config_is_checked_once_and_names_unknown_keys() -> None:
    from connector.engine_config import ConnectorConfig

    config = ConnectorConfig.from_extra_config({"arena_path": "/dev/shm/x", "device_pages": 4, "engine_slot": 1})
    assert (config.device_pages, config.engine_slot, config.injector) == (4, 1, "auto")
    with pytest.raises(ValueError, match="devce_pages"):
        ConnectorConfig.from_extra_config({"arena_path": "/dev/shm/x", "devce_pages": 4})
    with pytest.raises(ValueError, match="engine_slot"):
        ConnectorConfig(arena_path="/dev/shm/x", engine_slot=9)


def _exits_at_once() -> None:
    pass


def test_an_engine_slot_is_held_by_its_process_and_freed_by_its_death(arena: FactArena) -> None:
    """Each replica claims a slot for its engine: its own again (an in-place engine restart), else
    the first free one or one whose holder died (a replaced replica); a slot given up is free."""
    import os

    child = mp.get_context("spawn").Process(target=_exits_at_once)
    child.start()
    child.join()
    assert arena.claim_engine_slot(os.getpid()) == 0
    assert arena.claim_engine_slot(os.getpid()) == 0  # the same process: the same slot
    assert arena.claim_engine_slot(os.getppid()) == 1  # another live process
    assert arena.live_engines() == 2
    arena.engine_owner[2] = (child.pid, 12345)  # held by a process that is gone
    assert arena.live_engines() == 2
    with pytest.raises(ArenaError, match="no live process"):
        arena.claim_engine_slot(child.pid)
    arena.release_engine_slot(0, os.getpid())
    assert arena.live_engines() == 1 and arena.claim_engine_slot(os.getppid()) == 1
