"""Scheduler half of the KV memory connector (engine-core process).

KVMemoryScheduler validates a request's kvmem operations (kvarena.params) against the arena,
pins the entries it injects (unpinned in request_finished), tells vLLM how many prompt tokens
the connector provides, and turns each step's scheduled requests into slot-level InjectOp /
CaptureOp lists (connector.metadata) for the worker half (connector.worker). Anything wrong with
a request's memory makes it fall back to a plain prefill of its own prompt tokens. It is the
only pinner of its arena, so when it starts it clears the pins a crashed engine left behind.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from connector.metadata import CaptureOp, InjectOp, KVMemoryConnectorMetadata
from kvarena.arena import EntryView, FactArena
from kvarena.params import PARAMS_KEY, KVMemoryParams

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class ServingPlacement:
    """An entry placed at a serving position of a request's prompt: the capture target (injected
    entries are kept column-wise in RequestPlan)."""

    view: EntryView
    start: int  # serving position of the entry's first token

    @property
    def end(self) -> int:
        return self.start + self.view.n_tokens


@dataclass
class RequestPlan:
    """What the scheduler side knows about one request's memory operations."""

    # the injected entries (pinned), sorted by serving start: ids, generations, [start, end) ranges
    inject_entries: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    inject_generations: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    inject_starts: list[int] = field(default_factory=list)
    inject_ends: list[int] = field(default_factory=list)
    # the injected entries' tokens, concatenated in serving order: positions, arena slots, distances
    inject_positions: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    inject_slots: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    inject_distances: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    capture: ServingPlacement | None = None
    offered_from: int = 0  # num_computed_tokens the last offer was made for
    load_range: tuple[int, int] | None = None  # granted by vLLM, consumed by the next metadata
    block_ids: list[int] = field(default_factory=list)
    captured: bool = False
    scheduler_s: float = 0.0  # host time the scheduler side spent on this request (reported back)


