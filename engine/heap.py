"""Hand the C heap's freed pages back to the system once a stage has loaded (glibc only).

Loading a packed stage makes temporaries (a weight's codes, unpacked a chunk at a time, and
the bytes read from the checkpoint) interleaved with the allocations it keeps. glibc's malloc
keeps what is freed: blocks under its mmap threshold (which rises, up to 32 MiB, each time a
larger mmapped block is freed) stay in the heap, so the process stays resident at its
loading high-water mark, not at what the stage holds. Measured on a 16-layer, hidden-1536,
128k-vocabulary 4-bit stage: 749 MiB resident after load, 583 after `malloc_trim(0)`, for
335 MiB of weights over a 232 MiB process (docs/quantized.md, "Resident memory").

`malloc_trim(0)` returns every whole free page in every arena (glibc 2.8 and later). macOS's
allocator and musl return freed pages themselves and have no such call: there it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import structlog

log = structlog.get_logger()


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    """glibc's malloc_trim, or None where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # musl has no malloc_trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed() -> bool:
    """Return the heap's free pages to the system; whether anything could be asked."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
