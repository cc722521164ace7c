"""The benchmarks refuse a bad number in one line, exit status 2, before they run anything
(benchmarks/_args.py): a zero count used to run with the default, divide by zero, or report a run
of nothing as clean. The examples likewise refuse what they cannot run (a kernel's limit, a host
allocation of a terabyte, a distributed run started without a launcher)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from _args import share, whole  # noqa: E402


def test_whole_and_share():
    assert whole(1, 10)("3") == 3 and whole(0)("0") == 0
    for bad in ("0", "11", "x", "2.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number from 1 to 10"):
            whole(1, 10)(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="of at least 1, got '-1'"):
        whole(1)("-1")
    assert share("0") == 0.0 and share("0.8") == 0.8 and share("1") == 1.0
    for bad in ("2", "-0.1", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a number from 0 to 1"):
            share(bad)


@pytest.mark.parametrize("script, args, says", [
    ("bench_zoo.py", ["--steps", "0"], "argument --steps: expected a whole number from 1 to 1000, got '0'"),
    ("bench_zoo.py", ["--rounds", "0"], "argument --rounds: expected a whole number from 1 to 100"),
    ("bench_native.py", ["--repeats", "0"], "argument --repeats: expected a whole number from 1 to 1000"),
    ("bench_lstm.py", ["--steps", "0"], "argument --steps: expected a whole number from 1 to 1000, got '0'"),
    ("bench_op_overhead.py", ["--iters", "0"], "argument --iters: expected a whole number"),
    ("bench_compile.py", ["--steps", "2"], "argument --steps: expected a whole number from 3 to 1000, got '2'"),
    ("bench_compile.py", ["--pairs", "0"], "argument --pairs: expected a whole number from 1 to 1000, got '0'"),
    ("bench_torch_train.py", ["--steps", "2"], "argument --steps: expected a whole number from 3 to 1000, got '2'"),
    ("bench_torch_train.py", ["--rounds", "0"], "argument --rounds: expected a whole number from 1 to 100, got '0'"),
    ("bench_distributed.py", ["--steps", "1"], "argument --steps: expected a whole number from 2 to 1000, got '1'"),
    ("bench_distributed.py", ["--ranks", "2,x"], "argument --ranks: '2,x': expected a whole number from 2 to 64, "
                                                  "got 'x' (comma-separated)"),
    ("bench_distributed.py", ["--ranks", "3"], "--ranks 3: expected world sizes that divide the global batch of 8 "
                                               "(2, 4, 8)"),
    ("bench_import.py", ["--runs", "0"], "argument --runs: expected a whole number from 1 to 100, got '0'"),
    ("bench_sweep_executors.py", ["--jobs", "100000"], "--jobs 100000: expected a positive number of worker"),
    ("difftest.py", ["--samples", "0"], "argument --samples: expected a whole number of at least 1"),
    ("difftest.py", ["--dtypes", "float33"], "--dtypes 'float33': expected comma-separated names of float32"),
    ("difftest.py", ["--ops", "nosuchop"], "--ops: 'nosuchop' is not an aten op packet"),
    ("opinfo_full.py", ["--limit", "-1"], "argument --limit: expected a whole number of at least 1"),
])
def test_a_bad_number_is_refused_in_one_line(script, args, says):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                         timeout=300, env=env)
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert len(errors) == 1 and says in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not out.stdout.strip()


EXAMPLES = BENCH.parent / "examples"


@pytest.mark.parametrize("script, args, says", [
    ("softmax_kernel.py", ["--cols", "0"], "--cols must be a positive integer, got 0"),
    ("softmax_kernel.py", ["--cols", "100000"], "--rows 1024 --cols 100000: tensor_reduce(max): tile 'io[0]' access"),
    ("train_gpt2.py", ["--seq", "100000"], "the attention scores take 1192.1 GiB a block; expected at most 1 GiB"),
    ("train_gpt2_parallel.py", ["--parallel", "ddp"], "--parallel ddp runs one process per rank: start it with torchrun"),
])
def test_an_example_refuses_what_it_cannot_run_in_one_line(script, args, says):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                         timeout=300, env=env)
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert len(errors) == 1 and says in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
