"""A hybrid keeps any prefix of a verify entry, exactly, on both backends.

A verify entry (engine.rounds) is a stream's newest token and its drafted tokens; the next
entry's `accepted` says how many of its rows stay. The Qwen3.5 hybrid's DeltaNet layers
keep their state after each of those rows, and put back the one the next entry keeps.
Each case runs a prompt, a verify entry of k + 1 rows (k = 1..4), then a CONTINUE that
keeps `accepted` of them (every value, 1..k + 1) and runs one decode row. The answer it
must give is independent: the same stage running only the accepted rows, one decode row a
round, in another slot; and transformers (float64) over the whole sequence. A two-stage
split must give the whole stage's bits, cut after a DeltaNet layer and after an attention
layer.

What the cases measured (this file's model, seeds 0 to 5): on mlx-cpu the logits equal
the decode-row reference bit for bit (every row of the verify entry, and the row after
the keep). On torch-cpu they differ by at most 1.1e-5: the verify entry's projections and
MLP run as one matmul over its rows, and a CPU matmul of several rows does not give a
one-row matmul's bits; its recurrence is the decode step's, a row at a time. Against a
float64 transformers the row after the keep sat within 3e-6 (torch) and 2e-5 (MLX).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from engine.backends.base import StageSpec, load_stage
from engine.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from engine.link.errors import BadEntry
from engine.rounds import Op, RoundPlan, StreamEntry
from tests.requirements import require

BACKENDS = ("torch-cpu", "mlx-cpu", "torch-cuda")  # CUDA: verify rows in captured graphs
LAYERS = 4  # the session's qwen3_5 checkpoint: DeltaNet, attention, DeltaNet, attention
PROMPT = 11
# Largest logit difference from the decode-row reference, per backend (0: bit for bit).
DECODE_ATOL = {"torch-cpu": 3e-5, "mlx-cpu": 0.0, "torch-cuda": 1e-4}
REFERENCE_ATOL = 1e-4  # float32 against a float64 transformers, as the other hybrid tests
CUTS = {"after-deltanet": 1, "after-attention": 2}


@pytest.fixture(scope="module")
def model_dir(make_model) -> Path:
    # The torch hybrid tests' checkpoint (its own seed: conditioning differs between seeds).
    return make_model("qwen3_5", multimodal=False, seed=24)


def needs(backend: str) -> None:
    require("mlx.core" if backend.startswith("mlx-") else "torch")  # CI fails without it
    if backend == "torch-cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")


class Ring:
    """Stages over consecutive layer ranges, driven by hand: one plan, every stage."""

    def __init__(self, model_dir: Path, backend: str, cuts: tuple[int, ...] = (),
                 parallel: int = 2) -> None:
        bounds = (0, *cuts, LAYERS)
        self.stages = [load_stage(StageSpec(model_dir, (a, b), backend, parallel, 64, 16,
                                            drafting=True))
                       for a, b in itertools.pairwise(bounds)]
        self.round_no = 0

    @property
    def table(self):
        return self.stages[0].slots

    def run(self, slot: int, op: Op, first: int, rows: int, accepted: int,
            ids: list[int]) -> np.ndarray | None:
        """One entry's round; the logits of its returned rows [rows back, vocab]."""
        return self.round([(slot, op, first, rows, accepted)], ids)

    def round(self, entries: list[tuple[int, Op, int, int, int]],
              ids: list[int]) -> np.ndarray | None:
        """One round of (slot, op, first, rows, accepted) entries, `ids` their rows' tokens
        in order; the logits of its returned rows [rows back, vocab]."""
        self.round_no += 1
        plan = RoundPlan(self.round_no, tuple(
            StreamEntry(slot, op, first, rows, accepted, 0, self.table.slots[slot].generation)
            for slot, op, first, rows, accepted in entries))
        rows = plan.total_rows
        head = self.stages[0]
        if not rows:  # a close: every stage's table moves, no rows travel
            for stage in self.stages:
                stage.forward(plan, None, ids if stage is head else None)
            return None
        x, sender = head.forward(plan, None, ids), head
        for stage in self.stages[1:]:  # through the wire's bytes, as the ring sends them
            x = stage.forward(plan, stage.rows_from_bytes(sender.rows_to_bytes(x), rows), None)
            sender = stage
        if sender is not head:
            x = head.rows_from_bytes(sender.rows_to_bytes(x), len(plan.returned_rows()))
        return head.logits(x)

    def close(self, slot: int) -> None:
        self.run(slot, Op.CLOSE, 0, 0, 0, [])


