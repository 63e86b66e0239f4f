"""The rows stages exchange: element type, width and planes, one object for every backend.

Rows cross the ring as raw little-endian values, plane-major (RFC 6.4). The element type
is the wire's `Dtype`; its label is also the name PyTorch and MLX give the type
(`torch.bfloat16`, `mx.bfloat16`), so a backend finds its own type by that name instead
of keeping a table of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.backend_names import Dtype
from engine.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class RowFormat:
    """[rows, planes x hidden] values of one `dtype`: what a stage sends and expects."""

    dtype: Dtype
    hidden: int
    planes: int = 1  # Llama-style rows carry one plane: the residual stream

    @classmethod
    def of(cls, config: ModelConfig) -> RowFormat:
        """A model's rows, in config.json's dtype; a dtype the wire cannot carry is refused."""
        try:
            dtype = Dtype[config.dtype.upper()]
        except KeyError:
            known = ", ".join(d.label for d in Dtype)
            raise ConfigError(f"config.json: dtype {config.dtype!r} is not supported "
                              f"(supported: {known})") from None
        return cls(dtype, config.hidden_size)

    @property
    def name(self) -> str:
        """The element type's name, as the wire, PyTorch and MLX spell it."""
        return self.dtype.label

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def raw_numpy(self) -> str:
        """numpy's name for an unsigned integer as wide as one value ("<u2"): carries the
        bits through numpy, which has no bfloat16. A name, not a dtype, so the supervisor
        reads row formats without numpy."""
        return f"<u{self.itemsize}"

    def nbytes(self, rows: int) -> int:
        """Bytes of `rows` rows on the wire."""
        return rows * self.planes * self.hidden * self.itemsize
