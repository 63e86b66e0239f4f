"""Rank 0's lane host: admits streams into slots and runs rounds continuously.

Every active stream rides every round: decode rows for streams that are generating, and
prompt chunks (at most `chunk` prompt rows a round, in slot order) for streams that are
still reading their prompt. Each round is decided by `engine.pipeline.round_builder` from
a frozen view of the streams and the slot table; the host applies the admissions and
releases it returns, then runs the plan. A round runs on one worker thread, so the event
loop stays free for HTTP while the model computes; its rows are sampled inside the round,
on the head's device (`SamplingBatch` says how each row draws), and only token ids and
logprobs come back: the loop turns them into text and events.

Rounds overlap on a pipeline: the host launches rounds until the runner's `depth` are in
flight, then lands the oldest. A stream whose next input a launched round decides (its
next token, or its slot's release) is busy and rides nothing until that round lands; a
prompt's next chunk needs nothing from the last one, so while stage 1 runs chunk k, rank 0
runs chunk k+1 (v2). Decode rows are split into `depth` groups of at most
ceil(decoding streams / depth) rows, so the groups occupy different stages at once (v3).
With depth 1 (one process) every round lands before the next is built, as before.

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
from functools import partial
from typing import Protocol, TypeVar

import numpy as np
import structlog

from engine.kv_pages import PAGE_POSITIONS
from engine.lanes.drafting import Drafting, PromptLookup
from engine.lanes.model_drafting import ModelDrafting
from engine.lanes.page_ledger import PageLedger
from engine.lanes.prompt_cache import (
    ChunkRecord,
    KeptPrompt,
    choose_slot,
    head_entries_kept,
    resume_point,
)
from engine.lanes.sampler import Sampler
from engine.lanes.text import TextCodec, TextStream
from engine.pipeline.round_builder import (
    DROP_KEPT,
    BuiltRound,
    Lane,
    RoundInputs,
    build_round,
    decode_rows_per_round,
)
from engine.pipeline.runner import RoundRunner
from engine.rounds import Op, RoundPlan
from engine.sampling import Choice, RowDraw, SampledRows, SamplingBatch, SamplingParams

log = structlog.get_logger()
T = TypeVar("T")
# What a draft head reads of a stream's entry (engine.lanes.model_drafting): the round's
# rows the entry ran, the position of the first, and the tokens already known to follow
# the first of them (a prompt's); the rest follow the tokens the round hands out.
HeadRows = tuple[tuple[int, ...], int, tuple[int, ...]]


class Busy(Exception):
    """Every slot is taken and the wait queue is full: come back later (HTTP 503)."""


class NeverFits(Exception):
    """The request needs more KV pages than the pool holds: it can never run (HTTP 400)."""


class RoundFailed(Exception):
    """A round's launch or landing raised (the cause); the engine fails, naming it."""

    def __init__(self, plan: RoundPlan) -> None:
        super().__init__(f"round {plan.round_no} failed")
        self.plan = plan


class EngineFailed(Exception):
    """The engine (or its ring) has failed; nothing more will be served."""


class TokenMetrics(Protocol):
    """Where each sampled token is counted (engine.api.metrics in a served engine)."""

    def token(self, *, first: bool, since_s: float) -> None: ...

    def round_done(self, *, decode_rows: int, seconds: float) -> None: ...

    def prompt_cache(self, *, reused_tokens: int) -> None: ...

    def verified(self, *, drafted: int, accepted: int) -> None: ...


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    top_logprobs: int | None = None  # None: no logprobs; n: the chosen one and n alternatives


@dataclass(frozen=True)
class DraftPolicy:
    """A model's drafting (fleet.yaml `drafter`, `draft_tokens`): how, and at most how many."""

    lookup: PromptLookup | None  # prompt lookup (`ngram`); None: rank 0's draft head
    most: int  # drafts a verify round carries at most

    @property
    def head(self) -> bool:
        """Whether rank 0's draft head drafts (`mtp`): it runs on the round thread and
        reads each landed round's rows."""
        return self.lookup is None