def verify_then_keep(ring: Ring, ids: list[int], k: int, accepted: int,
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Slot 0: a prompt, a verify entry of k + 1 rows, a keep of `accepted` rows with one
    decode row. Returns (the verify entry's logits [k + 1, vocab], the last row's [vocab])."""
    prompt, draft, after = ids[:PROMPT], ids[PROMPT:PROMPT + k + 1], ids[PROMPT + k + 1]
    ring.run(0, Op.OPEN, 0, PROMPT, 0, prompt)
    verified = ring.run(0, Op.CONTINUE, PROMPT, k + 1, PROMPT, draft)
    last = ring.run(0, Op.CONTINUE, PROMPT + accepted, 1, accepted, [after])
    ring.close(0)
    return verified, last[0]


def decode_rows(ring: Ring, prompt: list[int], rows: list[int], slot: int = 1) -> np.ndarray:
    """The prompt in `slot`, then `rows` one decode row a round. Each decode row's logits."""
    ring.run(slot, Op.OPEN, 0, len(prompt), 0, prompt)
    out, last_rows = [], len(prompt)
    for at, token in enumerate(rows):
        out.append(ring.run(slot, Op.CONTINUE, len(prompt) + at, 1, last_rows, [token])[0])
        last_rows = 1
    ring.close(slot)
    return np.array(out)


def reference_last(model_dir: Path, ids: list[int]) -> np.ndarray:
    """transformers' float64 logits at the last of `ids`."""
    import torch
    import transformers

    model = transformers.Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0, -1].float().numpy()


def cases(seed: int):
    rng = np.random.default_rng(seed)
    for k in range(1, 5):
        for accepted in range(1, k + 2):
            yield k, accepted, rng.integers(0, 300, PROMPT + k + 2).tolist()


def test_the_checkpoint_has_the_layer_pattern_the_cuts_name(model_dir):
    config = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    assert config.layer_types == (LINEAR_ATTENTION, FULL_ATTENTION) * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_kept_prefix_gives_the_decode_rows_logits(model_dir, backend):
    needs(backend)
    ring = Ring(model_dir, backend)
    for k, accepted, ids in cases(0):
        verified, last = verify_then_keep(ring, ids, k, accepted)
        kept = ids[PROMPT:PROMPT + accepted]
        want = decode_rows(ring, ids[:PROMPT], [*kept, ids[PROMPT + k + 1]])
        where = f"k={k} accepted={accepted}"
        np.testing.assert_allclose(verified[:accepted], want[:accepted], rtol=0,
                                   atol=DECODE_ATOL[backend], err_msg=where)
        np.testing.assert_allclose(last, want[-1], rtol=0, atol=DECODE_ATOL[backend],
                                   err_msg=where)
        # The longest verify entries, against an independent implementation (on the CPU:
        # where fla-core is installed, transformers sends CPU tensors to its Triton kernels).
        if k == 4 and backend != "torch-cuda":
            ref = reference_last(model_dir, [*ids[:PROMPT], *kept, ids[PROMPT + k + 1]])
            np.testing.assert_allclose(last, ref, rtol=0, atol=REFERENCE_ATOL, err_msg=where)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_entries_of_several_lengths_in_one_round_keep_each_slots_rows(model_dir,
                                                                             backend):
    """One round holds a verify entry of 4 rows, a decode row and a verify entry of 2 (the
    recurrence runs row j of every slot at once, a shorter entry's steps dropped); the next
    keeps part of each. Every slot gives what its rows give as decode rows alone."""
    needs(backend)
    ring = Ring(model_dir, backend, parallel=4)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 300, PROMPT + n).tolist() for n in (0, 3, 1)]
    lengths = (4, 1, 2)  # each slot's rows in the round under test
    kept = (2, 1, 1)  # rows the next round keeps of each
    ring.round([(s, Op.OPEN, 0, len(p), 0) for s, p in enumerate(prompts)],
               [t for p in prompts for t in p])
    rows = [rng.integers(0, 300, n).tolist() for n in lengths]
    verified = ring.round([(s, Op.CONTINUE, len(p), n, len(p))
                           for s, (p, n) in enumerate(zip(prompts, lengths, strict=True))],
                          [t for r in rows for t in r])
    after = rng.integers(0, 300, 3).tolist()
    last = ring.round([(s, Op.CONTINUE, len(p) + k, 1, k)
                       for s, (p, k) in enumerate(zip(prompts, kept, strict=True))], after)
    at = 0
    for s, (prompt, n, k) in enumerate(zip(prompts, lengths, kept, strict=True)):
        want = decode_rows(ring, prompt, [*rows[s][:k], after[s]], slot=3)
        where = f"slot {s}: {n} rows, {k} kept"
        np.testing.assert_allclose(verified[at:at + k], want[:k], rtol=0,
                                   atol=DECODE_ATOL[backend], err_msg=where)
        np.testing.assert_allclose(last[s], want[-1], rtol=0, atol=DECODE_ATOL[backend],
                                   err_msg=where)
        at += n


