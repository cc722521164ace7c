"""One sweep on the local process pool and on a local Ray instance, in the same run.

The sweep: 40 chip variants (TensorE clock x DMA engine bandwidth x SBUF size) x 5 kernel points
(two matmuls, rmsnorm, softmax, a binary add) = 200 points, timing-only, each executor writing
its own CSV; the script checks that both wrote the same rows and prints the wall time of each,
their ratio, Ray's start-up time apart (``ray.init`` of a local instance) and the machine's
load average before and after (the machine may be shared).

    OMP_NUM_THREADS=1 python benchmarks/bench_sweep_executors.py [--quick] [--jobs N]

Without Ray installed only the pool runs. Exit status 1 if the two executors' rows differ.
``--quick`` (8 points) is what the tests run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from trnsim.config import ConfigError  # noqa: E402
from trnsim.sweep import check_jobs, load_spec, run_sweep  # noqa: E402

FULL = """config: trn2
grid:
  core.tensor.clock: [2.0GHz, 2.2GHz, 2.4GHz, 2.6GHz, 2.8GHz]
  core.dma.engine_bandwidth: [20GB/s, 27.2GB/s, 32GB/s, 40GB/s]
  core.sbuf.partition_bytes: [192KiB, 224KiB]
kernels:
  - {name: matmul, shapes: [512x1024x1024, 1024x1024x2048], dtype: bf16}
  - {name: rmsnorm, shape: 1024x4096, dtype: bf16}
  - {name: softmax, shape: 512x2048, dtype: bf16}
  - {name: binary, shape: 1024x2048, dtype: bf16}
"""

QUICK = """config: trn2
grid:
  core.tensor.clock: [2.4GHz, 2.8GHz]
  core.dma.engine_bandwidth: [27.2GB/s, 40GB/s]
kernels:
  - {name: matmul, shape: 256x512x512, dtype: bf16}
  - {name: rmsnorm, shape: 256x1024, dtype: bf16}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 points instead of 200")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="pool workers and Ray CPUs (default: CPUs)")
    args = ap.parse_args(argv)
    try:
        check_jobs(args.jobs)  # (run_sweep's own check, both bounds, made before anything is printed)
    except ConfigError as e:
        ap.error(str(e))
    try:
        import ray
    except ImportError:
        ray = None
    with tempfile.TemporaryDirectory(prefix="trnsim-bench-sweep-") as tmp:
        spec_path = Path(tmp) / "spec.yaml"
        spec_path.write_text(QUICK if args.quick else FULL)
        n = len(load_spec(spec_path).points)
        load0 = os.getloadavg()
        print(f"sweep of {n} points, timing-only, {args.jobs} workers; load average before: "
              f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} on {os.cpu_count()} CPUs")
        t = time.perf_counter()
        pool = run_sweep(load_spec(spec_path, Path(tmp) / "pool.csv"), jobs=args.jobs)
        pool_s = time.perf_counter() - t
        print(f"  pool  {pool_s:8.2f} s  {n / pool_s:6.1f} points/s  ({pool.ran} run)")
        same = True
        if ray is None:
            print("  ray   not installed (python3 -m pip install -e '.[ray]'): skipped")
        else:
            t = time.perf_counter()
            ray.init(num_cpus=args.jobs, include_dashboard=False, log_to_driver=False, object_store_memory=256 << 20,
                     logging_level="ERROR")
            init_s = time.perf_counter() - t
            try:
                t = time.perf_counter()
                on_ray = run_sweep(load_spec(spec_path, Path(tmp) / "ray.csv"), executor="ray")
                ray_s = time.perf_counter() - t
            finally:
                ray.shutdown()
            same = on_ray.rows == pool.rows
            print(f"  ray   {ray_s:8.2f} s  {n / ray_s:6.1f} points/s  ({on_ray.ran} run) + {init_s:.2f} s to start "
                  f"the local instance")
            print(f"  ray / pool: {ray_s / pool_s:.2f}x on the points, {(ray_s + init_s) / pool_s:.2f}x with start-up; "
                  f"rows {'identical' if same else 'DIFFER'}")
        load1 = os.getloadavg()
        print(f"load average after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
