"""A stream's MTP drafting (engine.lanes.model_drafting), with no model: what it asks the
head for after each landed round. The head's cache must hold one entry per row of the
stream's own, in order, whatever the drafts were and whether the stream may draft."""

from __future__ import annotations

import pytest

from engine.draft_head import DraftAsk
from engine.lanes.model_drafting import ModelDrafting


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