class KVMemoryScheduler:
    """The scheduler half of KVMemoryConnector (engine-core process): plans, pins, emits ops."""

    def __init__(self, arena: FactArena, block_size: int, max_distance: int = 1 << 30, engine_slot: int = 0) -> None:
        self.arena = arena
        self.block_size = block_size
        self.max_distance = max_distance  # the worker's rotary table ends there
        self.engine_slot = engine_slot  # this engine's pins in the arena (other engines of the shard have their own)
        self.plans: dict[str, RequestPlan] = {}
        self.fallbacks = 0
        # This scheduler is its slot's only pinner: pins found there now were taken by requests of
        # the engine that held the slot before and died (they never finish), so they go, with the
        # retired entries only they held. Other slots belong to live engines of the same shard.
        stale = arena.clear_pins(engine_slot)
        if stale:
            logger.warning("KV memory connector: released %d pins left by a previous engine in slot %d", stale, engine_slot)

    # -------- planning
    def _plan(self, request: "Request") -> RequestPlan | None:
        plan = self.plans.get(request.request_id)
        if plan is not None:
            return plan
        try:
            params = KVMemoryParams.from_kv_transfer_params(request.kv_transfer_params)
        except ValidationError as exc:
            self._fallback(request, f"malformed kvmem parameters: {exc.errors()[:1]}")
            params = KVMemoryParams()  # planned once, as a plain prefill
        if params is None:
            return None
        plan = RequestPlan()
        self.plans[request.request_id] = plan
        prompt = np.asarray(request.prompt_token_ids or [], dtype=np.int64)
        if params.injects_anything:
            self._pin_injects(request, params, prompt, plan)
        if params.capture is not None:
            view = self.arena.writing_view(params.capture.entry, params.capture.generation)
            if view is None or params.capture.start + view.n_tokens > len(prompt):
                logger.warning("request %s: capture target %s is not writable; not captured", request.request_id, params.capture)
            elif not np.array_equal(self.arena.entry_token_ids(view), prompt[params.capture.start : params.capture.start + view.n_tokens]):
                logger.warning("request %s: capture target tokens differ from the prompt; not captured", request.request_id)
            else:
                plan.capture = ServingPlacement(view, params.capture.start)
        return plan

    def _pin_injects(self, request: "Request", params: KVMemoryParams, prompt: np.ndarray, plan: RequestPlan) -> None:
        """Pin the request's entries and fill the plan's inject columns, sorted by serving start;
        on any problem nothing stays pinned and the request falls back to a prefill. Column-wise
        (a request may inject 50+ entries: no Python object per entry)."""
        if not request.cache_salt:
            self._fallback(request, "injection without a cache_salt (injected KV would be shared by token ids)")
            return
        ids, gens, starts = params.inject_arrays()
        order = np.argsort(starts, kind="stable")  # serving order; overlapping entries: the first asked wins
        ids, gens, starts = ids[order], gens[order], starts[order]
        pinned, ok = self.arena.pin_columns(ids, gens, self.engine_slot)  # one lock for all
        if pinned is None:
            bad = int(np.flatnonzero(~ok)[0])
            self._fallback(request, f"entry {ids[bad]} gen {gens[bad]} is unknown, stale or freed")
            return
        lengths = pinned.n_tokens
        ends = starts + lengths
        first = np.cumsum(lengths) - lengths  # each entry's first row in the concatenation
        positions = np.repeat(starts - first, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
        slots = pinned.token_slots
        distances = np.repeat(starts - pinned.encode_starts, lengths)
        if len(distances) and int(np.abs(distances).max()) > self.max_distance:  # the worker could not rotate it
            self.arena.unpin_columns(ids, gens, self.engine_slot)
            self._fallback(request, f"an entry moves more than the rotary table's {self.max_distance} positions")
            return
        # all entries' tokens against the prompt in one comparison, not one check per entry
        inside = positions < len(prompt)
        equal = np.zeros(len(positions), dtype=bool)
        equal[inside] = self.arena.token_ids[slots[inside]] == prompt[positions[inside]]
        if not equal.all():
            bad = int(np.searchsorted(np.cumsum(lengths), int(np.flatnonzero(~equal)[0]), side="right"))
            self.arena.unpin_columns(ids, gens, self.engine_slot)
            self._fallback(request, f"entry {ids[bad]} tokens do not match prompt positions {starts[bad]}..")
            return
        plan.inject_entries, plan.inject_generations = ids, gens
        plan.inject_starts, plan.inject_ends = starts.tolist(), ends.tolist()
        plan.inject_positions, plan.inject_slots, plan.inject_distances = positions, slots, distances

    def _fallback(self, request: "Request", reason: str) -> None:
        self.fallbacks += 1
        logger.warning("request %s falls back to prefill: %s", request.request_id, reason)

    # -------- vLLM hooks
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        started = time.perf_counter()
        plan = self._plan(request)
        if plan is None:
            return 0
        plan.scheduler_s += time.perf_counter() - started
        if not plan.inject_starts:
            return 0
        end = num_computed_tokens
        for start, stop in zip(plan.inject_starts, plan.inject_ends):  # sorted by start: extend a contiguous run from end
            if start <= end < stop:
                end = stop
        end = min(end, request.num_prompt_tokens - 1)  # vLLM must compute at least one token
        plan.offered_from = num_computed_tokens
        return max(0, end - num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", num_external_tokens: int) -> None:
        plan = self.plans.get(request.request_id)
        if plan is not None and num_external_tokens > 0:
            plan.load_range = (plan.offered_from, plan.offered_from + num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVMemoryConnectorMetadata:
        metadata = KVMemoryConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            plan = self.plans.get(new_req.req_id)
            if plan is None:
                continue
            plan.block_ids = list(new_req.block_ids[0])
            self._emit(plan, new_req.req_id, new_req.num_computed_tokens, scheduler_output, metadata)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self.plans.get(req_id)
            if plan is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    plan.block_ids = list(new_blocks[0])
                else:
                    plan.block_ids.extend(new_blocks[0])
            self._emit(plan, req_id, cached.num_computed_tokens[i], scheduler_output, metadata)
        return metadata

    def _emit(self, plan: RequestPlan, req_id: str, num_computed: int, scheduler_output, metadata) -> None:
        started = time.perf_counter()
        try:
            self._emit_ops(plan, req_id, num_computed, scheduler_output, metadata)
        finally:
            plan.scheduler_s += time.perf_counter() - started

    def _emit_ops(self, plan: RequestPlan, req_id: str, num_computed: int, scheduler_output, metadata) -> None:
        if plan.load_range is not None:
            start, end = plan.load_range
            plan.load_range = None
            chosen = np.flatnonzero((plan.inject_positions >= start) & (plan.inject_positions < end))
            positions, first = np.unique(plan.inject_positions[chosen], return_index=True)  # overlaps: first entry wins
            chosen = chosen[first]
            assert len(positions) == end - start, "granted range not covered by injected entries"
            metadata.injects.append(
                InjectOp(req_id, plan.inject_slots[chosen], self._cache_slots(plan, positions), plan.inject_distances[chosen])
            )
        capture = plan.capture
        if capture is not None and not plan.captured:
            done = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if done >= capture.end:  # the captured range is in the cache after this step
                plan.captured = True
                positions = np.arange(capture.start, capture.end, dtype=np.int64)
                metadata.captures.append(
                    CaptureOp(
                        req_id,
                        self._cache_slots(plan, positions),
                        capture.view.token_slots,
                        capture.view.entry_id,
                        capture.view.generation,
                    )
                )

    def _cache_slots(self, plan: RequestPlan, positions: np.ndarray) -> np.ndarray:
        blocks = np.asarray(plan.block_ids, dtype=np.int64)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    def request_finished(self, request: "Request") -> dict[str, Any] | None:
        """Unpin the request's entries; returns the {"kvmem": {...}} outcome report."""
        plan = self.plans.pop(request.request_id, None)
        if plan is None:
            return None
        if plan.inject_starts:  # one lock for all
            self.arena.unpin_columns(plan.inject_entries, plan.inject_generations, self.engine_slot)
        return {PARAMS_KEY: {"captured": plan.captured, "scheduler_us": round(plan.scheduler_s * 1e6, 1)}}
