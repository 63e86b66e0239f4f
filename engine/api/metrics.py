"""Prometheus metrics of one engine: requests, tokens, drafts, latency, slots, the prompt
cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.kv_pages import PAGE_POSITIONS

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ROUND_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
DECODE_ROUND = "ringfleet_decode_round_seconds"


@dataclass(frozen=True)
class CacheStage:
    """One stage of the ring as the prompt cache's figures name it."""

    rank: int
    layer_range: tuple[int, int]
    slot_bytes: int  # one slot's state with a whole window of KV (engine.families)
    position_bytes: int = 0  # its KV of one position, which a pool holds a page at a time
    not_kv_bytes: int = 0  # the rest of a slot's state (a hybrid's recurrent states)

    def held_bytes(self, slots: int, pages: int | None) -> int:
        """What `slots` kept conversations take here: whole slots, or under a KV pool the
        `pages` they hold beside each slot's state that is not KV."""
        if pages is None:
            return slots * self.slot_bytes
        return slots * self.not_kv_bytes + pages * PAGE_POSITIONS * self.position_bytes


@dataclass(frozen=True)
class KvPool:
    """A ring's pool of KV pages (FLEET_KV_PAGES) as rank 0 counts it: every stage holds
    the same pages for the same slots (engine.slots)."""

    pages: int  # the pool, on every stage
    in_use: Callable[[], int]  # pages the slots hold, open or kept
    kept: Callable[[], int]  # pages the kept conversations hold


class EngineMetrics:
    def __init__(self, slots_in_use: Callable[[], int], waiting: Callable[[], int],
                 cache_held: Callable[[], int] = lambda: 0,
                 cache_stages: Sequence[CacheStage] = (), cache_slots: int = 0,
                 pool: KvPool | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ringfleet_requests", "HTTP API requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ringfleet_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generated_tokens = Counter("ringfleet_generated_tokens", "Tokens generated",
                                        registry=r)
        self.prompt_cache_hits = Counter("ringfleet_prompt_cache_hits",
                                         "Requests that resumed from a kept prompt state",
                                         registry=r)
        self.prompt_cache_misses = Counter("ringfleet_prompt_cache_misses",
                                           "Requests that ran their whole prompt", registry=r)
        self.prompt_cache_tokens = Counter("ringfleet_prompt_cache_reused_tokens",
                                           "Prompt tokens restored instead of run", registry=r)
        self.drafted_tokens = Counter("ringfleet_drafted_tokens", "Tokens drafted into verify "
                                      "rounds", registry=r)
        self.accepted_tokens = Counter("ringfleet_accepted_tokens", "Drafted tokens a verify "
                                       "round confirmed", registry=r)
        self.ttft = Histogram("ringfleet_time_to_first_token_seconds",
                              "From admission to the first token", buckets=LATENCY_BUCKETS_S,
                              registry=r)
        self.itl = Histogram("ringfleet_inter_token_latency_seconds",
                             "Between consecutive tokens of one stream", buckets=LATENCY_BUCKETS_S,
                             registry=r)
        # What placement predicts (supervisor/ring_cost.py: a decode round of `rows` rows
        # round the ring), measured where it can be: rank 0 from sending a round whose every
        # row is a decode row until its logits are back. Labelled by rows (at most the
        # replica's `parallel`), so one stream alone and a full round are told apart.
        self.decode_round = Histogram(DECODE_ROUND, "A decode-only round, ring and head "
                                      "included, by its row count", ["rows"],
                                      buckets=ROUND_BUCKETS_S, registry=r)
        Gauge("ringfleet_slots_in_use", "Slots holding a stream", registry=r).set_function(
            slots_in_use)
        Gauge("ringfleet_requests_waiting", "Requests waiting for a slot", registry=r).set_function(
            waiting)
        # The prompt cache's slots are the same on every stage (one slot table), their bytes
        # are each stage's own: rank 0 counts the closed slots that hold a conversation and
        # multiplies by each stage's bytes per slot, which all of its state takes where it
        # is preallocated whole; under a KV pool, by the pages they hold.
        self.cache_held, self.cache_stages, self.cache_slots = cache_held, cache_stages, cache_slots
        self.pool = pool
        if pool is not None:
            Gauge("ringfleet_kv_pages", "KV pages of 64 positions every stage's pool holds",
                  registry=r).set(pool.pages)
            Gauge("ringfleet_kv_pages_in_use", "KV pages the slots hold, open or kept",
                  registry=r).set_function(pool.in_use)
        self.cache_hits = self.cache_misses = self.cache_reused_tokens = 0
        Gauge("ringfleet_prompt_cache_slots", "Slots kept past the streams for finished "
              "conversations", registry=r).set(cache_slots)
        Gauge("ringfleet_prompt_cache_slots_held", "Closed slots holding a conversation a "
              "later request may resume", registry=r).set_function(cache_held)
        slot_bytes = Gauge("ringfleet_prompt_cache_slot_bytes", "What one slot's state takes "
                           "on a stage", ["rank", "layers"], registry=r)
        held_bytes = Gauge("ringfleet_prompt_cache_bytes_held", "Bytes of a stage's slot "
                           "state that hold kept conversations", ["rank", "layers"], registry=r)
        for stage in cache_stages:
            labels = (str(stage.rank), f"{stage.layer_range[0]}:{stage.layer_range[1]}")
            slot_bytes.labels(*labels).set(stage.slot_bytes)
            held_bytes.labels(*labels).set_function(lambda stage=stage: self.held_bytes(stage))

    def held_bytes(self, stage: CacheStage) -> int:
        """Bytes of `stage`'s state that hold kept conversations."""
        return stage.held_bytes(self.cache_held(), None if self.pool is None else self.pool.kept())

    def token(self, *, first: bool, since_s: float) -> None:
        self.generated_tokens.inc()
        (self.ttft if first else self.itl).observe(since_s)

    def round_done(self, *, decode_rows: int, seconds: float) -> None:
        """A round ran; `decode_rows` > 0 when every row in it was a decode row."""
        if decode_rows > 0:
            self.decode_round.labels(rows=str(decode_rows)).observe(seconds)

    def verified(self, *, drafted: int, accepted: int) -> None:
        self.drafted_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)

    def prompt_cache(self, *, reused_tokens: int) -> None:
        (self.prompt_cache_hits if reused_tokens else self.prompt_cache_misses).inc()
        self.prompt_cache_tokens.inc(reused_tokens)
        self.cache_hits += bool(reused_tokens)
        self.cache_misses += not reused_tokens
        self.cache_reused_tokens += reused_tokens

    def prompt_cache_figures(self) -> dict[str, Any]:
        """The prompt cache as rank 0's /health tells it (the supervisor's status shows it)."""
        figures = {"slots": self.cache_slots, "held": self.cache_held(), "hits": self.cache_hits,
                   "misses": self.cache_misses, "reused_tokens": self.cache_reused_tokens,
                   "stages": [{"rank": s.rank, "layers": list(s.layer_range),
                               "slot_bytes": s.slot_bytes, "bytes_held": self.held_bytes(s)}
                              for s in self.cache_stages]}
        if self.pool is not None:
            figures["kv_pages"] = {"pool": self.pool.pages, "in_use": self.pool.in_use(),
                                   "kept": self.pool.kept()}
        return figures

    def render(self) -> bytes:
        return generate_latest(self.registry)
