"""The markers of the inner loop, in one place: ``pytest -m "not slow and not subprocess"``.

* ``slow``: equivalence sweeps (C vs Python builder and scheduler on every library kernel), the
  OpInfo and differential runs, fuzzing, whole-model runs (the model zoo, parallel training,
  compiled models, timing-only estimates of real models) and the wheel build.
* ``subprocess``: a test that starts processes (torchrun, the ``trnsim`` command, Ray, pip): every
  test of a file listed below, and any other test whose body (or a helper of its module that it
  calls) runs ``subprocess``/``sys.executable``.

The default ``pytest`` (the README's test command, CI) still runs everything. A test file may
also mark itself (``pytestmark = pytest.mark.slow``); this table is for the files that predate
the markers.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent

# test modules share tables by module name across folders (the sim equivalence tests take
# test_kernel_library's SMALL shapes): every test folder is on the import path, as the top one is
for _folder in sorted(HERE.iterdir()):
    if _folder.is_dir() and any(_folder.glob("test_*.py")) and str(_folder) not in sys.path:
        sys.path.append(str(_folder))

SLOW = {
    "builder/test_build_equivalence.py", "sim/test_sim_equivalence.py", "sim/test_sim_scan.py", "test_fuzz.py",
    "torch/test_opinfo_core.py", "torch/test_differential.py", "torch/test_model_zoo.py",
    "torch/test_parallel_training.py", "torch/test_compile_benchmark.py", "torch/test_compile_models.py",
    "torch/test_timing_only.py", "torch/test_models.py", "torch/test_costs.py", "torch/test_hf_integration.py",
    "torch/test_estimate.py", "torch/test_estimate_kernels.py", "torch/test_train_step.py",
    "torch/test_sweep_estimates.py", "torch/test_streams_events.py", "torch/test_host_cache.py",
}
SUBPROCESS = {
    "torch/test_distributed.py", "torch/test_cli_run.py", "torch/test_compile_cli.py", "sweep/test_sweep_ray.py",
    "collectives/test_bench_collectives.py", "sweep/test_bench_sweep_executors.py", "torch/test_bench_datapath_step.py",
    "torch/test_bench_distributed.py", "torch/test_bench_moe.py", "test_examples.py", "sweep/test_sweep_safety.py",
}
_STARTS = re.compile(r"\bsubprocess\.|\bsys\.executable\b|\btorchrun\b|multiprocessing|ProcessPoolExecutor")


def _helpers_that_start_processes(module: ModuleType) -> set[str]:
    out = set()
    for name, obj in vars(module).items():
        if inspect.isfunction(obj) and getattr(obj, "__module__", None) == module.__name__ \
                and not name.startswith("test_"):
            try:
                if _STARTS.search(inspect.getsource(obj)):
                    out.add(name)
            except (OSError, TypeError):
                pass
    return out


def _starts_processes(item: Any, cache: dict[str, set[str]]) -> bool:
    fn = getattr(item, "function", None)
    module = getattr(item, "module", None)
    if fn is None or module is None:
        return False
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    if _STARTS.search(src):
        return True
    helpers = cache.setdefault(module.__name__, _helpers_that_start_processes(module))
    return any(re.search(rf"\b{re.escape(h)}\(", src) for h in helpers)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cache: dict[str, set[str]] = {}
    for item in items:
        try:
            rel = Path(str(item.fspath)).resolve().relative_to(HERE).as_posix()
        except ValueError:
            continue
        if rel in SLOW:
            item.add_marker(pytest.mark.slow)
        if rel in SUBPROCESS or _starts_processes(item, cache):
            item.add_marker(pytest.mark.subprocess)