@pytest.mark.parametrize("backend", BACKENDS)
def test_keeps_in_a_row_give_the_decode_rows_logits(model_dir, backend):
    """A verify entry after a partial keep, another after it: each keep starts from the
    state the previous one put back."""
    needs(backend)
    ring = Ring(model_dir, backend)
    ids = np.random.default_rng(1).integers(0, 300, PROMPT + 12).tolist()
    prompt, first, second, after = ids[:PROMPT], ids[PROMPT:PROMPT + 5], \
        ids[PROMPT + 5:PROMPT + 8], ids[PROMPT + 8]
    ring.run(0, Op.OPEN, 0, PROMPT, 0, prompt)
    ring.run(0, Op.CONTINUE, PROMPT, 5, PROMPT, first)  # 5 rows, 2 kept
    ring.run(0, Op.CONTINUE, PROMPT + 2, 3, 2, second)  # 3 rows, 1 kept
    last = ring.run(0, Op.CONTINUE, PROMPT + 3, 1, 1, [after])[0]
    ring.close(0)
    want = decode_rows(ring, prompt, [*first[:2], second[0], after])[-1]
    np.testing.assert_allclose(last, want, rtol=0, atol=DECODE_ATOL[backend])


@pytest.mark.parametrize("cut", CUTS.values(), ids=CUTS.keys())
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_stages_keep_the_whole_stages_bits(model_dir, backend, cut):
    """On one backend a pipeline gives the same bits as one process (DESIGN, Exactness),
    a keep of part of a verify entry included."""
    needs(backend)
    whole, split = Ring(model_dir, backend), Ring(model_dir, backend, (cut,))
    for k, accepted, ids in cases(2):
        if k not in (1, 4):  # the shortest and the longest, every keep of each
            continue
        want = verify_then_keep(whole, ids, k, accepted)
        got = verify_then_keep(split, ids, k, accepted)
        assert got[0].tobytes() == want[0].tobytes(), f"k={k} accepted={accepted}"
        assert got[1].tobytes() == want[1].tobytes(), f"k={k} accepted={accepted}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rollback_after_an_entry_that_is_not_a_verify_entry_is_refused(model_dir, backend):
    needs(backend)
    ring = Ring(model_dir, backend)
    ids = list(range(40))
    ring.run(0, Op.OPEN, 0, 8, 0, ids[:8])
    ring.run(0, Op.CONTINUE, 8, 12, 8, ids[8:20])  # a prompt chunk of 12 rows: no verify
    before = ring.table.snapshot()
    with pytest.raises(BadEntry, match="state cannot be trimmed after an entry that is not"):
        ring.run(0, Op.CONTINUE, 18, 1, 10, ids[18:19])
    assert ring.table.snapshot() == before
    ring.run(0, Op.CONTINUE, 20, 3, 12, ids[20:23])  # a verify entry: keeps at least a row
    with pytest.raises(BadEntry, match="keeps at least its first row"):
        ring.run(0, Op.CONTINUE, 20, 1, 0, ids[20:21])
