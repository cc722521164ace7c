"""A DDP training step of the small GPT-2 on 2 and 4 virtual NeuronCores: wall time, simulated
time, and how much of it the collectives took and hid behind compute.

The model is bench_torch_train.py's small GPT-2 (examples/train_gpt2.py's make_model: 4 layers,
width 256, 4 heads, sequence 128, 3.26 M parameters) on a global batch of 8 sequences split
over the ranks, AdamW (lr 3e-3). Every run goes through ``trnsim run --nproc``'s launcher
(torchrun's, one process per rank on trn2.48xlarge, rank r on NeuronCore r); the baseline is
the same step in one process without torch.distributed, measured in the same run. Per run it
prints:

* wall seconds per step (rank 0, the median of the steps after the first, which simulates
  every kernel for the first time) and the ratio to the one-process baseline;
* simulated microseconds per step as the slowest rank saw it (trnsim.ranks), and the ratio to
  the baseline's;
* per step, the time rank 0 spent in collectives, its share of the step, how much of it was
  overlapped (hidden behind the backward pass's compute or the host still issuing it: DDP's
  bucketed all-reduce) and how much was exposed (compute stalled on it: a kernel issued and held
  back, none running).

    OMP_NUM_THREADS=1 python3 benchmarks/bench_distributed.py [--steps 5] [--ranks 2,4]
    OMP_NUM_THREADS=1 python3 benchmarks/bench_distributed.py --quick   # the demo GPT-2, 2 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TRNSIM_NATIVE_THREADS"):
    os.environ[_name] = "1"

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from _args import whole, wholes  # noqa: E402  (the script beside this one)

MODELS = {"small": dict(layers=4, embd=256, heads=4, seq=128, batch=8),
          "demo": dict(layers=2, embd=64, heads=4, seq=64, batch=8)}


def worker(out: str, model: str, steps: int, distributed: bool) -> None:
    """One rank (under the launcher): ``steps`` AdamW steps, timing each; the report covers the
    steps after the first."""
    import torch

    from train_gpt2 import batches, make_model

    m = MODELS[model]
    rank, world = 0, 1
    if distributed:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("neuron")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = make_model(m["seq"], m["layers"], m["embd"], m["heads"]).to("neuron")
    step_model = DDP(net) if distributed else net
    opt = torch.optim.AdamW(step_model.parameters(), lr=3e-3)
    walls = []
    for step, x in enumerate(batches(m["batch"], m["seq"], steps)):
        if step == 1:
            torch.neuron.reset_report(trace=True)  # steady state: the merged report covers these steps
        t0 = time.perf_counter()
        x = x.chunk(world)[rank].to("neuron")
        loss = step_model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        walls.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"walls": walls}))
    if distributed:
        dist.destroy_process_group()


@dataclass
class Run:
    ranks: int
    wall_s: float
    sim_us: float
    coll_us: float
    overlapped_us: float
    beside_us: float


def measure(model: str, steps: int, ranks: int, distributed: bool) -> Run:
    from torch_bridge.launch import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        args = ["--worker", out, "--model", model, "--steps", str(steps)] + (["--distributed"] if distributed else [])
        rep = run_ranks(__file__, args, ranks)
        data = json.loads(Path(out).read_text())
    measured = steps - 1
    s = rep.summaries[0]
    return Run(ranks if distributed else 1, statistics.median(data["walls"][1:]), rep.step_us, s.collective_us / measured,
               s.overlapped_us / measured, s.beside_compute_us / measured)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=whole(2, 1000), default=5, help="AdamW steps per run, the first left out (default 5)")
    p.add_argument("--ranks", type=wholes(2, 64), default=[2, 4],
                   help="world sizes to run, each dividing the global batch of 8 (default 2,4)")
    p.add_argument("--model", choices=sorted(MODELS), default="small", help="GPT-2 size (default small)")
    p.add_argument("--quick", action="store_true", help="the demo GPT-2 on 2 ranks, 2 steps (what the test runs)")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--distributed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.model, args.steps, args.distributed)
        return 0
    if args.quick:
        args.model, args.steps, args.ranks = "demo", 2, [2]
    m = MODELS[args.model]
    uneven = [w for w in args.ranks if m["batch"] % w]
    if uneven:  # (each rank takes an equal share of the global batch)
        p.error(f"--ranks {uneven[0]}: expected world sizes that divide the global batch of {m['batch']} "
                f"({', '.join(str(w) for w in range(2, m['batch'] + 1) if m['batch'] % w == 0)})")
    worlds = args.ranks
    print(f"DDP step of the {args.model} GPT-2 ({m['layers']} layers, width {m['embd']}, {m['heads']} heads, sequence "
          f"{m['seq']}, global batch {m['batch']}) on trn2.48xlarge; {args.steps - 1} measured steps per run")
    base = measure(args.model, args.steps, 1, False)
    runs = [base] + [measure(args.model, args.steps, w, True) for w in worlds]
    head = (f"{'ranks':>5} {'wall s/step':>12} {'x 1 proc':>9} {'sim us/step':>12} {'x 1 proc':>9} "
            f"{'collectives us':>15} {'share':>6} {'overlapped':>11} {'beside compute':>15} {'exposed us':>11}")
    print(head)
    for r in runs:
        share = 100.0 * r.coll_us / r.sim_us if r.sim_us else 0.0
        over = 100.0 * r.overlapped_us / r.coll_us if r.coll_us else 0.0
        beside = 100.0 * r.beside_us / r.coll_us if r.coll_us else 0.0
        name = f"{r.ranks}" if r is not base else "1*"
        print(f"{name:>5} {r.wall_s:>12.3f} {r.wall_s / base.wall_s:>8.2f}x {r.sim_us:>12,.1f} "
              f"{r.sim_us / base.sim_us:>8.2f}x {r.coll_us:>15,.1f} {share:>5.1f}% {over:>10.1f}% {beside:>14.1f}% "
              f"{r.coll_us - r.overlapped_us:>11,.1f}")
    print("(* one process, no torch.distributed: the baseline. wall: rank 0's median step; sim: the slowest rank's "
          "simulated step; collectives: rank 0's per step and their share of the simulated step; overlapped: hidden "
          "behind compute or the host still issuing; beside compute: with a kernel running at the same time; "
          "exposed: compute stalled on them)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