@dataclass(frozen=True)
class Launched:
    """A round in flight, as the host needs it when it lands."""

    plan: RoundPlan
    # stream id -> its draws' positions in the batch, in row order (a verify entry draws
    # once a row), for each stream whose rows predict its next tokens
    drawn: dict[int, range]
    # stream id -> what a draft head reads of the round, for each stream that drafts with one
    head_rows: dict[int, HeadRows]
    decode_rows: int  # its rows, when all are decode rows (else 0): the metrics' measure
    started_s: float


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
    cached_tokens: int = 0  # prompt tokens the prompt cache restored instead of running
    drafted_tokens: int = 0  # tokens its drafter proposed in verify rounds
    accepted_tokens: int = 0  # of them, the ones its reply kept


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
    # The round in flight that decides this stream's next rows (0: none); it rides no
    # round until that one lands.
    busy_in: int = 0
    resume: int = 0  # prompt positions its slot's kept state restored (the prompt cache)
    chunks: ChunkRecord | None = None  # how much of its state a later request may reuse
    drafting: Drafting | ModelDrafting | None = None  # None: one row a round
    draft: tuple[int, ...] = ()  # the drafts its next round carries after its newest token
    verifying: tuple[int, ...] = ()  # the drafts of its round in flight
    # Rows of its last round its state keeps (None: all): a verify round's accepted path.
    keep_rows: int | None = None
    pages: int = 0  # KV pages it may reach, held from admission (engine.lanes.page_ledger)

    @property
    def decoding(self) -> bool:
        """Past its prompt and still generating: a decode row each round it rides."""
        return (self.fed >= len(self.request.prompt_ids)
                and not (self.finished or self.cancelled))

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
        if self.busy_in:
            return Lane((), self.position)  # holds its slot, rides nothing
        if self.finished or self.cancelled:
            abandoned = self.failed or (self.cancelled and not self.finished)
            return Lane((), self.position, ending=Op.CANCEL if abandoned else Op.CLOSE)
        prompt = self.request.prompt_ids
        if self.fed < len(prompt):
            return Lane(prompt[self.fed:self.fed + chunk], self.position, chunked=True,
                        resume=self.resume)
        return Lane((self.generated[-1], *self.draft), self.position, accepted=self.keep_rows)

    def draft_room(self, context: int) -> int | None:
        """How many drafts this stream's next round has room for, when it is to choose
        them now (once per round it rides); None when not."""
        if self.drafting is None or self.busy_in or self.draft or not self.decoding:
            return None
        return min(self.request.max_tokens - len(self.generated), context - self.position) - 1


