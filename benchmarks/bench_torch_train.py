"""Wall time of a training step on the `neuron` device against the same step on CPU.

Trains the demo's GPT-2 (examples/train_gpt2.py: 2 layers, width 64, byte vocabulary, batch
8 x 64, AdamW with gradient clipping) from the same weights on both devices in one process,
single-threaded: all CPU steps, then all neuron steps, so each runs in its own steady state
(alternating the steps let each evict the other's working set from the caches: that slowed the
CPU steps by about a quarter and flattered the ratio). Prints, per device, the first step (the neuron one includes simulating every kernel
the step needs for the first time) and the steady-state wall time per step (median of the steps
after the first two), then the ratio neuron / CPU. Goal: <= 1.5x. Also prints how much of a
neuron step computed matmul values on the TensorE datapath (exact fp32 products and sums in
the definition's order, no fused multiply-add, so slower than BLAS) and the simulated device
time per step, and checks that both devices computed the same losses (exit status 1 if they
differ by more than 1e-4 relative), so the timing is of a correct run.

    OMP_NUM_THREADS=1 python3 benchmarks/bench_torch_train.py [--steps 20]
    OMP_NUM_THREADS=1 python3 benchmarks/bench_torch_train.py --quick    # 6 steps
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TRNSIM_NATIVE_THREADS"):
    os.environ[_name] = "1"

import torch  # noqa: E402  (after the thread pins)

ROOT = Path(__file__).resolve().parent.parent
GOAL = 1.5
WARMUP = 2  # steps left out of the steady state: the first simulates kernels, the second AdamW's


class DatapathClock:
    """Wall time spent in the bridge's TensorE value functions (wrapped while the run lasts)."""

    NAMES = ("matmul_f32", "bmm_f32", "conv_f32")

    def __init__(self) -> None:
        from torch_bridge import tensore

        self.seconds = 0.0
        for name in self.NAMES:
            setattr(tensore, name, self._timed(getattr(tensore, name)))

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("train_gpt2", ROOT / "examples" / "train_gpt2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Trainer:
    """One device's model, optimizer and per-step wall times."""

    def __init__(self, example: Any, device: str, seq: int):
        torch.manual_seed(0)
        self.device = device
        self.model = example.make_model(seq).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.seconds: list[float] = []
        self.losses: list[float] = []

    def step(self, x: torch.Tensor) -> None:
        t0 = time.perf_counter()
        x = x.to(self.device)
        loss = self.model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.item())  # waits for the device, as a real training loop's logging does
        self.seconds.append(time.perf_counter() - t0)

    def steady_ms(self) -> float:
        return statistics.median(self.seconds[WARMUP:]) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="6 steps instead of 20")
    p.add_argument("--steps", type=int, default=None, help="training steps per device (default 20; >= 3)")
    args = p.parse_args()
    steps = args.steps or (6 if args.quick else 20)
    if steps <= WARMUP:
        p.error(f"--steps must be more than {WARMUP} (the warm-up steps), got {steps}")
    torch.set_num_threads(1)
    example = _example()
    batch, seq = 8, 64
    cpu = Trainer(example, "cpu", seq)
    neuron = Trainer(example, "neuron", seq)
    torch.neuron.reset_report()
    datapath = DatapathClock()
    for x in example.batches(batch, seq, steps):
        cpu.step(x)
    for i, x in enumerate(example.batches(batch, seq, steps)):
        if i == WARMUP:
            datapath.seconds = 0.0
        neuron.step(x)
    sim_us = torch.neuron.report().total_us / steps
    print(f"GPT-2 (2 layers, width 64), batch {batch} x {seq}, AdamW: {steps} steps per device, 1 thread, "
          f"torch {torch.__version__}, neuron on {torch.neuron.config().name}")
    for t in (cpu, neuron):
        print(f"  {t.device:<6} first step {t.seconds[0] * 1e3:8.1f} ms   steady state {t.steady_ms():7.1f} ms/step "
              f"(median of steps {WARMUP + 1}-{steps}, min {min(t.seconds[WARMUP:]) * 1e3:.1f} ms)")
    ratio = neuron.steady_ms() / cpu.steady_ms()
    values_ms = datapath.seconds / (steps - WARMUP) * 1e3
    mean_ms = statistics.mean(neuron.seconds[WARMUP:]) * 1e3
    print(f"  neuron steady-state mean {mean_ms:.1f} ms/step: {values_ms:.1f} ms computing matmul values on the "
          f"TensorE datapath, {mean_ms - values_ms:.1f} ms the rest (op dispatch, CPU kernels, autograd)")
    print(f"  neuron simulated device time: {sim_us:,.0f} us/step")
    print(f"ratio neuron/CPU per steady-state step: {ratio:.2f}x (goal <= {GOAL}x: {'met' if ratio <= GOAL else 'missed'})")
    worst = max(abs(a - b) / abs(a) for a, b in zip(cpu.losses, neuron.losses))
    print(f"losses: CPU {cpu.losses[-1]:.5f}, neuron {neuron.losses[-1]:.5f} after {steps} steps "
          f"(largest relative difference {worst:.1e})")
    if worst > 1e-4:
        print("error: neuron and CPU losses differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
