"""Rows between a PyTorch stage's device and the link: on CUDA, pinned host memory both ways.

Out: the rows' bytes are copied into a pinned staging buffer by an asynchronous copy queued
right behind the layers that made them, and the host waits on that copy's event only (not
on the device), so the rows leave as soon as their layers finish. A pageable copy would
stage through the driver's own buffer, synchronously, at a fraction of the bus's speed.

In: the link receives into a pinned twin of the ring's receive buffer (`landing`), and the
rows go to the device by an asynchronous copy from it; the next `landing` waits for that
copy, so the link never overwrites bytes a copy has yet to read.

On the CPU the rows' own memory is the wire's bytes; on other devices (MPS) a plain copy.
"""

from __future__ import annotations

import numpy as np
import torch

STAGING_BUFFERS = 2  # a view stays valid through the next `to_wire`, for a caller that sends late


class RowTransfer:
    def __init__(self, device: torch.device, dtype: torch.dtype, bound_bytes: int) -> None:
        self.device = device
        self.dtype = dtype
        self.bound_bytes = bound_bytes  # the largest round's rows: what staging holds at first
        self._cuda = device.type == "cuda"
        self._staging: list[torch.Tensor] = []
        self._turn = 0
        self._copied_out = torch.cuda.Event() if self._cuda else None
        self._copied_in = torch.cuda.Event() if self._cuda else None
        self._copying_in = False
        # id(ring buffer) -> (that buffer, kept alive so the id is never reused; its twin)
        self._landings: dict[int, tuple[object, torch.Tensor]] = {}

    def to_wire(self, rows: torch.Tensor) -> memoryview:
        """Rows [n, hidden] as the wire's bytes; on CUDA a view of pinned staging memory,
        valid until the second `to_wire` after this one."""
        raw = rows.contiguous().view(torch.uint8).view(-1)  # [n * hidden * itemsize]
        if self.device.type == "cpu":
            return memoryview(raw.numpy())
        if not self._cuda:
            return memoryview(raw.cpu().numpy())
        with torch.inference_mode():  # staging made and written in one mode, always
            staging = self._next_staging(raw.numel())[: raw.numel()]
            staging.copy_(raw, non_blocking=True)
        # The device's stream, whichever device is current: the copy was queued there.
        self._copied_out.record(torch.cuda.current_stream(self.device))
        self._copied_out.synchronize()  # this stream up to the copy: the rows' own layers
        return memoryview(staging.numpy())

    def landing(self, buffer: bytearray | memoryview) -> memoryview:
        """Where the link should receive what the ring would put in `buffer`: `buffer`
        itself, or on CUDA its pinned twin (free again: the last copy from it is done)."""
        if not self._cuda:
            return memoryview(buffer).cast("B")
        if self._copying_in:
            self._copied_in.synchronize()
            self._copying_in = False
        held = self._landings.get(id(buffer))
        if held is None or held[0] is not buffer:
            size = memoryview(buffer).nbytes
            held = (buffer, torch.empty(size, dtype=torch.uint8, pin_memory=True))
            self._landings[id(buffer)] = held
        return memoryview(held[1].numpy())

    def from_wire(self, raw: memoryview, n_rows: int) -> torch.Tensor:
        """Rows [n_rows, hidden] on the device from the wire's bytes, never aliasing `raw`."""
        pinned = self._pinned_holding(raw) if self._cuda else None
        if pinned is not None:
            rows = pinned.view(self.dtype).view(n_rows, -1).to(self.device, non_blocking=True)
            self._copied_in.record(torch.cuda.current_stream(self.device))
            self._copying_in = True
            return rows
        if raw.readonly:  # torch views only writable memory without a warning
            raw = memoryview(bytearray(raw))
        rows = torch.frombuffer(raw, dtype=self.dtype).view(n_rows, -1)
        # frombuffer aliases the receive buffer, which the link reuses: always take a copy.
        return rows.to(self.device, copy=True)

    def _next_staging(self, nbytes: int) -> torch.Tensor:
        if len(self._staging) < STAGING_BUFFERS:
            self._staging.append(torch.empty(max(nbytes, self.bound_bytes), dtype=torch.uint8,
                                             pin_memory=True))
        self._turn = (self._turn + 1) % len(self._staging)
        staging = self._staging[self._turn]
        if staging.numel() < nbytes:  # a round beyond the bound: grow this one
            staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._staging[self._turn] = staging
        return staging

    def _pinned_holding(self, raw: memoryview) -> torch.Tensor | None:
        """The slice of a pinned twin that `raw` views, if it views one."""
        start = np.frombuffer(raw, dtype=np.uint8).__array_interface__["data"][0]
        for _buffer, twin in self._landings.values():
            offset = start - twin.data_ptr()
            if 0 <= offset and offset + raw.nbytes <= twin.numel():
                return twin[offset: offset + raw.nbytes]
        return None
