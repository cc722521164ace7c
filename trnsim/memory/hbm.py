"""Device memory (HBM): capacity accounting and which stack serves which core.

HBM bandwidth is a chip resource shared by the cores attached to a stack (two physical cores per
stack on Trn2, datasheet §1/S20), modelled in :mod:`trnsim.sim` as a FIFO bandwidth pipe per stack.
"""

from __future__ import annotations

import functools
from fractions import Fraction

from ..config import ChipConfig, format_quantity
from ..isa import KernelError

__all__ = ["check_capacity", "stack_of_core", "stack_bandwidth"]


def stack_of_core(config: ChipConfig, core: int) -> int:
    stacks, cores = config.chip.hbm.stacks, config.chip.cores
    return core * stacks // cores if stacks <= cores else core


def stack_bandwidth(config: ChipConfig) -> Fraction:
    """Bytes/s of one stack (the chip total split evenly), exact."""
    hbm = config.chip.hbm
    return _stack_bandwidth(hbm.bandwidth, hbm.stacks)


@functools.lru_cache(maxsize=64)
def _stack_bandwidth(bandwidth: int, stacks: int) -> Fraction:
    # (every simulate() call makes its pipes from it: a Fraction's normalisation each time was
    # ~5% of simulating a small kernel)
    return Fraction(bandwidth, stacks)


def check_capacity(config: ChipConfig, nbytes: int, what: str) -> None:
    cap = config.chip.hbm.capacity
    if nbytes > cap:
        raise KernelError(
            f"out of device memory: {what} needs {format_quantity(nbytes, 'bytes')}, "
            f"but {config.name} has {format_quantity(cap, 'bytes')} of HBM (chip.hbm.capacity)"
        )
