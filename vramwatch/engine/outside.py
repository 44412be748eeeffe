"""Outside-allocator leak detector: device used - reserved rising while the allocator is flat.

CUDA context, NCCL buffers, cuBLAS workspaces, driver or GL leaks grow device memory that
the allocator never sees. The same leak test as the allocator's runs on the block minimum
of ``nvml_used - reserved`` once its own CUSUM leaves the plateau level. Off (and saying
so in ``summary()["detectors_off"]``) when either is not measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramwatch.engine.blocks import Block, Trend
from vramwatch.engine.context import Context, Cusum


@dataclass(slots=True)
class OutsideLeakDetector:
    cusum: Cusum = field(default_factory=Cusum)

    def reset(self, onset: int) -> None:
        self.cusum.reset(onset)

    @property
    def onset(self) -> int:
        return self.cusum.onset

    def check(self, ctx: Context, block: Block) -> Trend | None:
        """A leak outside the allocator at this block (from the CUSUM's onset), or None."""
        plateau = ctx.plateau
        if plateau is None or plateau.outside is None or block.outside is None:
            return None
        if not self.cusum.step(block.outside - plateau.outside, ctx.tol, block):
            return None
        return ctx.pyramid.trend("outside", self.cusum.onset, ctx.min_span(), ctx.config.half_ratio, ctx.tol)
