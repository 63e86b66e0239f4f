"""Rows between a PyTorch device and the link: the wire's bytes, bit for bit, both ways; on
CUDA through pinned staging and landing memory (skipped where there is no CUDA device)."""

from __future__ import annotations

import pytest
import torch

from engine.backends.pytorch.row_transfer import RowTransfer

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


def rows_of(n: int, hidden: int, device: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, hidden, generator=generator).to(torch.bfloat16).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_cross_bit_for_bit_through_the_landing(device):
    transfer = RowTransfer(torch.device(device), torch.bfloat16, bound_bytes=64 * 32 * 2)
    ring_buffer = bytearray(64 * 32 * 2)
    for n, seed in ((1, 1), (64, 2), (3, 3)):
        rows = rows_of(n, 32, device, seed)
        wire = transfer.to_wire(rows)
        assert bytes(wire) == rows.cpu().view(torch.uint8).numpy().tobytes()
        landing = transfer.landing(ring_buffer)
        landing[: len(wire)] = wire  # what the link does with a ROWS payload
        back = transfer.from_wire(landing[: len(wire)], n)
        assert back.device.type == device and torch.equal(back.cpu(), rows.cpu())
        landing[: len(wire)] = bytes(len(wire))  # the next round's bytes: the rows kept theirs
        assert torch.equal(back.cpu(), rows.cpu())


def test_on_the_cpu_the_landing_is_the_ring_buffer_itself():
    transfer = RowTransfer(torch.device("cpu"), torch.bfloat16, bound_bytes=64)
    ring_buffer = bytearray(64)
    transfer.landing(ring_buffer)[:4] = b"\x01\x02\x03\x04"
    assert ring_buffer[:4] == b"\x01\x02\x03\x04"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stages_and_lands_in_pinned_memory_one_twin_a_ring_buffer():
    transfer = RowTransfer(torch.device("cuda"), torch.bfloat16, bound_bytes=1 << 16)
    first, second = bytearray(1 << 16), bytearray(1 << 16)
    transfer.landing(first)[:3] = b"abc"
    transfer.landing(second)[:3] = b"xyz"
    twins = [twin for _buffer, twin in transfer._landings.values()]
    assert len(twins) == 2 and all(twin.is_pinned() for twin in twins)
    assert bytes(transfer.landing(first)[:3]) == b"abc"  # the same twin again, not the buffer
    assert first[:3] == bytes(3)
    a = transfer.to_wire(rows_of(2, 32, "cuda", 4))
    b = transfer.to_wire(rows_of(2, 32, "cuda", 5))
    assert len(transfer._staging) == 2 and all(s.is_pinned() for s in transfer._staging)
    assert bytes(a) == rows_of(2, 32, "cpu", 4).view(torch.uint8).numpy().tobytes()  # still valid
    assert bytes(b) == rows_of(2, 32, "cpu", 5).view(torch.uint8).numpy().tobytes()
