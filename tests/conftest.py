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
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent

# the neuron device's on-disk cost cache (trnsim.device.costcache.device_cache_dir) stays off in
# tests, whatever the shell asks: a test's kernels are simulated by the code under test, and the
# processes tests start inherit this. Tests of the cache name their own directory.
os.environ.pop("TRNSIM_COST_CACHE", None)

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
    "torch/test_hf_families.py",
}
SUBPROCESS = {
    "torch/test_distributed.py", "torch/test_cli_run.py", "torch/test_compile_cli.py", "sweep/test_sweep_ray.py",
    "collectives/test_bench_collectives.py", "sweep/test_bench_sweep_executors.py", "torch/test_bench_datapath_step.py",
    "torch/test_bench_distributed.py", "torch/test_bench_moe.py", "test_examples.py", "sweep/test_sweep_safety.py",
}
# Single long tests (or long parameters of a test) that the inner loop leaves out: each is >= ~2 s
# of CPU and its module keeps faster tests in the inner loop (CI runs them all). Chosen from
# ``pytest -m "not slow and not subprocess" --durations=120``; a test id or its prefix.
SLOW_TESTS = (
    # every library kernel built at its default shape, on trn2 and trn3 (~5 s each; the small-shape
    # reference checks of every kernel stay in the loop)
    "kernels/test_kernel_library.py::test_every_kernel_builds_at_the_default_shape_it_lists",
    # two one-layer training estimates with and without CP (~20 s cold; the CP refusals stay in the loop)
    "torch/test_context_parallel.py::test_ring_attention_step_worked_by_hand",
    # two one-layer MXFP8/bf16 training estimates on trn3 (~25 s cold; the CLI refusals and the
    # mx_quantize kernel tests stay in the loop)
    "torch/test_mxfp8_train.py::test_mxfp8_linears_are_charged_the_casts_and_the_mx_matmuls",
    # the (130, 640)/(200, 2688) byte checks of every layout and dtype stay; e5m2 is the same program
    "kernels/test_mx_quantize.py::test_mx_quantize_e5m2",
    # two tiny Llama training estimates (~7 s; the hand-worked async timeline stays in the loop)
    "torch/test_async_collectives.py::test_nxd_async_linear_overlaps_the_sequence_parallel_collectives_in_a_step",
    # three 64-rank two-instance all-reduces on 1-8 channels (the channel counts stay in the loop)
    "collectives/test_collective_algorithms.py::test_more_channels_cost_the_cc_core_more_issues",
    # the testers' whole op sample (flex_attention's formulas stay)
    "torch/test_flop_rule.py::test_every_served_op_is_charged_the_flops_counted_on_the_testers_samples",
    # compiled generation (eager left-padded generation stays)
    "torch/test_compile_generate.py::test_left_padded_generate_gives_cpu_tokens[compiled-",
    "torch/test_compile_generate.py::test_static_cache_generate_gives_cpu_tokens",
    # HF static-cache generation (the dynamic-cache ones stay)
    "torch/test_hf_masks.py::test_t5_padded_generate_matches_cpu[static]",
    "torch/test_hf_masks.py::test_gpt2_left_padded_generate_matches_cpu[static]",
    # RNN cells on the fast path: one of the eight dtype/bias/cell variants stays (float32, LSTM)
    "torch/test_fastpath.py::test_rnn_cells_and_copies_and_allocations_are_the_python_path_s_bit_for_bit[dtype1-",
    "torch/test_fastpath.py::test_rnn_cells_and_copies_and_allocations_are_the_python_path_s_bit_for_bit[dtype0-False-",
    "torch/test_fastpath.py::test_rnn_cells_and_copies_and_allocations_are_the_python_path_s_bit_for_bit[dtype0-True-GRU]",
    "torch/test_compile_flex.py::test_a_block_mask_skips_its_fully_masked_blocks",
    "torch/test_moe.py::test_compiled_model_holds_each_block_as_one_node",
    # the largest shapes of the kernel sweeps (the smaller shapes of each kernel stay)
    "kernels/test_kernels_transformer.py::test_values_match_the_reference[attention_tkg-40x1x1x1x5120x64-",
    "kernels/test_kernels_transformer.py::test_values_match_the_reference[attention_cte-1x2x1x2300x64-",
    "kernels/test_kernels_transformer.py::test_time_is_near_the_bound[attention_cte-1x8x1x4096x128-",
    "kernels/test_kernels_norm.py::test_hidden_32768_is_tiled_not_refused[layernorm]",
    "kernels/test_kernels_norm.py::test_hidden_32768_is_tiled_not_refused[rmsnorm_fp8]",
    "native/test_native.py::test_fp32_in_place_and_packed_paths",
    "isa/test_functional.py::test_matmul_kernel_matches_the_datapath_definition",
    # collectives: the largest closed-form comparisons (the other groups and systems stay)
    "collectives/test_collective_algorithms.py::test_simulation_matches_the_alpha_beta_form_where_it_holds[trn2.48xlarge-all-gather-bidir-ring-group1]",
    "collectives/test_collective_algorithms.py::test_per_dimension_and_hierarchical_compositions",
    "collectives/test_collective_algorithms.py::test_bidirectional_ring_halves_the_link_bytes",
    "collectives/test_collective_flat_ring.py::test_the_size_rule_does_not_pick_it_yet",
    "collectives/test_collective_network.py::test_the_estimate_carries_the_runtime_costs",
    "collectives/test_collective_forms.py::test_simulation_within_2_percent_of_the_form_where_it_holds[all-gather-ring-trn2.48xlarge]",
    "collectives/test_collective_forms.py::test_simulation_within_2_percent_of_the_form_where_it_holds[all-reduce-ring-trn2.48xlarge]",
    "collectives/test_collective_forms.py::test_simulation_within_2_percent_of_the_form_where_it_holds[reduce-scatter-ring-trn2.48xlarge]",
    "collectives/test_collective_algorithms.py::test_ranks_spread_over_instances_as_neuron_numbers_them",
    # the 8-rank symmetric runs (the 2- and 4-rank ones and the sibling-call runs stay)
    "collectives/test_collective_symmetry.py::test_a_symmetric_run_reports_exactly_what_the_full_run_does[system0-call0-16]",
    "collectives/test_collective_symmetry.py::test_a_symmetric_run_reports_exactly_what_the_full_run_does[system5-call5-8]",
    "collectives/test_collective_symmetry.py::test_representatives_built_directly_are_exactly_the_orbits_of_the_full_schedule[system0-call0]",
    "collectives/test_collective_symmetry.py::test_representatives_built_directly_are_exactly_the_orbits_of_the_full_schedule[system5-call5]",
    "collectives/test_collective_concurrency.py::test_a_call_beside_another_familys_running_call_and_siblings_is_slower_both_ways",
    # Parquet sweeps that run a sweep twice (the rows, Ctrl-C, torn-journal and foreign-file tests stay)
    "sweep/test_sweep_parquet.py::test_a_second_sweep_on_the_same_parquet_file_is_refused",
    "sweep/test_sweep_parquet.py::test_a_killed_parquet_sweep_resumes_from_its_journal",
    "torch/test_compile_flex.py::test_inductor_hard_coded_for_flex_attention_runs_the_neuron_backend",
    "collectives/test_collective_algorithms.py::test_simulation_matches_the_alpha_beta_form_where_it_holds[trn1.32xlarge-all-reduce-ring-group7]",
    "collectives/test_collective_concurrency.py::test_tp_and_dp_collectives_of_one_step_slow_each_other_on_shared_links",
    "sweep/test_sweep_collectives.py::test_collective_rows_match_direct_runs",
    "torch/test_compile_foreach.py::test_compiled_step_is_one_kernel_with_eager_values[sgd momentum]",
    "torch/test_compile_flex.py::test_a_score_mod_that_cannot_fuse_says_so_in_a_line",
    "kernels/test_kernels_transformer.py::test_time_is_near_the_bound[moe_tkg-4x4096x1792x8-",
    # the scheduler's random programs: seeds 0-6 and 11 stay
    "sim/test_schedule.py::test_never_reorders_across_a_dependency[7]",
    "sim/test_schedule.py::test_never_reorders_across_a_dependency[8]",
    "sim/test_schedule.py::test_never_reorders_across_a_dependency[9]",
    "sim/test_schedule.py::test_never_reorders_across_a_dependency[10]",
    "builder/test_build_replay_attention.py::test_variants_same_stream[shape7-",
    # replay: the largest variants (the other shapes and the same-stream checks stay)
    "builder/test_build_replay.py::test_fp8_double_row_and_streaming_plan_never_replay",
    "builder/test_build_replay_attention.py::test_variants_same_stream[shape5-",
    "torch/test_compile_flex.py::test_compiled_flex_attention_matches_cpu_forward_and_backward",
    # whole-command goldens whose commands keep faster tests (the digest pins their output too)
    "cli/test_cli_collective.py::test_all_reduce_table_golden",
    "cli/test_cli.py::test_demo_golden",
)
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
        if rel in SLOW or f"{rel}::{item.name}".startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
        if rel in SUBPROCESS or _starts_processes(item, cache):
            item.add_marker(pytest.mark.subprocess)
