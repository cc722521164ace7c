"""The model zoo's cost on the neuron device: first-step time (values + simulating every new
kernel shape) and steady-state wall time, against CPU in the same run.

Runs every model of ``tests/torch/test_model_zoo.py`` (CI-sized Hugging Face configs and the
CNN blocks written there) for one forward+backward on CPU, then twice on neuron, and prints per
model and in total: CPU time, the first neuron step, the second (kernel costs cached), their
ratios, and the kernels simulated.

    OMP_NUM_THREADS=1 python benchmarks/bench_zoo_ci.py [--models gpt2,llama] [--quick]

(``bench_zoo.py`` runs external-style programs for many steps; this one the CI zoo once.)
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import time
from pathlib import Path

import torch
import torch_bridge  # noqa: F401  (registers the device where autoload is off)

_PATH = Path(__file__).resolve().parents[1] / "tests" / "torch" / "test_model_zoo.py"


def _zoo():
    spec = importlib.util.spec_from_file_location("test_model_zoo", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["test_model_zoo"] = mod
    spec.loader.exec_module(mod)
    return mod


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="comma-separated zoo names (default: all)")
    p.add_argument("--quick", action="store_true", help="three models")
    args = p.parse_args(argv)
    zoo = _zoo()
    names = args.models.split(",") if args.models else sorted(zoo.ZOO) + sorted(zoo.CNNS)
    if args.quick:
        names = ["gpt2", "vit", "separable_block"]
    device = torch_bridge.runtime.runtime().device
    print(f"model zoo, one forward+backward each (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(f"  {'model':16s} {'CPU s':>7s} {'first s':>8s} {'x CPU':>6s} {'second s':>9s} {'x CPU':>6s} {'kernels':>8s}")
    tot = [0.0, 0.0, 0.0, 0]
    for name in names:
        torch.manual_seed(0)
        if name in zoo.ZOO:
            model, inputs = zoo.ZOO[name]()
            model.eval()

            def step(m, dev, model_inputs=inputs):
                return zoo._run(m, model_inputs, dev)
        else:
            model = zoo.CNNS[name]()
            x = torch.randn(2, 8, 16, 16, generator=torch.Generator().manual_seed(6))

            def step(m, dev, x=x):
                m.to(dev)(x.to(dev).requires_grad_()).square().sum().backward()
        dev = copy.deepcopy(model)
        cpu_s = _timed(lambda: step(model, "cpu"))
        before = device.simulated
        first = _timed(lambda: (step(dev, "neuron"), torch.neuron.synchronize()))
        kernels = device.simulated - before
        second = _timed(lambda: (step(dev, "neuron"), torch.neuron.synchronize()))
        for i, v in enumerate((cpu_s, first, second, kernels)):
            tot[i] += v
        print(f"  {name:16s} {cpu_s:7.3f} {first:8.3f} {first / cpu_s:6.1f} {second:9.3f} {second / cpu_s:6.1f} "
              f"{kernels:8d}")
    print(f"  {'total':16s} {tot[0]:7.3f} {tot[1]:8.3f} {tot[1] / tot[0]:6.1f} {tot[2]:9.3f} {tot[2] / tot[0]:6.1f} "
          f"{tot[3]:8d}")
    print(f"first-step simulation (first - second, all models): {tot[1] - tot[2]:.2f} s; "
          f"steady-state wall ratio vs CPU: {tot[2] / tot[0]:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
