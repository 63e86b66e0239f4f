"""A stream's MTP drafting (engine.lanes.model_drafting), with no model: what it asks the
head for after each landed round. The head's cache must hold one entry per row of the
stream's own, in order, whatever the drafts were and whether the stream may draft, its
prompt's rows included; a resumed stream keeps the entries that rest on its own tokens
(engine.lanes.prompt_cache.head_entries_kept)."""

from __future__ import annotations

import pytest

from engine.draft_head import DraftAsk
from engine.lanes.model_drafting import ModelDrafting
from engine.lanes.prompt_cache import KeptPrompt, head_entries_kept


def test_each_landed_round_is_fed_once_after_the_entries_before_it():
    drafting = ModelDrafting(most=3)
    assert drafting.ask(room=3) is None  # nothing landed: nothing to feed or draft from
    drafting.landed(2, "rows-a", [5], [40], position=9)  # a prompt's last row
    assert drafting.ask(room=3) == DraftAsk(2, 0, "rows-a", (5,), (40,), 9, 3)
    drafting.verified(3, 1)  # one draft kept: the next round keeps 2 rows
    drafting.landed(2, "rows-b", [0, 1], [41, 42], position=10)
    assert drafting.ask(room=1) == DraftAsk(2, 1, "rows-b", (0, 1), (41, 42), 10, 1)
    assert drafting.ask(room=1) is None  # fed once only
    assert (drafting.drafted, drafting.accepted) == (3, 1)


def test_a_paused_stream_still_feeds_its_rows():
    drafting = ModelDrafting(most=2)
    drafting.landed(0, "r", [0], [7], position=4)
    drafting.ask(room=2)
    drafting.verified(2, 0)  # none kept: no draft next round
    drafting.landed(0, "r", [0], [8], position=5)
    ask = drafting.ask(room=2)
    assert (ask.kept, ask.count) == (1, 0)  # fed after the first entry, drafting nothing
    drafting.landed(0, "r", [0], [9], position=6)
    assert drafting.ask(room=0).kept == 2


def test_two_landings_without_an_ask_are_refused():
    drafting = ModelDrafting(most=2)
    drafting.landed(0, "r", [0], [7], position=4)
    with pytest.raises(RuntimeError, match="two rounds"):
        drafting.landed(0, "r", [0], [8], position=5)


def test_a_prompt_chunk_is_fed_without_drafting_and_in_step_with_its_positions():
    drafting = ModelDrafting(most=3)
    drafting.landed(1, "chunk-a", range(4), [11, 12, 13, 14], position=0)  # rows 0..3
    assert drafting.ask(room=None) == DraftAsk(1, 0, "chunk-a", (0, 1, 2, 3),
                                               (11, 12, 13, 14), 0, 0)
    assert drafting.length.next == 3  # a feed spends no round of the draft length
    drafting.landed(1, "tail", range(3), [15, 16, 40], position=4)  # the last row's token drawn
    assert drafting.ask(room=3) == DraftAsk(1, 4, "tail", (0, 1, 2), (15, 16, 40), 4, 3)
    assert (drafting.fed, drafting.in_step) == (7, 7)


def test_a_resumed_stream_keeps_the_slots_entries_and_a_gap_stops_the_count_in_step():
    drafting = ModelDrafting(most=2)
    drafting.resumed(31)  # the entry of position 31 was paired with another token
    drafting.landed(0, "r", range(2), [5, 6], position=32)
    assert drafting.ask(room=None).kept == 31
    assert (drafting.fed, drafting.in_step) == (33, 31)
    kept = ModelDrafting(most=2)
    kept.resumed(32)
    kept.landed(0, "r", range(2), [5, 6], position=32)
    kept.ask(room=None)
    assert (kept.fed, kept.in_step) == (34, 34)


def test_a_resume_keeps_the_head_entries_that_rest_on_the_prompts_tokens():
    old = KeptPrompt(tuple(range(8)), closed_round=3, head_tokens=tuple(range(11)))
    prompt = list(range(12))
    assert head_entries_kept(old, prompt, 8) == 8  # the token at 8 is the old one: all stay
    assert head_entries_kept(old, [*range(8), 99, 100], 8) == 7  # entry 7 rested on 8
    assert head_entries_kept(old, prompt, 0) == 0  # no resume, nothing kept
    assert head_entries_kept(None, prompt, 8) == 0
    short = KeptPrompt(tuple(range(8)), closed_round=3, head_tokens=tuple(range(5)))
    assert head_entries_kept(short, prompt, 8) == 4  # the old stream fed 4 in step
    assert head_entries_kept(KeptPrompt(tuple(range(8)), 3), prompt, 8) == 0  # no head
