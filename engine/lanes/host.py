"""Rank 0's lane host: admits streams into slots and runs rounds continuously.

Every active stream rides every round: decode rows for streams that are generating, and
prompt chunks (at most `chunk` prompt rows a round, in slot order) for streams that are
still reading their prompt. Each round is decided by `engine.pipeline.round_builder` from
a frozen view of the streams and the slot table; the host applies the admissions and
releases it returns, then runs the plan. A round runs on one worker thread, so the event
loop stays free for HTTP while the model computes; its rows are sampled inside the round,
on the head's device (`SamplingBatch` says how each row draws), and only token ids and
logprobs come back: the loop turns them into text and events.

Whatever goes wrong while sampling or detokenizing one stream ends that stream alone (a
`Failed` event with `per_request` set, its slot cancelled next round); only a failed round
or a bug in the loop itself fails the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import structlog

from engine.lanes.sampler import (
    Choice,
    RowDraw,
    SampledRows,
    Sampler,
    SamplingBatch,
    SamplingParams,
)
from engine.lanes.text import TextCodec, TextStream
from engine.pipeline.round_builder import BuiltRound, Lane, RoundInputs, build_round
from engine.pipeline.runner import RoundRunner
from engine.rounds import Op, RoundPlan

log = structlog.get_logger()


class Busy(Exception):
    """Every slot is taken and the wait queue is full: come back later (HTTP 503)."""


class EngineFailed(Exception):
    """The engine (or its ring) has failed; nothing more will be served."""


class TokenMetrics(Protocol):
    """Where each sampled token is counted (engine.api.metrics in a served engine)."""

    def token(self, *, first: bool, since_s: float) -> None: ...

    def round_done(self, *, decode_rows: int, seconds: float) -> None: ...


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    top_logprobs: int | None = None  # None: no logprobs; n: the chosen one and n alternatives


@dataclass(frozen=True)
class Token:
    token_id: int
    text: str  # the text this token adds (may be empty while a stop string is undecided)
    choice: Choice


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    reason: str
    # True: this request alone failed (HTTP 500, not worth a retry); False: the engine or
    # its ring failed (HTTP 503, another replica or a restart may serve it).
    per_request: bool = False


Event = Token | Done | Failed


@dataclass(eq=False)
class Stream:
    request: GenerationRequest
    text: TextStream
    sampler: Sampler
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    slot: int | None = None
    fed: int = 0  # prompt rows already run
    generated: list[int] = field(default_factory=list)
    finished: bool = False  # no more rows; the slot closes next round
    cancelled: bool = False
    failed: bool = False  # this stream alone failed; the slot is cancelled next round
    created_s: float = field(default_factory=time.monotonic)
    last_token_s: float | None = None

    def cancel(self) -> None:
        self.cancelled = True

    def fail(self, reason: str) -> None:
        """End this stream alone with `reason`; its slot is cancelled in the next round."""
        if not self.finished:
            self.finished = self.failed = True
            self.events.put_nowait(Failed(reason, per_request=True))

    @property
    def position(self) -> int:
        """Position of the next row this stream feeds."""
        return self.fed + max(0, len(self.generated) - 1)

    def lane(self, chunk: int) -> Lane:
        """This stream as the round builder sees it (a frozen view: nothing here changes).

        At most `chunk` prompt rows: no round carries more, and a long prompt is not copied
        whole every round."""
        if self.finished or self.cancelled:
            abandoned = self.failed or (self.cancelled and not self.finished)
            return Lane((), self.position, ending=Op.CANCEL if abandoned else Op.CLOSE)
        prompt = self.request.prompt_ids
        if self.fed < len(prompt):
            return Lane(prompt[self.fed:self.fed + chunk], self.position, chunked=True)
        return Lane((self.generated[-1],), self.position)


class LaneHost:
    def __init__(self, runner: RoundRunner, codec: TextCodec, *, chunk: int, max_waiting: int,
                 metrics: TokenMetrics | None = None,
                 on_round: Callable[[RoundPlan, np.ndarray], None] | None = None) -> None:
        self.runner = runner
        self.codec = codec
        self.chunk = chunk
        self.max_waiting = max_waiting
        self.metrics = metrics
        # Sees every round's logits (tests, traces): only then do they come to the host.
        self.on_round = on_round
        self.slots: list[Stream | None] = [None] * runner.slots.parallel
        self.waiting: deque[Stream] = deque()
        self.failure: str | None = None
        self.draining = False
        self.round_no = 0
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()  # set while no stream is in flight, or once failed
        self._settled.set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="round")

    @property
    def context(self) -> int:
        return self.runner.slots.context

    def slots_in_use(self) -> int:
        return sum(s is not None for s in self.slots)

    def submit(self, request: GenerationRequest) -> Stream:
        if self.failure:
            raise EngineFailed(self.failure)
        if self.draining:
            raise Busy("the engine is draining: it takes no new requests")
        stream = Stream(request, TextStream(self.codec, request.stop), Sampler(request.sampling))
        free = next((i for i, s in enumerate(self.slots) if s is None), None)
        if free is not None:
            self.slots[free], stream.slot = stream, free
        elif len(self.waiting) < self.max_waiting:
            self.waiting.append(stream)
        else:
            raise Busy(f"all {len(self.slots)} slots are busy and {self.max_waiting} requests wait")
        self._settled.clear()
        self._wake.set()
        return stream

    def idle(self) -> bool:
        return self.slots_in_use() == 0 and not self.waiting

    async def drain(self, deadline_s: float) -> bool:
        """Stop admitting and wait up to `deadline_s` for in-flight streams; True if all ended."""
        self.draining = True
        try:
            await asyncio.wait_for(self._settled.wait(), deadline_s)
        except TimeoutError:
            pass
        return self.idle()

    def fail(self, reason: str) -> None:
        """End every stream with `reason`; later submits raise EngineFailed."""
        self.failure = reason
        for stream in [*self.slots, *self.waiting]:
            if stream is not None and not stream.finished:
                stream.finished = True
                stream.events.put_nowait(Failed(reason))
        self.waiting.clear()
        self._settled.set()
        self._wake.set()

    async def run(self) -> None:
        """Build and run rounds until cancelled or failed (then `failure` says why).

        Never raises: a bug in building or delivering a round fails the engine with its
        reason, so rank 0 still exits with one structured line."""
        try:
            await self._run_rounds()
        except Exception as exc:  # noqa: BLE001 - an escape would end the task unexplained
            log.error("round loop failed", round=self.round_no,
                      error=f"{type(exc).__name__}: {exc}")
            self.fail(f"the round loop failed in round {self.round_no}: "
                      f"{type(exc).__name__}: {exc}")

    async def _run_rounds(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.failure:
            built = build_round(self._round_inputs())
            self._apply(built)
            if built.plan is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            plan, token_ids = built.plan, built.token_ids
            decode_rows = self._decode_rows(plan)
            started_s = time.monotonic()
            draws = self._draws(plan)
            batch = SamplingBatch.of(list(draws.values()), keep_logits=self.on_round is not None)
            try:
                sampled = await loop.run_in_executor(
                    self._executor, self.runner.sample_round, plan, token_ids, batch)
            except Exception as exc:  # noqa: BLE001 - any failed round is fatal: fail fast
                log.error("round failed", round=plan.round_no, error=str(exc))
                self.fail(f"round {plan.round_no} failed: {exc}")
                return
            if self.metrics is not None:
                self.metrics.round_done(decode_rows=decode_rows,
                                        seconds=time.monotonic() - started_s)
            if self.on_round:
                self.on_round(plan, sampled.logits)
            self._deliver(plan, sampled, list(draws))

    def _decode_rows(self, plan: RoundPlan) -> int:
        """The round's row count when every row is a decode row (one row per stream, each
        past its prompt), else 0: a prompt chunk's round is not what decode ms/token means."""
        rows = 0
        for entry in plan.entries:
            if entry.rows == 0:
                continue
            stream = self.slots[entry.stream_id]
            if (entry.rows != 1 or stream is None
                    or entry.first < len(stream.request.prompt_ids)):
                return 0
            rows += 1
        return rows

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _round_inputs(self) -> RoundInputs:
        return RoundInputs(
            round_no=self.round_no + 1,
            lanes=tuple(None if s is None else s.lane(self.chunk) for s in self.slots),
            slots=self.runner.slots.snapshot(), chunk=self.chunk,
            waiting=tuple(s.lane(self.chunk) for s in self.waiting))

    def _apply(self, built: BuiltRound) -> None:
        """Take the admitted waiters into their lanes, empty the released lanes."""
        taken = [self.waiting.popleft() for _ in range(built.taken)]
        for index, slot in built.admitted:
            self.slots[slot], taken[index].slot = taken[index], slot
        for slot in built.released:
            self.slots[slot] = None
        if built.plan is not None:
            self.round_no = built.plan.round_no
        self._note_settled()

    def _draws(self, plan: RoundPlan) -> dict[int, RowDraw]:
        """Stream id -> its draw, for every stream whose returned row this round predicts
        its next token (a decode row, or the chunk that ends its prompt)."""
        draws: dict[int, RowDraw] = {}
        returned = 0
        for entry in plan.entries:
            if entry.op in (Op.CLOSE, Op.CANCEL):
                continue
            stream, row = self.slots[entry.stream_id], returned
            returned += 1
            if stream.fed + entry.rows < len(stream.request.prompt_ids):
                continue  # a mid-prompt chunk: its last row predicts nothing we need
            if not (stream.cancelled or stream.finished):
                draws[entry.stream_id] = stream.sampler.draw(row, stream.request.top_logprobs)
        return draws

    def _deliver(self, plan: RoundPlan, sampled: SampledRows, drawn: list[int]) -> None:
        """drawn: the stream ids of the round's draws, in the batch's order."""
        now = time.monotonic()
        at = {stream_id: i for i, stream_id in enumerate(drawn)}
        for entry in plan.entries:
            stream = self.slots[entry.stream_id]
            if entry.op in (Op.CLOSE, Op.CANCEL):
                self.slots[entry.stream_id] = None
                continue
            if stream.fed < len(stream.request.prompt_ids):
                stream.fed += entry.rows
                if stream.fed < len(stream.request.prompt_ids):
                    continue  # a mid-prompt chunk: its last row predicts nothing we need
            if stream.cancelled or stream.finished or entry.stream_id not in at:
                continue
            try:
                self._take(stream, sampled, at[entry.stream_id], now)
            except Exception as exc:  # noqa: BLE001 - one stream's fault ends that stream only
                log.warning("stream failed", round=plan.round_no, stream=entry.stream_id,
                            error=f"{type(exc).__name__}: {exc}")
                stream.fail(f"generating this reply failed: {type(exc).__name__}: {exc}")
        if any(s is not None for s in self.slots) or self.waiting:
            self._wake.set()
        self._note_settled()

    def _note_settled(self) -> None:
        if self.idle():
            self._settled.set()

    def _take(self, stream: Stream, sampled: SampledRows, i: int, now: float) -> None:
        """Hand out the token drawn at batch position `i`: its text, and the end it may make."""
        request = stream.request
        choice = stream.sampler.take(sampled, i, request.top_logprobs)
        stream.generated.append(choice.token_id)
        if self.metrics is not None:
            self.metrics.token(first=stream.last_token_s is None,
                               since_s=now - (stream.last_token_s or stream.created_s))
        stream.last_token_s = now
        is_stop_token = choice.token_id in request.stop_token_ids
        text = "" if is_stop_token else stream.text.push(choice.token_id)
        reason = None
        if is_stop_token or stream.text.stopped:
            reason = "stop"
        elif (len(stream.generated) >= request.max_tokens
              or len(request.prompt_ids) + len(stream.generated) >= self.context):
            reason = "length"
        if reason:
            text += stream.text.flush()  # text held back for a stop string that never came
        stream.events.put_nowait(Token(choice.token_id, text, choice))
        if reason:
            stream.finished = True
            stream.events.put_nowait(
                Done(reason, len(request.prompt_ids), len(stream.generated)))
