"""The projection runner: passes of weight columns x token blocks, software-pipelined
(:class:`Projection`), the exchange of partial results between passes (:class:`Exchange`) and
transposed loads through the PE array (:func:`load_transposed`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence


from ...isa import HbmAP, HbmTensor, KernelError, TileAP
from ...builder.kernel import Kernel
from .common import BANK, P, XT, LazyGroups, Pools, load_weights, matmul_tokens, weight_group


# ---------------------------------------------------------------------------------------------
# The projection runner: passes of weight columns x token blocks, software-pipelined
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seg:
    """Columns ``[c0, c0 + cw)`` of the ``[K, n]`` weight matrix at element ``base`` of ``w``."""

    w: HbmTensor
    base: int
    n: int
    c0: int
    cw: int


class Projection:
    """``out[T, cols] = X[T, K] @ W[K, cols]``, tokens stationary (:func:`matmul_tokens`), over
    passes of weight columns, with a callback that evacuates each (pass, token block).

    ``make_passes(width)`` lays the columns out as passes of segments (a segment is at most
    ``width`` columns of one weight); the width is the widest multiple of ``unit`` (at most three
    PSUM banks a segment, so a pass's accumulators double-buffer in six) whose pass fits SBUF.

    * **stream** (one token block, decode): ``Xᵀ`` is made once; each pass's weights stream
      through a few k-group buffers, each load emitted ``lookahead`` groups ahead of its use.
    * **resident** (prefill): a pass's weights are loaded whole and stay while the token blocks
      go by (the next pass's load overlaps when two fit). ``Xᵀ`` of every block is made in the
      first pass; when it does not fit SBUF for later passes it is spilled to an HBM scratch in
      the ``[128, K1, tb]`` layout (one contiguous run per partition) and reloaded, so ``x`` is
      read, and the residual stored, once.

    The loop is software-pipelined in program order (the engines run their queues in order):
    the loads and norm of blocks ``i+1`` and ``i+2``, the matmuls of ``i``, the transposes of
    ``i+1``, the evacuation of ``i`` - TensorE goes from one block's matmuls to the next's
    transposes while VectorE/ScalarE evacuate.
    """

    def __init__(self, kern: Kernel, pools: Pools, *, k1: int, tokens: int, prologue: Any, isz: int,
                 make_passes: Callable[[int], list[list[Seg]]], max_width: int, unit: int, budget: int,
                 fp8: bool = False, tag: str = "p", k_range: tuple[int, int] | None = None, max_banks: int = 3):
        self.kern, self.pools, self.k1, self.tokens = kern, pools, k1, tokens
        self.kp = prologue.kp  # partitions of the contraction (K = kp x K1)
        self.k_range = k_range
        self.pro, self.isz, self.fp8, self.tag = prologue, isz, fp8, tag
        self.tbs = [(t0, min(P, tokens - t0)) for t0 in range(0, tokens, P)]
        tbw = min(P, tokens)
        self.stream = len(self.tbs) == 1
        xT_bytes = k1 * tbw * isz
        cap_w = max(unit, min(max_width, max_banks * BANK) // unit * unit)
        if self.stream:
            self.passes = make_passes(cap_w)
            self.cache_x, self.spill = True, False
        else:
            # four blocks of Xᵀ in flight, fewer when a wide contraction leaves no room for a
            # pass of weight columns beside them (H = 16384: 32 KiB per block and partition)
            nseg = len(make_passes(cap_w)[0])
            for xT_bufs in (4, 3, 2):
                w_budget = budget - xT_bufs * xT_bytes
                width = min(cap_w, w_budget // max(1, nseg * k1 * isz) // unit * unit)
                if width >= unit:
                    break
            if width < unit:
                raise KernelError(f"{kern.name}: {k1 * P} x {unit} weight columns do not fit SBUF on "
                                  f"{kern.config.name} beside the token blocks ({max(0, w_budget) // 1024} KiB "
                                  f"per partition left); the contraction dim must be smaller")
            self.passes = make_passes(width)
            self.cache_x = len(self.passes) == 1 or len(self.tbs) <= xT_bufs
            self.spill = not self.cache_x
        self.xT_bufs = 4 if self.stream else xT_bufs
        wmax = max(sg.cw for ps in self.passes for sg in ps)
        group = weight_group(k1, wmax, isz)
        if fp8:
            group = max(2, group // 2 * 2)
        self.group = group
        n_groups = -(-(k1 if k_range is None else k_range[1] - k_range[0]) // group)
        per_pass = max(len(ps) for ps in self.passes) * n_groups
        if self.stream:
            # four k-groups in flight: enough to cover a transfer's start latency and keep the
            # queues busy; more would only delay a later small transfer (an exchange, a store)
            # that the DMA engines serve after every transfer ready before it
            segs = max(len(ps) for ps in self.passes)
            total = n_groups * len(self.passes)
            # at most ~80 KiB per partition in flight (10 MiB: far more than the DMA latency needs),
            # leaving room for the evacuation's tiles
            room = max(0, min(budget - prologue.sbuf_bytes - 2 * xT_bytes - 16 * 1024, 80 * 1024)) \
                // max(1, group * wmax * isz * segs)
            self.lookahead: int | None = max(1, min(4, total, room - 1))
            bufs = (self.lookahead + 1) * segs
            self.double = False
        else:
            self.lookahead = None
            fit = max(per_pass, (budget - self.xT_bufs * xT_bytes) // (group * wmax * isz))
            bufs = min(2 * per_pass, fit)
            self.double = bufs >= 2 * per_pass and len(self.passes) > 1
            if not self.double:
                bufs = per_pass
        self.wpool = pools(f"{tag}_w", bufs)
        #: SBUF bytes per partition the weight buffers take
        self.w_bytes = bufs * group * wmax * isz
        self.acc_pool = pools("acc", 6, "psum")
        # every block's Xᵀ stays for the later passes; with one pass (or spilling) four rotate
        self.xT_pool = pools(f"{tag}_xT", len(self.tbs) if self.cache_x and len(self.passes) > 1
                             else min(self.xT_bufs, len(self.tbs)))
        self.xT_cache: dict[int, XT] = {}
        self.xT_hbm = kern.scratch(f"{tag}_xT_spill", (len(self.tbs), self.kp, k1 * P), prologue.out_dt) \
            if self.spill else None
        self._q = 0
        self._stream_it: Any = None

    def _load(self, ps: Sequence[Seg]) -> Any:
        """The pass's weights: per segment, its k-groups (resident: :class:`LazyGroups`; streamed:
        the pass's share of :meth:`_stream`, one list of the segments' tiles per k-group)."""
        if self.stream:  # passes are loaded in order: each takes its k-groups from the one stream, lazily
            if self._stream_it is None:
                self._stream_it = iter(self._stream())
            n = len(range(*(self.k_range or (0, self.k1)), self.group))
            return [itertools.islice(self._stream_it, n)]
        out = []
        for sg in ps:
            out.append(load_weights(self.kern, self.wpool, sg.w, sg.base, self.k1, sg.n, sg.c0, sg.cw, self.group,
                                    queue0=self._q, lookahead=None, k_range=self.k_range, kp=self.kp))
            self._q += 1
        return out

    def _stream(self) -> Iterable[list[tuple[int, TileAP]]]:
        """Every pass's weights as one stream, in the order the matmuls use them: per pass, per
        k-group, the segments' tiles together. Each load is emitted ``lookahead`` k-groups ahead
        of its use, across pass boundaries, so the DMA queues never wait for a pass to start."""
        loaders = []
        for ps in self.passes:
            lds = [load_weights(self.kern, self.wpool, sg.w, sg.base, self.k1, sg.n, sg.c0, sg.cw, self.group,
                                queue0=self._q + k, lookahead=None, k_range=self.k_range, kp=self.kp)
                   for k, sg in enumerate(ps)]
            self._q += len(ps)
            loaders.extend([lds] * len(lds[0]))
        order = []
        seen: dict[int, int] = {}
        for lds in loaders:  # (loaders of a pass, its next group index) in use order
            gi = seen.get(id(lds), 0)
            seen[id(lds)] = gi + 1
            order.append((lds, gi))
        la = self.lookahead or 1
        issued = 0

        def issue(upto: int) -> None:
            nonlocal issued
            while issued < min(upto, len(order)):
                for ld in order[issued][0]:
                    ld.load_next()
                issued += 1

        for k, (lds, gi) in enumerate(order):
            issue(k + 1 + la)
            yield [ld.groups[gi] for ld in lds]

    def _mm(self, xT: XT, ps: Sequence[Seg], loaded: Any, steps: Sequence[Callable[[], None]] = ()
            ) -> list[list[TileAP]]:
        """Every segment's matmuls for one token block; accumulators per segment, per bank.
        ``steps`` (the next block's transposes) are spread evenly between the k-groups."""
        accs = [[self.acc_pool.tile((P, BANK), "fp32")[:xT.tb] for _ in range(-(-sg.cw // BANK))] for sg in ps]
        if steps and not self.stream:
            pending = list(steps)
            total = sum(len(g) for g in loaded)  # type: ignore[arg-type]
            done = 0
            for g, sg, acc in zip(loaded, ps, accs):
                first = True
                for grp in g:
                    matmul_tokens(self.kern, xT, [grp], acc, sg.cw, fp8=self.fp8, first=first)
                    first = False
                    done += 1
                    while pending and len(pending) > (total - done) * len(steps) // total:
                        pending.pop(0)()
            for st in pending:
                st()
            return accs
        if self.stream:
            # streamed segments advance together, k-group by k-group (their loads interleave)
            for parts in loaded[0]:
                for (j0, wt), sg, acc in zip(parts, ps, accs):
                    matmul_tokens(self.kern, xT, [(j0, wt)], acc, sg.cw, fp8=self.fp8,
                                  first=j0 == (self.k_range or (0, 0))[0])
        else:
            for g, sg, acc in zip(loaded, ps, accs):
                matmul_tokens(self.kern, xT, g, acc, sg.cw, fp8=self.fp8)
        return accs

    def run(self, evac: Callable[[int, int, int, list[list[TileAP]]], None]) -> None:
        """Emit every pass; ``evac(pass index, t0, tb, accs)`` after each (pass, token block)."""
        kern = self.kern
        items = [(pi, bi, t0, tb) for pi in range(len(self.passes)) for bi, (t0, tb) in enumerate(self.tbs)]
        states: dict[int, Any] = {}

        def a(i: int) -> None:
            pi, bi, t0, tb = items[i]
            if t0 in self.xT_cache or i in states or (pi > 0 and not self.spill):
                return  # made already (or being made for the first pass: kept for the later ones)
            if pi == 0:
                states[i] = self.pro.stage_a(t0, tb, self.xT_pool)
            else:  # a later pass: Xᵀ back from the spill
                t = self.xT_pool.tile((self.kp, self.k1, P), self.pro.out_dt)
                kern.dma_copy(t[:, :, :tb], self.xT_hbm.ap(bi * self.kp * self.k1 * P,  # type: ignore[union-attr]
                                                           [[self.k1 * P, self.kp], [P, self.k1], [1, tb]]), queue=4)
                states[i] = XT(t, tb, False)

        def b(i: int) -> XT:
            pi, bi, t0, tb = items[i]
            xT = self.xT_cache.get(t0)
            if xT is None:
                xT = self.pro.stage_b(states.pop(i), self.xT_pool)
                if self.cache_x:
                    self.xT_cache[t0] = xT
                elif pi == 0 and self.spill:
                    kern.dma_copy(self.xT_hbm.ap(bi * self.kp * self.k1 * P,  # type: ignore[union-attr]
                                                 [[self.k1 * P, self.kp], [P, self.k1], [1, tb]]),
                                  xT.tile[:, :, :tb], engine="gpsimd", queue=5)
            return xT

        def b_steps(i: int) -> tuple[XT, list[Callable[[], None]]]:
            pi, bi, t0, tb = items[i]
            xT = self.xT_cache.get(t0)
            if xT is not None:
                return xT, []
            xT, steps = self.pro.stage_b_steps(states.pop(i), self.xT_pool)
            if self.cache_x:
                self.xT_cache[t0] = xT
            elif pi == 0 and self.spill:
                steps.append(lambda: kern.dma_copy(
                    self.xT_hbm.ap(bi * self.kp * self.k1 * P, [[self.k1 * P, self.kp], [P, self.k1], [1, tb]]),  # type: ignore[union-attr]
                    xT.tile[:, :, :tb], engine="gpsimd", queue=5))
            return xT, steps

        loaded: dict[int, Any] = {}
        # the first blocks' loads go ahead of the first pass's weights (DMA queues are served in
        # turn); two blocks' rows are live at a time (the row pools hold two)
        for i in range(min(2, len(items))):
            a(i)
        pending: tuple[int, XT] | None = (0, b(0)) if items else None
        while pending is not None:
            i, xT = pending
            pi, bi, t0, tb = items[i]
            if pi not in loaded:
                loaded[pi] = self._load(self.passes[pi])
            for ahead in (1, 2):  # loads and norm two blocks ahead: their chain is longer than a block's matmuls
                if i + ahead < len(items):
                    a(i + ahead)
            if self.double and pi + 1 < len(self.passes):
                # the next pass's weights, a share per token block of this pass, between the
                # blocks' own loads (a transfer waits for every one ready before it)
                if pi + 1 not in loaded:
                    loaded[pi + 1] = self._load(self.passes[pi + 1])
                lazy = [g for g in loaded[pi + 1] if isinstance(g, LazyGroups)]
                share = -(-sum(len(g) for g in lazy) // max(1, len(self.tbs) - 1))
                for _ in range(share):
                    if not any(g.load_next() for g in lazy):
                        break
            nxt_xT, steps = b_steps(i + 1) if i + 1 < len(items) else (None, [])
            accs = self._mm(xT, self.passes[pi], loaded[pi], steps)
            nxt = (i + 1, nxt_xT) if nxt_xT is not None else None
            evac(pi, t0, tb, accs)
            if i + 1 == len(items) or items[i + 1][0] != pi:
                loaded.pop(pi, None)
            pending = nxt


class Exchange:
    """The partial-sum exchange of a decode projection whose contraction dim is shared by the
    physical cores of an LNC=2 logical core (the NKI library's TKG kernels shard H and add the
    partial outputs with ``sendrecv``): per PSUM bank, the partial sums go to SBUF (ScalarE), one
    SBUF-to-SBUF DMA stands for the transfer between the cores (``sendrecv`` is a DMA), and
    VectorE adds the peer's partial sums of this core's columns before they are evacuated.

    trnsim simulates each core's kernel on its own, so the peer's data is represented by this
    core's own partial sums (the cores run the same stream, so the peer's arrive when ours would
    have). The values are then not the peer's: a sharded kernel is for timing; its values are
    checked unsharded."""

    def __init__(self, kern: Kernel, pools: Pools):
        self.kern, self.pools = kern, pools

    def add_peer(self, acc: TileAP, lo: int, hi: int) -> TileAP:
        """Columns ``[lo, hi)`` of the PSUM bank ``acc [tb, w]`` plus the peer's, in SBUF (fp32)."""
        tb, w = acc.p_count, acc.free_size
        mine = self.pools("xchg_out", 2).tile((P, BANK), "fp32")[:tb, :w]
        self.kern.activation(mine, "copy", acc)
        peer = self.pools("xchg_in", 2).tile((P, BANK), "fp32")[:tb, :w]
        self.kern.dma_copy(peer, mine, engine="gpsimd", queue=6)
        out = self.pools("xchg_sum", 2).tile((P, BANK), "fp32")[:tb, :hi - lo]
        self.kern.tensor_tensor(out, mine[:, lo:hi], peer[:, lo:hi], "add")
        return out


def load_transposed(kern: Kernel, pools: Pools, dst: TileAP, src: HbmAP, queue: int, psum_pool: str) -> None:
    """``dst [D, n] = src [n, D]ᵀ`` (keys into ``Kᵀ``): a DMA transpose (NC-v3 on, 90% of a copy's
    rate), or on a core without one (trn1) the rows loaded 128 at a time and transposed on
    TensorE through a bank of ``psum_pool`` (bf16), evacuated by VectorE."""
    d = kern.config.core.dma
    if d.transpose_rate_hbm > 0:
        kern.dma_transpose(dst, src, queue=queue)
        return
    n, dd = src.shape[-2], src.shape[-1]
    for r0 in range(0, n, P):
        m = min(P, n - r0)
        rows = pools("kt_rows", 2).tile((P, dd), dst.dtype)[:m]
        kern.dma_copy(rows, src[..., r0:r0 + m, :] if len(src.shape) > 2 else src[r0:r0 + m, :], queue=queue)
        ps = pools(psum_pool, 1, "psum").tile((P, P), dst.dtype)[:dd, :m]
        kern.nc_transpose(ps, rows)
        kern.tensor_copy(dst[:, r0:r0 + m], ps, engine="vector")
