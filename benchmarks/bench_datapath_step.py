"""The TensorE datapath against CPU BLAS on the matmuls of one small-GPT-2 training step.

``bench_torch_train.py --model small`` (4 layers, width 256, 4 heads, batch 8 x 128) sends
these matmuls through the bridge's value functions each step: forward and backward of every
``Conv1D`` (``addmm``/``mm``, with the operand layouts autograd hands over: a transposed view
is a stride, not a copy) and the attention bmms. Each is timed here through the bridge's call
(``torch_bridge.tensore.matmul_f32`` / ``bmm_f32``: fused fp32 MACs in the definition's k
order, 128-row chunks) and through ``torch.mm`` / ``torch.bmm`` on the same tensors, in the
same run, one thread each (best of several interleaved repeats). The table weights each shape by its
calls per step, so its total is the step's matmul time on each side.

    OMP_NUM_THREADS=1 python3 benchmarks/bench_datapath_step.py [--repeats N] [--quick]

Checks every datapath result against :mod:`trnsim.native.reference` on a column slice (bit
for bit) so the timing is of correct values; exit status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TRNSIM_NATIVE_THREADS"):
    os.environ[_name] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from trnsim import native  # noqa: E402
from trnsim.native import reference  # noqa: E402

from _args import whole  # noqa: E402  (the script beside this one)

K_CHUNK = 128  # trn2's PE array contraction rows (configs: core.tensor.max_contraction)


@dataclass(frozen=True)
class Shape:
    """``a[B?, M, K] @ b[B?, K, N]``; ``ta``/``tb``: the operand is a transposed view of a
    contiguous tensor (as autograd passes ``x.t()`` / ``w.t()``); ``calls``: per training step."""

    batch: int  # 0: a 2-d mm
    m: int
    k: int
    n: int
    ta: bool
    tb: bool
    calls: int

    def label(self) -> str:
        lay = ("t" if self.ta else "n") + ("t" if self.tb else "n")
        head = f"{self.batch} x " if self.batch else ""
        return f"{head}{self.m}x{self.k}x{self.n} {lay}"

    def flops(self) -> float:
        return 2.0 * max(self.batch, 1) * self.m * self.k * self.n

    def operands(self, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        def make(rows: int, cols: int, transposed: bool) -> torch.Tensor:
            lead = (self.batch,) if self.batch else ()
            shape = lead + ((cols, rows) if transposed else (rows, cols))
            t = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
            return t.transpose(-1, -2) if transposed else t
        return make(self.m, self.k, self.ta), make(self.k, self.n, self.tb)


# The small GPT-2's step (recorded from the bridge's calls in a steady-state step): tokens T = 1024,
# width 256, MLP 1024, qkv 768, 32 attention heads of 128 x 64.
STEP = [
    Shape(0, 1024, 256, 768, False, False, 4),    # c_attn forward
    Shape(0, 1024, 768, 256, False, True, 4),     # c_attn grad input
    Shape(0, 256, 1024, 768, True, False, 4),     # c_attn grad weight
    Shape(0, 1024, 256, 256, False, False, 5),    # c_proj forward (+ lm head)
    Shape(0, 1024, 256, 256, False, True, 5),     # c_proj grad input (+ lm head)
    Shape(0, 256, 1024, 256, True, False, 5),     # c_proj grad weight (+ lm head)
    Shape(0, 1024, 256, 1024, False, False, 4),   # mlp c_fc forward
    Shape(0, 1024, 256, 1024, False, True, 4),    # mlp c_proj grad input
    Shape(0, 256, 1024, 1024, True, False, 4),    # mlp c_fc grad weight
    Shape(0, 1024, 1024, 256, False, False, 4),   # mlp c_proj forward
    Shape(0, 1024, 1024, 256, False, True, 4),    # mlp c_fc grad input
    Shape(0, 1024, 1024, 256, True, False, 4),    # mlp c_proj grad weight
    Shape(32, 128, 64, 128, False, True, 8),      # q @ k^T, dp = do @ v^T
    Shape(32, 128, 128, 64, False, False, 8),     # p @ v, dq = ds @ k
    Shape(32, 128, 128, 64, True, False, 8),      # dv = p^T @ do, dk = ds^T @ q
]


def best_seconds(fns: list, repeats: int) -> list[float]:
    """Best wall time of each function over ``repeats`` rounds, the functions alternating in
    each round (the machine is shared: the best of interleaved runs compares like with like)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def check(a: torch.Tensor, b: torch.Tensor, got: torch.Tensor) -> bool:
    """The first 8 output columns against the numpy definition, bit for bit."""
    if a.dim() == 3:
        a, b, got = a[0], b[0], got[0]
    want = reference.matmul(a.t().numpy(), b[:, :8].numpy(), k_chunk=K_CHUNK)
    return np.array_equal(got[:, :8].numpy().view(np.uint32), want.view(np.uint32))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=whole(1, 1000), default=9, help="timed rounds per shape (best of; default 9)")
    p.add_argument("--quick", action="store_true", help="3 repeats (the test suite's smoke run)")
    args = p.parse_args()
    repeats = 3 if args.quick else args.repeats
    torch.set_num_threads(1)
    from torch_bridge import tensore

    tensore._chunk[:] = [K_CHUNK]  # the bridge reads it from the configured chip; same figure
    rng = np.random.default_rng(0)
    print(f"1 thread, torch {torch.__version__}, datapath kernel family {native.kernel_families()[-1]}, "
          f"best of {repeats} interleaved runs")
    print(f"  {'a[M,K] @ b[K,N], layouts':<26} {'calls':>5} {'datapath':>9} {'GFLOP/s':>8} {'torch':>9} "
          f"{'GFLOP/s':>8} {'ratio':>6}")
    ok = True
    total_dp = total_cpu = 0.0
    for sh in STEP:
        a, b = sh.operands(rng)
        if sh.batch:
            dp, cpu = (lambda: tensore.bmm_f32(a, b)), (lambda: torch.bmm(a, b))
        else:
            dp, cpu = (lambda: tensore.matmul_f32(a, b)), (lambda: torch.mm(a, b))
        ok = check(a, b, dp()) and ok
        t_dp, t_cpu = best_seconds([dp, cpu], repeats)
        total_dp += t_dp * sh.calls
        total_cpu += t_cpu * sh.calls
        f = sh.flops()
        print(f"  {sh.label():<26} {sh.calls:5d} {t_dp * 1e3:7.2f}ms {f / t_dp / 1e9:8.1f} {t_cpu * 1e3:7.2f}ms "
              f"{f / t_cpu / 1e9:8.1f} {t_dp / t_cpu:5.2f}x")
    flops = sum(sh.flops() * sh.calls for sh in STEP)
    print(f"step total ({flops / 1e9:.1f} GFLOP): datapath {total_dp * 1e3:.1f} ms "
          f"({flops / total_dp / 1e9:.1f} GFLOP/s), torch {total_cpu * 1e3:.1f} ms "
          f"({flops / total_cpu / 1e9:.1f} GFLOP/s): ratio {total_dp / total_cpu:.2f}x")
    print(f"values vs reference: {'bit-identical' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