class LaneHost:
    def __init__(self, runner: RoundRunner, codec: TextCodec, *, chunk: int, max_waiting: int,
                 streams: int | None = None, metrics: TokenMetrics | None = None,
                 on_round: Callable[[RoundPlan, np.ndarray], None] | None = None,
                 drafts: DraftPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runner = runner
        self.depth = runner.depth  # rounds in flight at once
        self.codec = codec
        self.chunk = chunk
        self.max_waiting = max_waiting
        self.metrics = metrics
        # Sees every round's logits (tests, traces): only then do they come to the host.
        self.on_round = on_round
        self.slots: list[Stream | None] = [None] * runner.slots.parallel
        # Streams served at once (FLEET_PARALLEL); the stages' slots past it hold kept
        # conversations only (FLEET_PROMPT_CACHE_SLOTS), so more of them resume.
        self.streams = streams or len(self.slots)
        # What each closed slot's state holds for a later request (the prompt cache); a
        # recurrent (hybrid) state resumes only where it was saved.
        self.kept: list[KeptPrompt | None] = [None] * runner.slots.parallel
        self.recurrent = not runner.slots.can_roll_back
        # Every stage keeps any prefix of a verify entry: a dense state by its offset, a
        # hybrid's from the recurrent states kept after each of its rows (engine.slots).
        self.drafts = drafts
        # Admission by KV pages where every stage's pool is smaller than whole windows
        # (FLEET_KV_PAGES), and the closed slots whose kept state goes in the next round.
        pool = runner.slots.pages
        self.ledger = PageLedger(pool, runner.slots.context) if pool else None
        self.dropping: set[int] = set()
        self.waiting: deque[Stream] = deque()
        self.failure: str | None = None
        self.draining = False
        self.round_no = 0
        self.clock = clock
        # The last progress: a round landed, or work came to an idle host (rounds_owed_s).
        self._progress_s = clock()
        # Calls handed to the round thread and calls it finished (round_thread_busy): each
        # counter has one writer, the event loop and the round thread, so neither races.
        self._round_calls_handed = self._round_calls_done = 0
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()  # set while no stream is in flight, or once failed
        self._settled.set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="round")

    @property
    def context(self) -> int:
        return self.runner.slots.context

    def slots_in_use(self) -> int:
        return sum(s is not None for s in self.slots)

    def _kept_slots(self) -> list[int]:
        """Closed slots whose state holds a conversation a later request may resume."""
        return [i for i, (s, k) in enumerate(zip(self.slots, self.kept))
                if s is None and k is not None]

    def slots_kept(self) -> int:
        return len(self._kept_slots())

    def pages_in_use(self) -> int:
        """KV pages every stage holds for the slots, open or kept (engine.kv_pages)."""
        return self.runner.slots.pages_held()

    def pages_kept(self) -> int:
        """KV pages the kept conversations hold."""
        return sum(self.runner.slots.slots[i].pages for i in self._kept_slots())

    def submit(self, request: GenerationRequest) -> Stream:
        if self.failure:
            raise EngineFailed(self.failure)
        if self.draining:
            raise Busy("the engine is draining: it takes no new requests")
        request_pages = (len(request.prompt_ids), request.max_tokens)
        if self.ledger is not None and (why := self.ledger.never_fits(*request_pages)):
            raise NeverFits(why)
        was_idle = self.idle()
        stream = Stream(request, TextStream(self.codec, request.stop), Sampler(request.sampling))
        if self.drafts is not None and self.drafts.head:
            stream.drafting = ModelDrafting(self.drafts.most)
        elif self.drafts is not None:
            stream.drafting = Drafting(self.drafts.lookup, self.drafts.most, request.prompt_ids,
                                       len(request.prompt_ids) + request.max_tokens)
        if self._closing_slot_reuses_more(stream):
            self.waiting.append(stream)  # placed a round from now, when that slot's CLOSE lands
        elif not (self._can_place() and self._place(stream)):
            if len(self.waiting) >= self.max_waiting:
                raise Busy(self._busy_reason())
            self.waiting.append(stream)
        if was_idle:
            self._progress_s = self.clock()  # owed from now, not from the last round long ago
        self._settled.clear()
        self._wake.set()
        return stream

    def idle(self) -> bool:
        return self.slots_in_use() == 0 and not self.waiting

    def rounds_owed_s(self) -> float:
        """How long rounds have been owed with none landing: 0 while idle, else the time
        since the last round landed or since work came to the idle host. A stream in a slot
        or waiting for one is owed a round (a finished one its CLOSE), so while this grows
        the round loop is making no progress: a round running long, or a stuck one."""
        return 0.0 if self.idle() else max(0.0, self.clock() - self._progress_s)

    def round_thread_busy(self) -> bool:
        """Whether a launch or a landing is still running on the round thread."""
        return self._round_calls_done != self._round_calls_handed

    def _free_slots(self) -> list[int]:
        """Slots no stream holds, but for those whose kept state goes in the next round."""
        return [i for i, s in enumerate(self.slots) if s is None and i not in self.dropping]

    def _busy_reason(self) -> str:
        """Why a request found no room, for its 503: no stream free, or a stream free but
        the KV pool's pages all reserved by the open streams."""
        queue = f"and {self.max_waiting} requests wait"
        if self.ledger is not None and self._can_place():
            return (f"the open streams reserve the KV pool's pages ({self.ledger.pool} of "
                    f"{PAGE_POSITIONS} positions) {queue}")
        return f"all {self.streams} streams are busy {queue}"

    def _can_place(self) -> bool:
        return self.slots_in_use() < self.streams and bool(self._free_slots())

    def _closing_slot_reuses_more(self, stream: Stream) -> bool:
        """Whether a slot whose stream has finished, its CLOSE not yet landed, would give
        `stream` a longer reuse than any free slot. A client sends its next turn as soon as
        the last one's reply ends, which is a round before that slot is free: placed at
        once, the next turn would miss the very state it continues."""
        prompt = stream.request.prompt_ids
        best_free = max((resume_point(self.kept[i], prompt, self.chunk, self.recurrent)
                         for i in self._free_slots()), default=0)
        return any(resume_point(self._kept(s, self.round_no), prompt, self.chunk,
                                self.recurrent) > best_free
                   for s in self.slots if s is not None and s.finished and not s.failed)

    def _place(self, stream: Stream) -> bool:
        """Put `stream` in the free slot whose kept prompt state it reuses most (the prompt
        cache), its first rows resuming there; else in a slot that keeps nothing. False:
        its KV pages do not fit the pool yet (it waits)."""
        slot, resume = choose_slot(self._free_slots(), self.kept, stream.request.prompt_ids,
                                   self.chunk, self.recurrent)
        if self.ledger is not None and not self._reserve_pages(stream, slot, resume):
            return False
        if isinstance(stream.drafting, ModelDrafting):  # the draft head's entries of the slot
            stream.drafting.resumed(head_entries_kept(self.kept[slot],
                                                      stream.request.prompt_ids, resume))
        self.slots[slot], stream.slot = stream, slot
        self.kept[slot] = None  # resumed or opened afresh, the slot's state is the stream's
        stream.resume = stream.fed = resume
        stream.chunks = ChunkRecord(self.chunk, exact_until=resume, snapshot=resume)
        if self.metrics is not None:
            self.metrics.prompt_cache(reused_tokens=resume)
        return True

    def _reserve_pages(self, stream: Stream, slot: int, resume: int) -> bool:
        """Hold the KV pages `stream` may reach in `slot`, dropping kept states for them
        (kept states no request can reuse first, then the least recently closed); False
        where they would not fit with every other kept state dropped."""
        table = self.runner.slots.snapshot()
        request = stream.request
        wanted = self.ledger.reservation(len(request.prompt_ids), request.max_tokens,
                                         table[slot].pages if resume else 0)
        kept = [i for i, s in enumerate(self.slots)
                if s is None and i != slot and i not in self.dropping and table[i].pages]
        in_use = (sum(s.pages for s in self.slots if s is not None)
                  + sum(table[i].pages for i in kept))

        def last_use(i: int) -> tuple[bool, int]:
            record = self.kept[i]
            return (record is not None, record.closed_round if record else 0)

        dropped = self.ledger.drops(wanted, in_use, [(i, table[i].pages)
                                                     for i in sorted(kept, key=last_use)])
        if dropped is None:
            return False
        for i in dropped:
            self.dropping.add(i)
            self.kept[i] = None
        stream.pages = wanted
        return True

    def _admit_waiting(self) -> None:
        """Waiters into the free slots, in arrival order (one that ended while it waited
        leaves the queue without a slot); one whose kept state is in a slot still closing
        waits on for that slot, and those behind it may go first."""
        still: deque[Stream] = deque()
        while self.waiting:
            stream = self.waiting.popleft()
            if stream.cancelled or stream.finished:
                continue
            if not (self._can_place() and not self._closing_slot_reuses_more(stream)
                    and self._place(stream)):
                still.append(stream)
        self.waiting = still

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
        except RoundFailed as failed:  # any failed round is fatal: fail fast
            self._round_failed(failed.plan, failed.__cause__)
        except Exception as exc:  # noqa: BLE001 - an escape would end the task unexplained
            log.error("round loop failed", round=self.round_no,
                      error=f"{type(exc).__name__}: {exc}")
            self.fail(f"the round loop failed in round {self.round_no}: "
                      f"{type(exc).__name__}: {exc}")

    async def _run_rounds(self) -> None:
        in_flight: deque[Launched] = deque()
        while not self.failure:
            last: tuple[Launched, Callable[[], None]] | None = None  # fills the ring
            while len(in_flight) < self.depth and not self.failure:
                self._admit_waiting()
                await self._propose_drafts()
                built = build_round(self._round_inputs())
                self._apply(built)
                if built.plan is None:
                    break
                launched, batch = self._launched(built.plan)
                in_flight.append(launched)
                launch = partial(self.runner.launch, built.plan, built.token_ids, batch)
                if len(in_flight) == self.depth:
                    last = (launched, launch)  # it goes with the landing below
                else:
                    await self._in_round_thread(launched, launch)
            if not in_flight:
                if not self.failure:
                    self._wake.clear()
                    await self._wake.wait()
                continue
            landing = in_flight.popleft()
            sampled = await self._in_round_thread(landing, self.runner.land, last)
            self._progress_s = self.clock()
            if self.metrics is not None:
                self.metrics.round_done(decode_rows=landing.decode_rows,
                                        seconds=time.monotonic() - landing.started_s)
            if self.on_round:
                self.on_round(landing.plan, sampled.logits)
            self._deliver(landing, sampled)

    async def _in_round_thread(self, round_: Launched, call: Callable[[], T],
                               launch_first: tuple[Launched, Callable[[], None]] | None = None
                               ) -> T:
        """`call` for `round_` on the round thread, after `launch_first`'s launch if given:
        a launch and the landing it waits for go in one trip, so a round costs the event
        loop one hand-off to the thread and one back, not two of each. Raises RoundFailed
        naming the round whose launch or landing raised."""
        def run() -> T:
            if launch_first is not None:
                launched, launch = launch_first
                try:
                    launch()
                except Exception as exc:
                    raise RoundFailed(launched.plan) from exc
            return call()

        try:
            return await self._on_round_thread(run)
        except RoundFailed:
            raise
        except Exception as exc:
            raise RoundFailed(round_.plan) from exc

    async def _on_round_thread(self, call: Callable[[], T]) -> T:
        """`call` on the round thread, owed (`_round_calls_*`) from the hand-off until it
        returns."""
        def run() -> T:
            try:
                return call()
            finally:
                self._round_calls_done += 1

        self._round_calls_handed += 1  # before the hand-off: a call queued is owed as well
        return await asyncio.get_running_loop().run_in_executor(self._executor, run)

    async def _propose_drafts(self) -> None:
        """Each stream's drafts for the round about to be built. A draft head computes on
        rank 0's device, so it runs on the round thread, between the rounds it launches and
        lands; prompt lookup runs here."""
        if self.drafts is None or not self.drafts.head:
            self._propose()
        else:
            await self._on_round_thread(self._propose)

    def _propose(self) -> None:
        """Each stream's drafts: prompt lookup's at once, the draft head's together."""
        asks = []
        for stream in self.slots:
            if stream is None or stream.drafting is None:
                continue
            room = stream.draft_room(self.context)
            if isinstance(stream.drafting, ModelDrafting):
                # A stream still reading its prompt (room None) feeds its chunks' rows as
                # they land, so the head's cache keeps up with the prompt.
                if not (stream.finished or stream.cancelled) \
                        and (ask := stream.drafting.ask(room)) is not None:
                    asks.append((stream, ask, room is not None))
            elif room is not None:
                stream.draft = stream.drafting.propose(room)
        if asks:
            drafts = self.runner.stage.draft([ask for _, ask, _ in asks])
            for (stream, _, drafts_now), draft in zip(asks, drafts, strict=True):
                if drafts_now:
                    stream.draft = draft

    def _round_failed(self, plan: RoundPlan, exc: Exception) -> None:
        log.error("round failed", round=plan.round_no, error=str(exc))
        self.fail(f"round {plan.round_no} failed: {exc}")

    def _launched(self, plan: RoundPlan) -> tuple[Launched, SamplingBatch]:
        """Mark what launching `plan` does to its streams: prompt rows are fed, and every
        stream whose next input the round decides is busy until it lands. Returns the
        round's record and the draws its head makes (stream id -> draw, for each stream
        whose returned row predicts its next token: a decode row, or a prompt's last chunk)."""
        draws: list[RowDraw] = []
        drawn: dict[int, range] = {}
        head_rows: dict[int, HeadRows] = {}
        returned = plan.returned_by_stream()
        decode_only = True
        for entry, start, stop in plan.row_spans():
            stream = self.slots[entry.stream_id]
            if stream is None:  # a kept state dropped (the page ledger): no stream had it
                continue
            stream.busy_in = plan.round_no
            if entry.op in (Op.CLOSE, Op.CANCEL):
                continue
            prompt_ids = stream.request.prompt_ids
            prompt = len(prompt_ids)
            decode_only &= entry.first >= prompt
            rows = returned[entry.stream_id]
            ended = stream.cancelled or stream.finished
            if isinstance(stream.drafting, ModelDrafting) and not ended:
                # Each prompt row pairs with the prompt's next token; the prompt's last
                # row, and a decode or verify entry's rows, with the tokens handed out.
                known = prompt_ids[entry.first + 1:entry.end + 1] if stream.fed < prompt else ()
                head_rows[entry.stream_id] = (tuple(range(start, stop)), entry.first, known)
            if stream.fed < prompt:
                stream.chunks.ran(entry.first, entry.rows)
                stream.fed += entry.rows
                if stream.fed < prompt:
                    stream.busy_in = 0  # a mid-prompt chunk: the next chunk may follow it
                    continue
                rows = rows[-1:]  # a prompt's tail predicts one token: its last row's
            else:
                stream.verifying, stream.draft = stream.draft[:entry.rows - 1], ()
                stream.keep_rows = None
            if not ended:
                drawn[entry.stream_id] = range(len(draws), len(draws) + len(rows))
                draws.extend(stream.sampler.draw(row, stream.request.top_logprobs, ahead=i)
                             for i, row in enumerate(rows))
        batch = SamplingBatch.of(draws, keep_logits=self.on_round is not None,
                                 keep_hidden=self.drafts is not None and self.drafts.head)
        decode_rows = len(plan.returned_rows()) if decode_only else 0
        return Launched(plan, drawn, head_rows, decode_rows, time.monotonic()), batch

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _round_inputs(self) -> RoundInputs:
        # Groups of decode rows, one per stage, to keep every stage busy.
        decoding = sum(s is not None and s.decoding for s in self.slots)
        decode_rows = decode_rows_per_round(decoding, self.depth)
        return RoundInputs(
            round_no=self.round_no + 1,
            lanes=tuple(DROP_KEPT if i in self.dropping else None if s is None
                        else s.lane(self.chunk) for i, s in enumerate(self.slots)),
            slots=self.runner.slots.snapshot(), chunk=self.chunk,
            decode_rows=decode_rows)  # waiters were placed already (_admit_waiting)

    def _apply(self, built: BuiltRound) -> None:
        """Take the admitted waiters into their lanes, empty the released lanes."""
        taken = [self.waiting.popleft() for _ in range(built.taken)]
        for index, slot in built.admitted:
            self.slots[slot], taken[index].slot = taken[index], slot
        for slot in built.released:
            self.slots[slot] = None
        if built.plan is not None:
            self.round_no = built.plan.round_no
            self.dropping -= {e.stream_id for e in built.plan.entries if e.op == Op.CANCEL}
        self._note_settled()

    def _deliver(self, launched: Launched, sampled: SampledRows) -> None:
        """Hand each stream of a landed round its token; its streams are no longer busy."""
        now = time.monotonic()
        at = launched.drawn
        for entry in launched.plan.entries:
            stream = self.slots[entry.stream_id]
            if stream is None:  # a kept state dropped (the page ledger): no stream had it
                continue
            if stream.busy_in == launched.plan.round_no:
                stream.busy_in = 0
            if entry.op in (Op.CLOSE, Op.CANCEL):
                self.slots[entry.stream_id] = None
                if entry.op == Op.CLOSE:  # its state stays on every stage for a later hit
                    self.kept[entry.stream_id] = self._kept(stream, launched.plan.round_no)
                continue
            if stream.cancelled or stream.finished:
                continue  # ended meanwhile: nothing to hand out
            head_rows = launched.head_rows.get(entry.stream_id)
            if entry.stream_id not in at:  # a mid-prompt chunk: its rows for the draft head
                if head_rows is not None:
                    rows, first, known = head_rows
                    stream.drafting.landed(stream.slot, sampled.hidden, rows, known, first)
                continue
            try:
                self._take_verified(stream, sampled, at[entry.stream_id], now, head_rows)
            except Exception as exc:  # noqa: BLE001 - one stream's fault ends that stream only
                log.warning("stream failed", round=launched.plan.round_no,
                            stream=entry.stream_id, error=f"{type(exc).__name__}: {exc}")
                stream.fail(f"generating this reply failed: {type(exc).__name__}: {exc}")
        if any(s is not None for s in self.slots) or self.waiting:
            self._wake.set()
        self._note_settled()

    def _kept(self, stream: Stream, round_no: int) -> KeptPrompt | None:
        """What a closed stream's slot state offers a later request: the token ids of its
        reusable positions (the prompt, then the reply, as they were fed)."""
        reusable = stream.chunks.reusable(self.recurrent) if stream.chunks else 0
        if not reusable:
            return None
        fed = (*stream.request.prompt_ids, *stream.generated[:-1])
        head_tokens: tuple[int, ...] = ()
        if isinstance(stream.drafting, ModelDrafting) and stream.drafting.in_step:
            in_step = stream.drafting.in_step  # entries t < in_step rest on tokens 0..t + 1
            head_tokens = (*stream.request.prompt_ids, *stream.generated)[:in_step + 1]
        return KeptPrompt(tuple(fed[:reusable]), round_no, head_tokens)

    def _note_settled(self) -> None:
        if self.idle():
            self._settled.set()

    def _take_verified(self, stream: Stream, sampled: SampledRows, draws: range, now: float,
                       head_rows: HeadRows | None) -> None:
        """Hand out a landed entry's tokens: the first draw's, then while each draw equals
        the draft it scored (the draft is confirmed), the next draw's, until a draft is
        refused or the stream ends. Its next entry keeps the rows that ran the tokens handed
        out (`keep_rows`): the newest token's and the confirmed drafts'."""
        drafts, stream.verifying = stream.verifying, ()
        taken = accepted = 0
        reason = None
        for i in draws:
            token_id, reason = self._take(stream, sampled, i, now)
            taken += 1
            confirmed = taken <= len(drafts) and token_id == drafts[taken - 1]
            accepted += confirmed
            if reason or not confirmed:
                break
        if head_rows is not None and not reason:
            rows, first, known = head_rows  # the rows before those that scored the tokens
            stream.drafting.landed(stream.slot, sampled.hidden, rows[:len(known) + taken],
                                   (*known, *stream.generated[-taken:]), first)
        if drafts:
            stream.keep_rows = taken
            stream.drafting.verified(len(drafts), accepted)
            if self.metrics is not None:
                self.metrics.verified(drafted=len(drafts), accepted=accepted)
        if reason:
            request, drafting = stream.request, stream.drafting
            stream.finished = True
            stream.events.put_nowait(
                Done(reason, len(request.prompt_ids), len(stream.generated), stream.resume,
                     drafting.drafted if drafting else 0, drafting.accepted if drafting else 0))

    def _take(self, stream: Stream, sampled: SampledRows, i: int,
              now: float) -> tuple[int, str | None]:
        """Hand out the token drawn at batch position `i` and its text; returns it and the
        end it makes ("stop", "length"; None: none)."""
        request = stream.request
        choice = stream.sampler.take(sampled, i, request.top_logprobs)
        stream.generated.append(choice.token_id)
        if stream.drafting is not None:
            stream.drafting.took(choice.token_id)
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
        return choice.token_id, reason
