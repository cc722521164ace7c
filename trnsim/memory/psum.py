"""PSUM: the TensorE accumulator memory.

Per partition it is ``banks`` banks of ``bank_bytes`` (8 x 2 KiB on NC-v2..v4, datasheet §5).
Allocations are whole banks, as an accumulation group owns a bank. Matmul outputs must stay
inside one bank unless the core streams more than a bank per instruction (NC-v4).
"""

from __future__ import annotations

from typing import Iterator

from ..config import ChipConfig
from ..isa import KernelError, TileAP
from .sbuf import OnChipAllocator

__all__ = ["PsumAllocator", "check_matmul_dst"]


class PsumAllocator(OnChipAllocator):
    def __init__(self, config: ChipConfig, uids: Iterator[int] | None = None):
        p = config.core.psum
        super().__init__("psum", p.partitions, p.partition_bytes, p.bank_bytes,
                         f"{config.name} ({p.banks} banks x {p.bank_bytes // 1024} KiB per partition)", uids)


def check_matmul_dst(dst: TileAP, config: ChipConfig, what: str) -> None:
    """A matmul/transpose result must not straddle PSUM banks on cores whose moving tile fits
    one bank (NC-v2/v3); NC-v4 may span banks but not partitions' end."""
    bank = config.core.psum.bank_bytes
    lo, hi = dst.byte_span()
    multi_bank = config.core.tensor.moving_max_free * 4 > bank
    if not multi_bank and lo // bank != (hi - 1) // bank:
        raise KernelError(
            f"{what}: PSUM destination '{dst.name}' spans bytes {lo}..{hi - 1}, crossing a {bank}-byte bank "
            f"boundary; a {config.name} matmul writes one PSUM bank (at most {bank // 4} fp32 per partition)"
        )
