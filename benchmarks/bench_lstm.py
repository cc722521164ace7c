"""The zoo's LSTM (``bench_zoo.py``'s ``lstm``: a two-layer ``nn.LSTM`` classifier, Adam) four
ways in one process: on CPU with oneDNN's fused RNN (PyTorch's default there), on CPU with oneDNN
off (PyTorch's composite: a GEMM for all timesteps' input projections per layer, then a cell and a
hidden-state GEMM per timestep), on neuron as one op (``torch_bridge/ops/rnn.py``: CPU's kernel's
values, the composite's launches replayed), and on neuron op by op (the composite as any non-CPU
device runs it, the input projection per timestep: what the device ran before). Rounds alternate
between the four; each prints the process CPU milliseconds of a training step (the median over
rounds), and the ratios say how much of the neuron/CPU gap is the device and how much CPU's fused
kernel against any composite. The two neuron ways must charge the same simulated time a step
(checked: the script fails otherwise).

    OMP_NUM_THREADS=1 python3 benchmarks/bench_lstm.py [--rounds N] [--steps N] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from _args import whole  # noqa: E402  (the script beside this one)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=whole(1, 100), default=5, help="alternated rounds (default 5)")
    ap.add_argument("--steps", type=whole(1, 1000), default=20, help="steps a round per way (default 20)")
    ap.add_argument("--quick", action="store_true", help="the zoo's quick LSTM, 2 rounds of 3 steps")
    ns = ap.parse_args(argv)
    rounds, steps = (2, 3) if ns.quick else (ns.rounds, ns.steps)

    import torch
    import torch_bridge  # noqa: F401  (the neuron device)
    from torch_bridge.ops import rnn
    from torch_bridge.runtime import runtime

    import bench_zoo

    torch.set_num_threads(1)
    ticks: dict[str, set[int]] = {}

    def way(device: str, onednn: bool, whole: bool = True, name: str = ""):
        torch.backends.mkldnn.enabled = onednn
        rnn.enabled = whole
        model, make_step = bench_zoo.lstm(ns.quick)
        step = make_step(model, device)
        for _ in range(3 if ns.quick else 30):  # warm-up (oneDNN's LSTM speeds up over its first steps)
            step()

        def timed() -> float:
            torch.backends.mkldnn.enabled = onednn
            rnn.enabled = whole
            if device == "neuron":
                torch.neuron.synchronize()
                t0 = runtime().device.now()
            c0 = time.process_time()
            for _ in range(steps):
                step()
            cpu_ms = (time.process_time() - c0) / steps * 1e3
            if device == "neuron":
                torch.neuron.synchronize()
                ticks.setdefault(name, set()).add(runtime().device.now() - t0)
            rnn.enabled = True
            return cpu_ms
        return timed

    names = ("CPU, oneDNN's fused LSTM", "CPU, oneDNN off (composite)", "neuron, one op", "neuron, op by op (before)")
    ways = {names[0]: way("cpu", True), names[1]: way("cpu", False), names[2]: way("neuron", True, True, names[2]),
            names[3]: way("neuron", True, False, names[3])}
    got: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(rounds):
        for k, fn in ways.items():
            got[k].append(fn())
    torch.backends.mkldnn.enabled = True
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"the zoo's LSTM{' (quick)' if ns.quick else ''}: process CPU ms a training step, median of {rounds} "
          f"alternated rounds of {steps} steps")
    for k, v in got.items():
        print(f"  {k:30s} {med[k]:8.2f}   ({', '.join(f'{x:.2f}' for x in v)})")
    fused, comp, dev, before = med.values()
    print(f"neuron / CPU fused {dev / fused:.2f}x (op by op: {before / fused:.2f}x); neuron / CPU composite "
          f"{dev / comp:.2f}x; CPU composite / CPU fused {comp / fused:.2f}x")
    same = ticks[names[2]] == ticks[names[3]] and len(ticks[names[2]]) == 1
    print(f"simulated ticks of {steps} steps: {sorted(ticks[names[2]])} one op, {sorted(ticks[names[3]])} op by op "
          f"({'the same' if same else 'DIFFERENT'})")
    if not same:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
