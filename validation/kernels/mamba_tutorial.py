"""The fused Mamba-v1 layer of AWS's NKI tutorial, written for trnsim's builder from the tutorial's
description, so the ledger can predict the figures published for its three kernel versions.

Source: aws-neuron-sdk ``nki/guides/tutorials/fused_mamba.rst`` at 81ce03ae (datasheet V2). The
layer, per batch ``b``, state ``n``, channel ``c`` and time ``t``::

    deltaA  = exp(delta[b, c, t] * A[c, n])
    deltaBu = delta[b, c, t] * u[b, c, t] * B[b, n, t]
    scan[t] = deltaA[t] * scan[t-1] + deltaBu[t]          (scan[-1] = 0)
    out[b, c, t] = sum over n of C[b, n, t] * scan[t]

with channels on the partitions (128 per tile) and time on the free axis, as the tutorial maps it:
``exp(delta * A)`` is one ScalarE activation with a per-partition scale, the products are VectorE
``tensor_tensor`` instructions, the recurrence one VectorE ``tensor_tensor_scan``, and a row of B or
C is broadcast over the partitions by a TensorE matmul with a ones vector (what ``nl.broadcast_to``
of a partition-1 tile costs), read from PSUM. All tensors are fp32. Called as
``build(batch, channels, seq, state, dtype=..., config=...)``; the loop structure is the tutorial's
per version, the code is ours:

* ``version=1`` - batch, then state, then channel tile: ``delta`` and ``u`` are loaded again for
  every state, and every channel tile's running sum stays in SBUF until the end;
* ``version=2`` - batch, then channel tile (``delta`` and ``u`` loaded once), then state; the sum of
  one channel tile is stored as soon as its states are done;
* ``version=3`` - as 2, with the time axis cut into ``seq_tile`` columns: each state's scan carries
  its last value into the next tile as the initial value.

Two buffers per loaded or intermediate tile where that fits (the Neuron compiler's allocation of
a loop body's tiles); trnsim does not spill: a version whose tiles do not fit in SBUF is refused
where the compiler would spill (the tutorial's version 2 at 8K time steps did, and took 33x longer).
"""

from __future__ import annotations

import trnsim

P = 128  # channels per tile (partitions)
BCAST = 512  # columns a broadcast matmul writes at once (one PSUM bank of fp32)


def _bcast(kern: trnsim.Kernel, ones: object, row: object, psum: trnsim.TilePool, cols: int) -> list[object]:
    """A [1, cols] SBUF row broadcast to [128, cols] in PSUM, a bank at a time (TensorE, ones^T @ row)."""
    out = []
    for c0 in range(0, cols, BCAST):
        w = min(BCAST, cols - c0)
        t = psum.tile((P, BCAST), "fp32")
        kern.nc_matmul(t[:, :w], ones, row[:, c0:c0 + w])
        out.append((c0, w, t))
    return out


def _state(kern: trnsim.Kernel, pools: dict, ones: object, d: object, u: object, a_col: object, b_row: object,
           c_row: object, acc: object, first: bool, cols: int, initial: object, carry: object = None) -> None:
    """One state of one channel tile over ``cols`` time steps: acc (+)= C * scan(exp(d*A), d*u*B);
    ``carry`` ([P, 1]) receives the scan's last value, the next time tile's initial one."""
    da = pools["tmp"].tile((P, cols), "fp32")
    kern.activation(da, "exp", d, scale=a_col)
    dbu = pools["tmp"].tile((P, cols), "fp32")
    kern.tensor_tensor(dbu, d, u, "multiply")
    for c0, w, bb in _bcast(kern, ones, b_row, pools["psum"], cols):
        kern.tensor_tensor(dbu[:, c0:c0 + w], dbu[:, c0:c0 + w], bb[:, :w], "multiply")
    sc = pools["tmp"].tile((P, cols), "fp32")
    kern.tensor_tensor_scan(sc, da, dbu, initial, "multiply", "add")
    if carry is not None:
        kern.tensor_copy(carry, sc[:, cols - 1:cols])
    for c0, w, cb in _bcast(kern, ones, c_row, pools["psum"], cols):
        if first:
            kern.tensor_tensor(acc[:, c0:c0 + w], sc[:, c0:c0 + w], cb[:, :w], "multiply")
        else:
            kern.tensor_tensor(sc[:, c0:c0 + w], sc[:, c0:c0 + w], cb[:, :w], "multiply")
    if not first:
        kern.tensor_tensor(acc, acc, sc, "add")


