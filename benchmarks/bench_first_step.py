"""First-step simulation time of a CNN with new shapes everywhere: EfficientNet-B0.

The first training step of a model on the neuron device simulates every kernel shape it meets
once (later steps reuse the cached costs), so its wall time is values + simulation. This runs
EfficientNet-B0 (written here from the paper's table: MBConv blocks with depthwise convolutions
and squeeze-excitation; no torchvision) for one SGD step on CPU and then two on neuron, in one
process, and prints the first and second neuron steps' wall time against CPU's, and how many
kernels were simulated.

    OMP_NUM_THREADS=1 python benchmarks/bench_first_step.py [--batch 8] [--size 224] [--quick]

``--quick`` is a 1x3x64x64 run (the tests run it). Goal (issue 11): the first step within a few
seconds at EfficientNet-B0's size.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch_bridge  # noqa: F401  (registers the device where autoload is off)
from torch import nn

from _args import whole  # (the script beside this one)

# (expand ratio, kernel, stride, output channels, repeats): EfficientNet-B0, Tan & Le 2019, Table 1
B0 = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3), (6, 5, 2, 192, 4),
      (6, 3, 1, 320, 1))


class MBConv(nn.Module):
    def __init__(self, cin: int, cout: int, expand: int, k: int, stride: int):
        super().__init__()
        mid = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.SiLU()]
        layers += [nn.Conv2d(mid, mid, k, stride, k // 2, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.SiLU()]
        self.body = nn.Sequential(*layers)
        se = max(1, cin // 4)
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(mid, se, 1), nn.SiLU(), nn.Conv2d(se, mid, 1),
                                nn.Sigmoid())
        self.proj = nn.Sequential(nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        h = self.proj(h * self.se(h))
        return x + h if self.residual else h


def efficientnet_b0(classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.SiLU()]
    cin = 32
    for expand, k, stride, cout, repeats in B0:
        for i in range(repeats):
            layers.append(MBConv(cin, cout, expand, k, stride if i == 0 else 1))
            cin = cout
    layers += [nn.Conv2d(cin, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.SiLU(), nn.AdaptiveAvgPool2d(1),
               nn.Flatten(), nn.Linear(1280, classes)]
    return nn.Sequential(*layers)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    loss.item()
    return time.perf_counter() - t0


def run(batch: int, size: int) -> dict[str, float]:
    torch.manual_seed(0)
    cpu = efficientnet_b0()
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, 1000, (batch,))
    cpu_s = _step(cpu, torch.optim.SGD(cpu.parameters(), lr=0.01), x, y)
    opt = torch.optim.SGD(dev.parameters(), lr=0.01)
    xd, yd = x.to("neuron"), y.to("neuron")
    device = torch_bridge.runtime.runtime().device
    before = device.simulated
    first = _step(dev, opt, xd, yd)
    simulated = device.simulated - before
    second = _step(dev, opt, xd, yd)
    return {"cpu_s": cpu_s, "first_s": first, "second_s": second, "kernels_simulated": simulated,
            "params": sum(p.numel() for p in cpu.parameters())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=whole(1, 1024), default=8)
    p.add_argument("--size", type=whole(64, 1024), default=224,
                   help="image side (EfficientNet-B0 halves it 5 times: 64 leaves 2x2, which batch norm takes at batch 1)")
    p.add_argument("--quick", action="store_true", help="batch 1 at 64x64")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.size = 1, 64
    r = run(args.batch, args.size)
    print(f"EfficientNet-B0 ({r['params']:,} parameters), batch {args.batch} at {args.size}x{args.size}, "
          f"one SGD step (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(f"  CPU step:                 {r['cpu_s']:8.2f} s")
    print(f"  neuron first step:        {r['first_s']:8.2f} s  ({r['first_s'] / r['cpu_s']:.1f}x CPU; "
          f"{r['kernels_simulated']} kernels simulated)")
    print(f"  neuron second step:       {r['second_s']:8.2f} s  ({r['second_s'] / r['cpu_s']:.1f}x CPU)")
    print(f"  simulation in first step: {r['first_s'] - r['second_s']:8.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
