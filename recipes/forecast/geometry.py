"""The block geometry of the policy the heads are trained for: how pages and blocks are laid out."""

from __future__ import annotations

from dataclasses import dataclass

from policyzoo.kv.forecast import Forecast


@dataclass(frozen=True)
class Geometry:
    """The policy's block geometry (tokens): the recipe lays pages and blocks out exactly as the
    `Forecast` that will load the heads does, so it reads them off such a policy."""

    block: int = 64
    kernel: int = 32
    stride: int = 16
    sinks: int = 64
    window: int = 64

    @classmethod
    def of(cls, policy: Forecast) -> "Geometry":
        return cls(policy.block, policy.kernel, policy.stride, policy.sinks, policy.window)

    @property
    def kernel_pages(self) -> int:
        return self.kernel // self.stride

    @property
    def block_pages(self) -> int:
        return self.block // self.stride

    def n_blocks(self, offset: int, tokens: int) -> int:
        """Blocks of a cache holding ``tokens`` tokens from slot ``offset``."""
        return -(-(offset + tokens) // self.block)


DEFAULT_GEOMETRY = Geometry.of(Forecast())