def mamba(batch: int, channels: int, seq: int, state: int, *, dtype: str = "fp32", config: object = "trn1",
          version: int = 1, seq_tile: int = 512) -> trnsim.Kernel:
    if channels % P:
        raise trnsim.KernelError(f"mamba: channels {channels} must be a multiple of {P}")
    if version not in (1, 2, 3):
        raise trnsim.KernelError(f"mamba: version must be 1, 2 or 3, got {version!r}")
    if version == 3 and seq % seq_tile:
        raise trnsim.KernelError(f"mamba: seq {seq} must be a multiple of seq_tile {seq_tile}")
    kern = trnsim.Kernel(f"mamba_tutorial.v{version}", config)
    delta = kern.input("delta", (batch, channels, seq), dtype)
    u_in = kern.input("u", (batch, channels, seq), dtype)
    a_in = kern.input("A", (channels, state), dtype)
    b_in = kern.input("B", (batch, state, seq), dtype)
    c_in = kern.input("C", (batch, state, seq), dtype)
    out = kern.output("out", (batch, channels, seq), dtype)
    tiles = channels // P
    cols = seq_tile if version == 3 else seq
    pools = {"io": kern.tile_pool("io", bufs=2), "rows": kern.tile_pool("rows", bufs=4),
             "tmp": kern.tile_pool("tmp", bufs=3), "psum": kern.tile_pool("bcast", bufs=4, space="psum"),
             "acc": kern.tile_pool("acc", bufs=tiles if version == 1 else 2)}
    ones = kern.sbuf((1, P), "fp32", name="ones")
    kern.memset(ones, 1.0)
    a_all = kern.sbuf((P, tiles, state), "fp32", name="A")
    for t in range(tiles):
        kern.dma_copy(a_all[:, t, :], a_in[t * P:(t + 1) * P, :], queue=2)

    def rows(b: int, n: int, t0: int, w: int) -> tuple[object, object]:
        br, cr = pools["rows"].tile((1, w), "fp32"), pools["rows"].tile((1, w), "fp32")
        kern.dma_copy(br, b_in[b, n:n + 1, t0:t0 + w], queue=2)
        kern.dma_copy(cr, c_in[b, n:n + 1, t0:t0 + w], queue=2)
        return br, cr

    def load(b: int, t: int, t0: int, w: int) -> tuple[object, object]:
        d, u = pools["io"].tile((P, w), "fp32"), pools["io"].tile((P, w), "fp32")
        kern.dma_copy(d, delta[b, t * P:(t + 1) * P, t0:t0 + w], queue=0)
        kern.dma_copy(u, u_in[b, t * P:(t + 1) * P, t0:t0 + w], queue=1)
        return d, u

    for b in range(batch):
        if version == 1:
            accs = [pools["acc"].tile((P, seq), "fp32") for _ in range(tiles)]
            for n in range(state):
                br, cr = rows(b, n, 0, seq)
                for t in range(tiles):
                    d, u = load(b, t, 0, seq)
                    _state(kern, pools, ones, d, u, a_all[:, t, n:n + 1], br, cr, accs[t], n == 0, seq, 0.0)
            for t in range(tiles):
                kern.dma_copy(out[b, t * P:(t + 1) * P, :], accs[t], engine="gpsimd", queue=3)
            continue
        for t in range(tiles):
            carry = kern.sbuf((P, state), "fp32", name=f"carry{b}.{t}") if version == 3 else None
            for t0 in range(0, seq, cols):
                d, u = load(b, t, t0, cols)
                acc = pools["acc"].tile((P, cols), "fp32")
                for n in range(state):
                    br, cr = rows(b, n, t0, cols)
                    init = carry[:, n:n + 1] if carry is not None and t0 > 0 else 0.0
                    _state(kern, pools, ones, d, u, a_all[:, t, n:n + 1], br, cr, acc, n == 0, cols, init,
                           carry[:, n:n + 1] if carry is not None else None)
                kern.dma_copy(out[b, t * P:(t + 1) * P, t0:t0 + cols], acc, engine="gpsimd", queue=3)
    return kern
