"""The generic streaming kernel: what an op costs when no library kernel expresses it.

Its input elements stream HBM -> SBUF through DMA, its work elements pass through the engine that
would run them on a NeuronCore (ScalarE for table-driven activations, GpSimd for index, random and
scan ops, VectorE for the rest), and its output elements stream back, on 128 partitions, tiled and
triple-buffered. That is an honest lower bound of what a compiler would emit for such an op;
reports mark the ops charged this way ``generic``. It is not in the CLI's registry: it has no
values of its own to check (it stands in for an op's cost, not its result).
"""

from __future__ import annotations

from typing import Sequence

from ..config import ChipConfig
from ..builder.kernel import Kernel
from ..native.dtypes import get_dtype

__all__ = ["STREAM", "build_stream", "split_stream", "stream_geometry", "TILE_FREE"]

STREAM = "stream"  # the name a KernelSpec uses for this kernel
ENGINES = ("vector", "scalar", "gpsimd")

# Elements per partition per tile: 2048 fp32 = 8 KiB a partition, well above the 4 KiB per
# partition where DMA nears saturation (datasheet §6), and small enough to triple-buffer.
TILE_FREE = 2048


def _cols(n: int, p: int) -> int:
    return max(1, -(-n // p))


def build_stream(n_in: int, work: int, n_out: int, dtype: str, config: ChipConfig, engine: str = "vector",
                 binary: bool = False, fn: str = "exp", label: str = "stream") -> Kernel:
    """``n_in`` elements of ``dtype`` HBM->SBUF, ``work`` elements through ``engine`` (an
    activation ``fn`` on ScalarE; a tensor_tensor when ``binary`` on VectorE; else a
    tensor_scalar), ``n_out`` elements SBUF->HBM."""
    if engine not in ENGINES:
        raise ValueError(f"stream kernel: engine '{engine}' is not one of {', '.join(ENGINES)}")
    k = Kernel(label, config)
    p = config.core.sbuf.partitions
    get_dtype(dtype)
    cin = _cols(n_in, p) if n_in else 0
    cout = _cols(n_out, p) if n_out else 0
    cw = _cols(work, p) if work else 0
    width = min(TILE_FREE, max(cin, cw, cout, 1))
    x = k.input("x", (p, cin), dtype) if cin else None
    y = k.output("y", (p, cout), dtype) if cout else None
    loads = k.tile_pool("in", bufs=3)
    results = k.tile_pool("out", bufs=3)
    last_in = last_res = None
    for c0 in range(0, max(cin, cw, cout, 1), width):
        if x is not None and c0 < cin:
            w = min(width, cin - c0)
            last_in = loads.tile((p, width), dtype)
            k.dma_copy(last_in[:, :w], x[:, c0:c0 + w], queue=0)
        if c0 < cw:
            w = min(width, cw - c0)
            res = results.tile((p, width), dtype)
            dst = res[:, :w]
            if last_in is None:
                k.memset(dst, 0.0, engine="gpsimd" if engine == "gpsimd" else "vector")
            else:
                src = last_in[:, :w]
                if engine == "scalar":
                    k.activation(dst, fn, src)
                elif binary and engine == "vector":
                    k.tensor_tensor(dst, src, src, "add")
                else:
                    k.tensor_scalar(dst, src, "multiply", 1.0, engine=engine)
            last_res = res
        if y is not None and c0 < cout:
            w = min(width, cout - c0)
            src_tile = last_res if last_res is not None else last_in
            if src_tile is None:
                src_tile = results.tile((p, width), dtype)
                k.memset(src_tile[:, :w], 0.0)
            k.dma_copy(y[:, c0:c0 + w], src_tile[:, :w], queue=1)
    return k


def stream_geometry(shape: Sequence[int], partitions: int) -> tuple[int, ...]:
    """What :func:`build_stream` reads of its (in, work, out) element counts: the columns each
    takes on ``partitions`` partitions (0: none). Its kernel is a function of these, the dtype,
    the config and the parameters only, so two shapes with the same geometry build the same
    instructions and cost the same (:meth:`trnsim.device.Device.cost` simulates one of them)."""
    return tuple(_cols(n, partitions) if n else 0 for n in shape)


def split_stream(shape: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """The stream's (in, work, out) elements shared out over ``n`` physical cores."""
    parts = [tuple(-(-d // n) if i < n - 1 else d - (n - 1) * -(-d // n) for d in shape) for i in range(n)]
    return [tuple(max(0, d) for d in s) for s in parts if any(d > 0 for d in s)]
