"""Wall time of `trnsim estimate`: Llama-3.3-70B inference on a trn2.48xlarge, TP=64 with sequence
parallelism, 10,000 tokens in and 1,500 out (the datasheet's V5 setup), and how it grows.

Prints, in one run:

* **cold**: a fresh kernel-cost cache - every distinct kernel and collective is simulated (goal
  <= 60 s);
* **warm**: the same estimate again on that cache (goal <= 10 s), and beside it the baseline of
  the same warm run with every decoder layer run rather than replayed (``replay=False``), with
  the ratio;
* growth with layers (20, 40, 80; warm) and with the prompt (2,500, 5,000, 10,000 tokens; each
  cold on its own cache, since a new length is new kernels);
* the CLI itself, warm, as a subprocess (Python start-up and the torch/transformers imports
  included).

Exit status 1 if the cold or warm goal is missed. ``--quick`` runs a small Llama-3.1-8B
estimate (4 layers, TP=8) for the tests.

    OMP_NUM_THREADS=1 python3 benchmarks/bench_estimate.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch_bridge  # noqa: E402,F401  (registers the neuron device)
from torch_bridge.estimate import estimate_inference  # noqa: E402

COLD_GOAL_S, WARM_GOAL_S = 60.0, 10.0
FULL = dict(model="llama-3.3-70b", system="trn2.48xlarge", tp=64, sp=True, input_tokens=10000, output_tokens=1500,
            samples=5)
QUICK = dict(model="llama-3.1-8b", system="trn2.48xlarge", tp=8, sp=True, input_tokens=512, output_tokens=64, samples=3,
             layers=4)


def timed(cache: str, **kw: object) -> tuple[float, object]:
    t = time.perf_counter()
    est, _ = estimate_inference(cache_dir=cache, **kw)  # type: ignore[arg-type]
    return time.perf_counter() - t, est


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small 8B estimate, no growth series, no CLI run")
    args = ap.parse_args(argv)
    base = QUICK if args.quick else FULL
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (other processes share the machine)")
    with tempfile.TemporaryDirectory() as cache:
        t_cold, est = timed(cache, **base)
        print(f"{base['model']} TP={base['tp']} SP, {base['input_tokens']:,} in / {base['output_tokens']:,} out: "
              f"TTFT {est.ttft_ms:,.1f} ms, TPOT {est.tpot_ms:,.2f} ms")  # type: ignore[attr-defined]
        print(f"cold  {t_cold:7.1f} s  ({est.kernels_simulated} kernels simulated; goal <= {COLD_GOAL_S:.0f} s: "  # type: ignore[attr-defined]
              f"{'met' if t_cold <= COLD_GOAL_S else 'MISSED'})")
        t_warm, est = timed(cache, **base)
        print(f"warm  {t_warm:7.1f} s  ({est.cache_hits} costs from the cache; goal <= {WARM_GOAL_S:.0f} s: "  # type: ignore[attr-defined]
              f"{'met' if t_warm <= WARM_GOAL_S else 'MISSED'})")
        t_full, full = timed(cache, **{**base, "replay": False})
        same = abs(full.ttft_ms - est.ttft_ms) < 1e-9 and abs(full.tpot_ms - est.tpot_ms) < 1e-9  # type: ignore[attr-defined]
        print(f"baseline: warm, every layer run (no replay) {t_full:7.1f} s; replay is {t_full / t_warm:.1f}x faster "
              f"with {'the same' if same else 'A DIFFERENT'} estimate")
        ok = t_cold <= COLD_GOAL_S and t_warm <= WARM_GOAL_S and same
        if args.quick:
            return 0 if same else 1
        print("growth with layers (warm cache):")
        for n in (20, 40, 80):
            t, e = timed(cache, **{**base, "layers": n})
            print(f"  {n:3d} layers {t:7.1f} s  TTFT {e.ttft_ms:8.1f} ms  TPOT {e.tpot_ms:6.2f} ms")  # type: ignore[attr-defined]
    print("growth with the prompt (each cold: new kernels):")
    for n in (2500, 5000, 10000):
        with tempfile.TemporaryDirectory() as fresh:
            t, e = timed(fresh, **{**base, "input_tokens": n})
            print(f"  {n:6,d} tokens {t:7.1f} s  {e.kernels_simulated:4d} kernels  TTFT {e.ttft_ms:8.1f} ms")  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as cache:
        cmd = [sys.executable, "-m", "trnsim.cli", "estimate", "inference", "--model", base["model"], "--tp",  # type: ignore[list-item]
               str(base["tp"]), "--sp", "--input", str(base["input_tokens"]), "--output", str(base["output_tokens"])]
        env = {**os.environ, "TRNSIM_CACHE_DIR": cache}
        subprocess.run(cmd, capture_output=True, env=env, check=True)
        t = time.perf_counter()
        subprocess.run(cmd, capture_output=True, env=env, check=True)
        print(f"CLI, warm, as a subprocess (start-up and imports included): {time.perf_counter() - t:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
