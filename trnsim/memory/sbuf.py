"""On-chip memory allocation (SBUF; PSUM builds on it).

An allocation takes the same byte range on each of its partitions. Placement is first-fit by
address, deterministic, and capacity is enforced: a tile that does not fit is a KernelError that
says what is in use, never a silent spill (the NKI CPU simulator does not check this at all).
"""

from __future__ import annotations

import bisect
import itertools
from typing import Iterator

from ..config import format_quantity
from ..isa import Allocation, KernelError

__all__ = ["OnChipAllocator"]


class OnChipAllocator:
    """First-fit allocator over ``partitions`` x ``partition_bytes``.

    ``granule`` is the address alignment and size rounding in bytes.
    """

    def __init__(self, space: str, partitions: int, partition_bytes: int, granule: int, label: str,
                 uids: Iterator[int] | None = None):
        self.space = space
        self.partitions = partitions
        self.partition_bytes = partition_bytes
        self.granule = granule
        self.label = label  # for messages, e.g. "SBUF (trn2: 224 KiB per partition)"
        self.live: list[Allocation] = []
        self.peak_bytes = 0  # peak bytes in use on the fullest partition
        self.high_water = 0  # highest byte address any allocation reached, +1 (what values need)
        # bytes in use per partition: while every allocation so far spans all the partitions
        # (most do), one level stands for them all and the list is made at the first that does not
        self._usage: list[int] | None = None
        self._level = 0
        self._spans: list[tuple[int, int, int, int]] = []
        self._uids = uids if uids is not None else itertools.count(1)  # unique across memories

    def _round(self, nbytes: int) -> int:
        g = self.granule
        return -(-nbytes // g) * g

    def allocate(self, name: str, p_start: int, p_count: int, nbytes: int, addr: int | None = None) -> Allocation:
        """Place ``nbytes`` per partition on partitions [p_start, p_start + p_count): first-fit, or
        at byte address ``addr`` (a pass that lays tiles out itself, :mod:`trnsim.schedule`)."""
        if p_count < 1 or p_start < 0 or p_start + p_count > self.partitions:
            raise KernelError(
                f"{self.space.upper()} tile '{name}' needs partitions {p_start}..{p_start + p_count - 1}, "
                f"but the {self.space.upper()} has {self.partitions} partitions (0..{self.partitions - 1})"
            )
        size = self._round(max(nbytes, 1))
        if size > self.partition_bytes:
            raise KernelError(
                f"{self.space.upper()} tile '{name}' needs {format_quantity(size, 'bytes')} per partition, "
                f"more than the {format_quantity(self.partition_bytes, 'bytes')} a partition holds on {self.label}"
            )
        p_end = p_start + p_count
        if addr is not None:
            taken = [(lo, hi) for lo, hi, ps, pe in self._spans
                     if ps < p_end and p_start < pe and lo < addr + size and addr < hi]
            if addr % self.granule or addr + size > self.partition_bytes or taken:
                raise KernelError(f"{self.space.upper()} tile '{name}' cannot go at byte {addr} of partitions "
                                  f"{p_start}..{p_end - 1}: " + (f"bytes {taken[0][0]}..{taken[0][1] - 1} are in use"
                                                                 if taken else "misaligned or past the end"))
        else:
            addr = self._first_fit(p_start, p_end, size)
        if addr + size > self.partition_bytes:
            used = self.used_bytes(p_start, p_count)
            holders = ", ".join(
                f"'{a.name}' {format_quantity(self._round(a.nbytes), 'bytes')}"
                for a in sorted(self.live, key=lambda a: -a.nbytes)[:4]
                if a.p_start < p_end and p_start < a.p_start + a.p_count
            )
            more = "" if len(self.live) <= 4 else f" and {len(self.live) - 4} more"
            raise KernelError(
                f"{self.space.upper()} is full: tile '{name}' needs {format_quantity(size, 'bytes')} per partition "
                f"on partitions {p_start}..{p_end - 1}, but {format_quantity(used, 'bytes')} of "
                f"{format_quantity(self.partition_bytes, 'bytes')} are in use ({holders}{more}) on {self.label}"
            )
        alloc = Allocation(self.space, name, p_start, p_count, addr, nbytes, next(self._uids))
        self.live.append(alloc)
        bisect.insort(self._spans, (addr, addr + size, p_start, p_end))
        self.high_water = max(self.high_water, addr + size)
        if self._usage is None and p_start == 0 and p_end == self.partitions:
            self._level += size
            if self._level > self.peak_bytes:
                self.peak_bytes = self._level
            return alloc
        use = self._per_partition()
        now = [u + size for u in use[p_start:p_end]]  # a slice at once: a tile spans up to 128 partitions
        use[p_start:p_end] = now
        self.peak_bytes = max(self.peak_bytes, max(now))
        return alloc

    def _per_partition(self) -> list[int]:
        if self._usage is None:
            self._usage = [self._level] * self.partitions
        return self._usage

    def _first_fit(self, p_start: int, p_end: int, size: int) -> int:
        addr = 0
        # self._spans: (addr, end, p_start, p_end) of live allocations, sorted by address
        for lo, hi, ps, pe in self._spans:
            if ps >= p_end or p_start >= pe:
                continue
            if addr + size <= lo:
                break
            if hi > addr:
                addr = hi
        return addr

    def free(self, alloc: Allocation) -> None:
        if not alloc.live:
            raise KernelError(f"{self.space.upper()} tile '{alloc.name}' was already freed")
        alloc.live = False
        self.live.remove(alloc)
        size = self._round(alloc.nbytes)
        self._spans.remove((alloc.addr, alloc.addr + size, alloc.p_start, alloc.p_start + alloc.p_count))
        p0, p1 = alloc.p_start, alloc.p_start + alloc.p_count
        if self._usage is None and p0 == 0 and p1 == self.partitions:
            self._level -= size
            return
        use = self._per_partition()
        use[p0:p1] = [u - size for u in use[p0:p1]]

    def used_bytes(self, p_start: int, p_count: int) -> int:
        """Bytes in use on the fullest partition of the range."""
        if self._usage is None:
            return self._level
        return max(self._usage[p_start:p_start + p_count])
