"""The zoo's LSTM (``bench_zoo.py``'s ``lstm``: a two-layer ``nn.LSTM`` classifier, Adam) three
ways in one process: on CPU with oneDNN's fused RNN (PyTorch's default there), on CPU with oneDNN
off (PyTorch's composite: a GEMM for all timesteps' input projections per layer, then a cell and a
hidden-state GEMM per timestep), and on neuron (the composite as any non-CPU device runs it, the
input projection per timestep). Rounds alternate between the three; each prints the process CPU
milliseconds of a training step (the median over rounds), and the ratios say how much of the
neuron/CPU gap is the device and how much CPU's fused kernel against any composite.

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

    import bench_zoo

    torch.set_num_threads(1)

    def way(device: str, onednn: bool):
        torch.backends.mkldnn.enabled = onednn
        model, make_step = bench_zoo.lstm(ns.quick)
        step = make_step(model, device)
        for _ in range(3 if ns.quick else 30):  # warm-up (oneDNN's LSTM speeds up over its first steps)
            step()

        def timed() -> float:
            torch.backends.mkldnn.enabled = onednn
            c0 = time.process_time()
            for _ in range(steps):
                step()
            return (time.process_time() - c0) / steps * 1e3
        return timed

    ways = {"CPU, oneDNN's fused LSTM": way("cpu", True), "CPU, oneDNN off (composite)": way("cpu", False),
            "neuron (composite)": way("neuron", True)}
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
    fused, comp, dev = med.values()
    print(f"neuron / CPU fused {dev / fused:.2f}x; neuron / CPU composite {dev / comp:.2f}x; "
          f"CPU composite / CPU fused {comp / fused:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
