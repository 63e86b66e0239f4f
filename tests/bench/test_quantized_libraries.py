"""bench/quantized.py --libraries: the parts that run without a GPU.

The libraries themselves (gemlite, torchao) run on CUDA only; here the comparison around
them is held to account: its reference is the stage's own dequantization, its error and
repeatability columns catch a wrong or unsteady way, a library that refuses a weight is
named and left out, and the CPU run prints one line per library it cannot run.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from bench.quantized import (
    Affine,
    LibraryWeight,
    accuracy,
    affine_weights,
    build,
    inputs_for,
    layer_linears,
    main,
)
from engine.backends.pytorch.dequant import dequantize
from engine.checkpoint.quant_config import QuantParams

CPU = torch.device("cpu")
PARAMS = QuantParams(64, 4)


def tiny_layer(dtype: torch.dtype = torch.bfloat16) -> list[Affine]:
    return list(affine_weights("tiny", 1, PARAMS, dtype, CPU))


def test_the_dense_way_is_the_stages_own_dequantization():
    for weight in tiny_layer():
        want = dequantize(weight.words, weight.scales, weight.biases, PARAMS)
        assert torch.equal(weight.dense(), want)


def test_the_error_column_tells_a_right_mapping_from_a_wrong_one():
    weights = tiny_layer()
    inputs = inputs_for([w.dense() for w in weights], torch.randn(3, 256, dtype=torch.bfloat16))
    reference = [F.linear(inputs[w.codes.shape[1]].float(), w.dense().float()) for w in weights]
    _, ours, ours_steady = accuracy([w.ours() for w in weights], inputs, reference)

    def bias_dropped(weight: Affine) -> LibraryWeight:
        # The mistake the bench guards against: an affine group mapped without its bias.
        codes = weight.codes.to(weight.scales.dtype).view(*weight.scales.shape, -1)
        w = (codes * weight.scales[..., None]).view(weight.codes.shape)
        return LibraryWeight(lambda x: F.linear(x, w), weight.codes.shape, w.nbytes)

    _, wrong, _ = accuracy([bias_dropped(w) for w in weights], inputs, reference)
    assert ours_steady
    assert ours < 0.02  # bfloat16 rounding of weights and outputs
    assert wrong > 10 * ours


def test_a_way_that_answers_differently_twice_is_marked_unrepeatable():
    weights = tiny_layer()
    inputs = inputs_for([w.dense() for w in weights], torch.randn(1, 256, dtype=torch.bfloat16))
    reference = [F.linear(inputs[w.codes.shape[1]].float(), w.dense().float()) for w in weights]
    generator = torch.Generator().manual_seed(0)

    def unsteady(weight: Affine) -> LibraryWeight:
        # An injected fault: a last-bit wobble, as an unordered atomic reduction could give.
        dense = weight.dense()
        return LibraryWeight(lambda x: F.linear(x, dense) * (1 + torch.rand(
            (), generator=generator).item() * 2**-6), dense.shape, dense.nbytes)

    assert accuracy([unsteady(w) for w in weights], inputs, reference)[2] is False
    assert accuracy([w.dense() for w in weights], inputs, reference)[2] is True


def test_a_library_refusing_a_weight_is_named_and_the_other_ways_are_built():
    def refuses_wide(weight: Affine) -> torch.Tensor:  # an injected fault on the wide linears
        if weight.codes.shape[1] > 256:
            raise ValueError("width not supported")
        return weight.dense()

    ways, failed, stored = build("tiny", 2, PARAMS, torch.bfloat16, CPU,
                                 {"dense": Affine.dense, "picky": refuses_wide})
    assert failed == {"picky": "ValueError: width not supported"}
    assert list(ways) == ["dense"] and len(ways["dense"]) == 2 * len(layer_linears("tiny"))
    assert stored == sum(w.stored_bytes for w in affine_weights("tiny", 2, PARAMS,
                                                                  torch.bfloat16, CPU))


def test_the_cpu_run_prints_a_line_per_library_and_times_dense_and_ours(capsys):
    assert main(["--libraries", "--shape", "tiny", "--repeats", "2", "--batches", "1,4"]) == 0
    out = capsys.readouterr().out
    for way in ("gemlite", "torchao int4 tile_packed_to_4d", "torchao int4 plain"):
        assert len(re.findall(rf"^# skipped {way}: ", out, re.MULTILINE)) == 1, out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ")][1:]
    assert [(r[0].strip("| "), r[1]) for r in rows] == [
        ("1", "dense"), ("1", "ours (torch int4)"), ("4", "dense"), ("4", "ours (torch int4)")]
    for row in rows:
        error_share, repeatable = float(row[-2]), row[-1].strip(" |")
        assert 0 < error_share < 0.02 and repeatable == "yes", row
