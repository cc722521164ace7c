"""What installing trnsim adds to a Python process's start: ``import torch`` (which loads the
neuron backend through its ``torch.backends`` entry point) against the same import with the
autoload off, in the same run; and the start of ``import torch_bridge``, ``import trnsim`` and
the ``trnsim`` command against a bare ``python -c pass``.

Each case runs ``--runs`` times in a fresh process, alternating with its baseline, and the
median of the children's CPU time (user + system, which the machine's load stretches less than
wall time) is what is compared; wall medians are printed beside it. Also printed: the installed
ml_dtypes and its own import, the one dependency whose start-up cost we choose (pyproject.toml
keeps it below 0.7, whose extension takes ~0.4 s of CPU to import).

    OMP_NUM_THREADS=1 python benchmarks/bench_import.py [--quick] [--runs N]

Nothing here is a goal with an exit status: the figures go in the benchmarks README."""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

from _args import whole  # noqa: E402  (the script beside this one)

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s) of one fresh process running ``argv``; a failing process stops the run."""
    c0, t0 = _child_cpu(), time.perf_counter()
    p = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall, cpu = time.perf_counter() - t0, _child_cpu() - c0
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"bench_import: `{' '.join(argv)}` failed (exit status {p.returncode}): {last}")
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=whole(1, 100), default=None,
                    help="fresh processes per case (default 7, 2 with --quick)")
    ap.add_argument("--quick", action="store_true", help="2 runs per case")
    args = ap.parse_args(argv)
    runs = args.runs or (2 if args.quick else 7)
    py = sys.executable
    base_env = dict(os.environ)
    base_env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    off_env = dict(base_env, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    cli = shutil.which("trnsim")
    cases = [
        # (label, argv, env, baseline label)
        ("python -c pass", [py, "-c", "pass"], base_env, None),
        ("import torch, neuron autoload off", [py, "-c", "import torch"], off_env, None),
        ("import torch (loads the neuron backend)", [py, "-c", "import torch"], base_env,
         "import torch, neuron autoload off"),
        ("import torch_bridge", [py, "-c", "import torch_bridge"], base_env, "import torch, neuron autoload off"),
        ("import trnsim", [py, "-c", "import trnsim"], base_env, "python -c pass"),
        ("import ml_dtypes", [py, "-c", "import ml_dtypes"], base_env, "python -c pass"),
    ]
    if cli is not None:
        cases.append(("trnsim --help", [cli, "--help"], base_env, "python -c pass"))
    import ml_dtypes

    print(f"start-up on this machine: {runs} fresh processes per case, alternating; medians of child CPU "
          f"(user + system) and wall; ml_dtypes {ml_dtypes.__version__}")
    samples: dict[str, list[tuple[float, float]]] = {label: [] for label, *_ in cases}
    for _ in range(runs):  # round-robin, so a burst of load falls on every case alike
        for label, cmd, env, _base in cases:
            samples[label].append(run_once(cmd, env))
    med = {label: (statistics.median(w for w, _ in s), statistics.median(c for _, c in s))
           for label, s in samples.items()}
    print(f"{'case':<42} {'CPU s':>7} {'wall s':>7}   against")
    for label, _cmd, _env, base in cases:
        wall, cpu = med[label]
        against = ""
        if base is not None:
            bw, bc = med[base]
            against = f"{base}: +{cpu - bc:.3f} s CPU ({cpu / bc:.2f}x), +{wall - bw:.3f} s wall"
        print(f"{label:<42} {cpu:>7.3f} {wall:>7.3f}   {against}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
