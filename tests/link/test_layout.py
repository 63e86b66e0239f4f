"""Rank 0's boot checks: contiguous layouts and the stages' descriptions, refused by name."""

from __future__ import annotations

import dataclasses

import pytest

from engine.backend_names import Backend, Dtype
from engine.harness.make_fixtures import DESCRIBE
from engine.link import errors
from engine.link.layout import check_descriptions, check_layout
from engine.link.messages import Describe


@pytest.mark.parametrize("ranges", [[(0, 36)], [(0, 20), (20, 36)], [(0, 1), (1, 2), (2, 36)]])
def test_good_layouts(ranges):
    check_layout(ranges, 36)


@pytest.mark.parametrize(("ranges", "error", "match"), [
    ([(0, 9), (10, 36)], errors.LayoutGap, "rank 0 ends at 9, rank 1 starts at 10"),
    ([(3, 20), (20, 36)], errors.LayoutGap, "layers 0..3 are held by no rank"),
    ([(0, 20), (20, 30)], errors.LayoutGap, "layers 30..36 are held by no rank"),
    ([], errors.LayoutGap, "no rank"),
    ([(0, 21), (20, 36)], errors.LayoutOverlap, "rank 0 ends at 21, rank 1 starts at 20"),
    ([(0, 20), (20, 37)], errors.LayoutOverrun, "past the model's 36 layers"),
    ([(-1, 20), (20, 36)], errors.LayoutOverrun, "before layer 0"),
    ([(0, 20), (20, 20), (20, 36)], errors.EmptyLayerRange, "rank 1's layer range 20..20"),
    ([(0, 20), (25, 20)], errors.EmptyLayerRange, "25..20"),
])
def test_bad_layouts(ranges, error, match):
    with pytest.raises(error, match=match):
        check_layout(ranges, 36)


def stage(rank: int, first: int, end: int, **change: object) -> Describe:
    return dataclasses.replace(DESCRIBE, **{"rank": rank, "layer_first": first,
                                            "layer_end": end, **change})


def fleet(**change_rank1: object) -> list[Describe]:
    return [stage(0, 0, 20), stage(1, 20, 36, backend=Backend.MLX_METAL, **change_rank1)]


def check(descs: list[Describe], **kwargs: object) -> list[Describe]:
    base = {"n_layers": 36, "engine_version": "0.1.0", "context": 8192, "parallel": 4}
    return check_descriptions(descs, **{**base, **kwargs})


def test_good_descriptions_come_back_by_rank():
    descs = fleet()
    assert check(list(reversed(descs))) == descs
    assert check([stage(0, 0, 36, world=1)]) == [stage(0, 0, 36, world=1)]


@pytest.mark.parametrize(("descs", "error", "match"), [
    (fleet(world=3), errors.WorldMismatch, "rank 1 runs a world of 3; rank 0 runs 2"),
    ([stage(0, 0, 20)], errors.RankMismatch, r"ranks \[1\]"),
    ([stage(0, 0, 20), stage(0, 20, 36)], errors.RankMismatch, "twice"),
    ([stage(1, 0, 20), stage(2, 20, 36)], errors.RankMismatch, "no description from rank 0"),
    ([stage(0, 0, 20), stage(1, 20, 30), stage(2, 30, 36)], errors.RankMismatch,
     r"ranks \[2\] are outside a world of 2"),
    (fleet(engine_version="0.1.1"), errors.VersionMismatch, "rank 1 runs engine 0.1.1"),
    (fleet(layer_first=21), errors.LayoutGap, "rank 0 ends at 20, rank 1 starts at 21"),
    (fleet(layer_first=19), errors.LayoutOverlap, None),
    (fleet(layer_end=40), errors.LayoutOverrun, None),
    (fleet(hidden=4096), errors.FormatMismatch, "hidden differs: rank 0 declares 2048, rank 1"),
    (fleet(planes=1), errors.FormatMismatch, "planes differs"),
    (fleet(drafter_width=64), errors.FormatMismatch, "drafter_width differs"),
    (fleet(row_dtype=Dtype.FLOAT16), errors.FormatMismatch,
     "rank 0 sends bfloat16, rank 1 expects float16"),
    (fleet(planes=0), errors.FormatMismatch, "at least 1"),
    (fleet(prompt_chunk=256), errors.ShapeMismatch, "prompt_chunk 256"),
    (fleet(context=4096), errors.ShapeMismatch, "context 4096"),
    (fleet(parallel=8), errors.ShapeMismatch, "parallel 8"),
    (fleet(kv_rows=4096), errors.CapacityTooSmall, "rank 1 holds 4096 KV rows; the context"),
    (fleet(recurrent_states=3), errors.CapacityTooSmall, "3 recurrent states; --parallel needs 4"),
])
def test_bad_descriptions(descs, error, match):
    with pytest.raises(error, match=match):
        check(descs)


def test_a_row_dtype_that_differs_is_refused_whichever_hop():
    # No stage converts rows: a dtype that differs on the hop back to rank 0 is refused too.
    descs = [stage(0, 0, 20, row_dtype=Dtype.FLOAT16), stage(1, 20, 36)]
    with pytest.raises(errors.FormatMismatch, match="rank 0 sends float16, rank 1 expects"):
        check(descs)


def test_three_stage_ring_checks_the_hop_back_to_rank_0():
    descs = [stage(0, 0, 10, world=3), stage(1, 10, 20, world=3),
             stage(2, 20, 36, world=3, hidden=1024)]
    with pytest.raises(errors.FormatMismatch, match="rank 1 -> rank 2"):
        check(descs)
