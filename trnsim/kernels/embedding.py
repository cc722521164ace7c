"""Embedding lookup ``out[t, :] = table[ids[t], :]``, written as an NKI author would.

A lookup is pure data movement, so the kernel is three DMA streams that overlap:

* the token ids of a tile (128 tokens, one per partition) come in with an ordinary DMA on the
  Sync queue, as a ``[tokens, 1]`` int32 column;
* GpSimd's software descriptor generator gathers the table rows those ids name straight from
  HBM into SBUF (indirect DMA, one descriptor per row, datasheet §6); it reads the ids when the
  transfer runs, so nothing on the host needs to know them;
* the gathered rows go back to HBM on their own queue, triggered by the otherwise idle Scalar
  sequencer, so a store waiting for its gather never holds up the next tile's id load.

Ids and rows live in ``bufs``-deep rotating pools (double buffered by default), so the gather
of tile ``i+1`` overlaps the store of tile ``i``. The last tile may be ragged. When a row is
wider than the row pool's share of SBUF, the embedding dim is split into column blocks, each
gathered with the same id tile.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..config import ChipConfig
from ..isa import KernelError
from ..builder.kernel import Kernel, checked_int
from ..native.dtypes import get_dtype
from .reference import round_to
from .registry import register_kernel, split_dims

__all__ = ["build_embedding"]

DTYPES = ("bf16", "fp16", "fp32")


def _inputs(shape: tuple[int, ...], dtype: str, params: Mapping[str, Any], rng: np.random.Generator
            ) -> dict[str, np.ndarray]:
    tokens, vocab, dim = shape
    return {"ids": rng.integers(0, vocab, size=tokens, dtype=np.int32),
            "table": rng.standard_normal((vocab, dim), dtype=np.float32)}


def _reference(inputs: Mapping[str, np.ndarray], shape: tuple[int, ...], dtype: str, params: Mapping[str, Any]
               ) -> dict[str, np.ndarray]:
    return {"out": round_to(inputs["table"], dtype)[inputs["ids"]]}


def _exact(dtype: str) -> tuple[float, float]:
    """A lookup copies bits: the output must equal the rounded table rows exactly."""
    return (0.0, 0.0)


@register_kernel("embedding", dims="TOKENSxVOCABxDIM", dtypes=DTYPES, default_shape=(2048, 32000, 2048),
                 summary="out[t,:] = table[ids[t],:], rows gathered by indirect DMA", params={"bufs": 2},
                 inputs=_inputs, reference=_reference, tolerance=_exact,
                 split=split_dims(0))
def build_embedding(tokens: int, vocab: int, dim: int, dtype: str = "bf16", config: ChipConfig | str = "trn2",
                    bufs: int = 2, name: str = "embedding") -> Kernel:
    kern = Kernel(name, config)
    cfg = kern.config
    dt = get_dtype(dtype)
    if dt.short not in DTYPES:
        raise KernelError(f"embedding: dtype {dt.short} not supported; expected one of {', '.join(DTYPES)}")
    bufs = checked_int(bufs, "embedding: bufs", lo=1)
    parts = cfg.core.sbuf.partitions
    ids = kern.input("ids", (tokens,), "int32")
    table = kern.input("table", (vocab, dim), dt)
    out = kern.output("out", (tokens, dim), dt)

    # the row pool may take half of each partition; the rest is left for the ids and headroom
    block = max(1, min(dim, cfg.core.sbuf.partition_bytes // 2 // (bufs * dt.itemsize)))
    id_pool = kern.tile_pool("ids", bufs=bufs)
    row_pool = kern.tile_pool("rows", bufs=bufs)
    for t0 in range(0, tokens, parts):
        n = min(parts, tokens - t0)
        id_tile = id_pool.tile((parts, 1), "int32")[:n]
        kern.dma_copy(id_tile, ids[t0:t0 + n].reshape(n, 1), engine="sync", queue=0)
        for d0 in range(0, dim, block):
            d1 = min(dim, d0 + block)
            rows = row_pool.tile((parts, block), dt)[:n, :d1 - d0]
            kern.dma_gather(rows, table[:, d0:d1], id_tile, engine="gpsimd", queue=0)
            kern.dma_copy(out[t0:t0 + n, d0:d1], rows, engine="scalar", queue=0)
    return kern
