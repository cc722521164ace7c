"""How trnsim predicts a ledger row: one function per ``predict.how``.

Every predictor takes the row's ``predict`` arguments (``how`` and ``output`` removed), the
row's chip and the run's config overrides, and returns the figures it computed, each as
``(dimension, value in the dimension's base unit)`` (seconds, bytes/s, percent, 1/s). The row's
``output`` picks one figure; its unit must measure the same dimension.

=============  ===============================================================================
``kernel``     a library kernel (``trnsim kernel NAME``), timing only, on one core, on the
               physical cores of a logical core (``cores: lnc``, the shape split as the device
               model splits it) or the same kernel on every core (``cores: all``); or a kernel
               file of the ledger (``validation/kernels/x.py:fn``, the builder's convention)
``nki``        an NKI kernel file (``file: validation/nki/x.py:fn``), traced, scheduled and
               simulated timing only with the given input shapes
``probe``      a probe kernel of :mod:`trnsim.validate.probes` (one DMA, a dependent chain)
``collective`` a collective on a system (``trnsim collective``)
``estimate``   ``trnsim estimate inference|train`` (needs torch: imported only here)
=============  ===============================================================================

Figures of a kernel run: ``latency``; ``tensor_active``, ``vector_active``, ``scalar_active``,
``gpsimd_active``, ``dma_active``, ``mfu``, ``hfu``, ``mbu`` (percent, of the slowest core);
``hbm_bandwidth`` (the slowest core's HBM bytes over its time).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

from ..config import ConfigError, clip_text, format_value, load_config
from ..config.schema import split_override
from ..isa import KernelError
from ..config.ledger import VALIDATION_DIR, LedgerError
from .probes import PROBES, Figure

__all__ = ["PREDICTORS", "predict", "PredictionError"]

REPO_DIR = VALIDATION_DIR.parent


class PredictionError(Exception):
    """trnsim could not produce the row's figure (the setup does not fit, a kernel refuses it):
    reported on the row, never dropped."""


def _args(args: Mapping[str, Any], allowed: Sequence[str], how: str) -> None:
    for k in args:
        if k not in allowed:
            raise LedgerError(f"predict how: {how}: unknown argument '{clip_text(str(k), 40)}': expected "
                              f"{', '.join(allowed)}")


@functools.cache
def _calibrated_keys() -> frozenset[str]:
    """The keys of every shipped chip and system config's calibrated parameters."""
    from ..config import config_names, load_system
    from ..config.system import system_names

    cfgs = [load_config(n) for n in config_names()] + [load_system(n) for n in system_names()]
    return frozenset(c.key for cfg in cfgs for c in cfg.calibrations)


def _overrides(args: Mapping[str, Any], run: Sequence[str]) -> list[str]:
    """The row's own ``set`` (the setup it was measured on, e.g. how many instances), then the
    run's ``--set``. A row may not move a calibrated parameter for its own prediction: that would
    fit the parameter to the row outside the config's provenance (docs/fidelity.md, two roles)."""
    own = args.get("set", [])
    if not isinstance(own, list) or not all(isinstance(s, str) for s in own):
        raise LedgerError(f"predict: set = {format_value(own)}: expected a list of K=V strings")
    _uncalibrated(own, "predict: set")
    return [*own, *run]


def _uncalibrated(overrides: Sequence[str], what: str) -> None:
    for o in overrides:
        key = split_override(o)[0].strip()
        if key in _calibrated_keys():
            raise LedgerError(f"{what} {clip_text(o, 80)}: {key} is a calibrated parameter (its config names the "
                              f"calibration rows that set it); a row's prediction may not move it")


def _kernel_figures(reports: Sequence[Any]) -> dict[str, Figure]:
    slow = max(reports, key=lambda r: r.total_ticks)
    seconds = slow.total_ticks / slow.tick_hz
    out: dict[str, Figure] = {"latency": ("time", seconds)}
    for name, st in slow.engines.items():
        out[f"{name.lower()}_active"] = ("percent", st.active_percent)
    out["dma_active"] = ("percent", slow.dma.active_percent)
    out["mfu"] = ("percent", slow.mfu_estimated_percent)
    out["hfu"] = ("percent", slow.hfu_estimated_percent)
    out["mbu"] = ("percent", slow.mbu_estimated_percent)
    out["hbm_bandwidth"] = ("bandwidth", (slow.hbm_read_bytes + slow.hbm_write_bytes) / seconds if seconds else 0.0)
    return out


def _shape(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not v or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in v):
        raise LedgerError(f"predict: {what} = {format_value(v)}: expected a list of positive integers")
    return tuple(v)


def _kernel(args: Mapping[str, Any], chip: str, run: Sequence[str]) -> dict[str, Figure]:
    from ..sim.chip import Chip
    from ..kernels import build_spec, split_spec

    _args(args, ("kernel", "shape", "dtype", "config", "params", "set", "cores"), "kernel")
    cfg = load_config(args.get("config", chip), _overrides(args, run))
    name = args.get("kernel")
    if not isinstance(name, str):
        raise LedgerError("predict how: kernel needs 'kernel': a library kernel name (trnsim kernel --list) or "
                          "path/to/file.py:function relative to the repository")
    shape = _shape(args.get("shape"), "shape")
    dtype = str(args.get("dtype", "bf16"))
    params = dict(args.get("params") or {})
    cores = args.get("cores", 1)
    chip_ = Chip(cfg)
    if ".py:" in name:  # a kernel file of the ledger (validation/kernels/), the builder's calling convention
        from ..sweep import resolve_kernel

        if cores != 1:
            raise LedgerError(f"predict how: kernel: cores = {format_value(cores)}: a kernel file runs on one core")
        kernel = resolve_kernel(name, REPO_DIR).make(shape, dtype, cfg, params)
        return _kernel_figures([chip_.run(kernel, timing_only=True).report])
    if cores == 1:
        return _kernel_figures([chip_.run(build_spec(name, shape, dtype, cfg, params), timing_only=True).report])
    if cores == "lnc":
        shapes = split_spec(name, shape, params, cfg.chip.lnc)
    elif cores == "all":
        shapes = [shape] * cfg.chip.cores
    else:
        raise LedgerError(f"predict how: kernel: cores = {format_value(cores)}: expected 1, lnc or all")
    kernels = [build_spec(name, s, dtype, cfg, params) for s in shapes]
    return _kernel_figures([r.report for r in chip_.run_spmd(kernels, timing_only=True)])


def _nki(args: Mapping[str, Any], chip: str, run: Sequence[str]) -> dict[str, Figure]:
    from .. import nki
    from ..sweep import resolve_kernel

    _args(args, ("file", "shapes", "dtype", "config", "params", "set"), "nki")
    cfg = load_config(args.get("config", chip), _overrides(args, run))
    ref = args.get("file")
    if not isinstance(ref, str) or ":" not in ref:
        raise LedgerError("predict how: nki needs 'file': path/to/kernel.py:function, relative to the repository")
    kernel = resolve_kernel(ref, REPO_DIR).build
    shapes = args.get("shapes")
    if not isinstance(shapes, list) or not shapes:
        raise LedgerError("predict how: nki needs 'shapes': one shape per tensor argument")
    dtype = args.get("dtype", "bf16")
    dtypes = dtype if isinstance(dtype, list) else [dtype] * len(shapes)
    specs = [nki.tensor_spec(_shape(s, "shapes"), d) for s, d in zip(shapes, dtypes)]
    r = nki.run(kernel, *specs, config=cfg, timing_only=True, **dict(args.get("params") or {}))
    return _kernel_figures([r.report])


def _probe(args: Mapping[str, Any], chip: str, run: Sequence[str]) -> dict[str, Figure]:
    a = dict(args)
    name = a.pop("probe", None)
    if name not in PROBES:
        raise LedgerError(f"predict how: probe: probe = {format_value(name)}: expected one of {', '.join(PROBES)}")
    cfg = load_config(a.pop("config", chip), _overrides(a, run))
    a.pop("set", None)
    try:
        return PROBES[name](cfg, **a)
    except TypeError as e:
        raise LedgerError(f"predict how: probe {name}: {e}") from None


def _collective(args: Mapping[str, Any], chip: str, run: Sequence[str]) -> dict[str, Figure]:
    from ..collectives import CollectiveCall, simulate_collective, simulate_collectives
    from ..config import load_system

    _args(args, ("system", "sdk", "collective", "bytes", "ranks", "group", "pairs", "dtype", "algorithm", "set",
                 "counts", "instances", "concurrent", "streams"), "collective")
    sdk = args.get("sdk")  # the SDK release the row was measured on: its runtime (the system's runtimes:)
    if sdk is not None and not isinstance(sdk, str):
        raise LedgerError(f"predict how: collective: sdk = {format_value(sdk)}: expected a quoted release like '2.28'")
    sdk_set = [] if sdk is None else [f"collectives.sdk={sdk}"]
    sysc = load_system(str(args.get("system", "")), [*sdk_set, *_overrides(args, run)])
    nbytes = args.get("bytes")
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise LedgerError(f"predict how: collective: bytes = {format_value(nbytes)}: expected a positive integer "
                          f"(nccom-test's size(B))")
    pairs = args.get("pairs")
    streams = args.get("streams", 1)  # CC streams the program runs at once: the row's call and every concurrent one
    call = CollectiveCall(str(args.get("collective")), nbytes, args.get("ranks"), args.get("group"),
                          str(args.get("dtype", "bf16")), args.get("algorithm"), 0, None,
                          [tuple(p) for p in pairs] if isinstance(pairs, list) else None, "", args.get("counts"),
                          args.get("instances"), streams)
    others = args.get("concurrent") or []
    if not isinstance(others, list) or not all(isinstance(o, dict) for o in others):
        raise LedgerError("predict how: collective: concurrent: expected a list of calls "
                          "({collective, bytes, ranks, dtype}) that run at the same time")
    if others:  # the row's call beside others (another CC stream's): they share links, HBM and DMA
        calls = [call] + [CollectiveCall(str(o.get("collective")), o.get("bytes"), o.get("ranks"), o.get("group"),
                                         str(o.get("dtype", "bf16")), streams=streams) for o in others]
        r = simulate_collectives(sysc, calls)[0]
    else:
        r = simulate_collective(sysc, call.collective, nbytes, ranks=call.ranks, group=call.group, pairs=call.pairs,
                                dtype=call.dtype, algorithm=call.algorithm, counts=call.counts,
                                instances=call.instances, streams=streams)
    return {"time": ("time", r.time_s), "busbw": ("bandwidth", r.busbw),
            "algbw": ("bandwidth", r.nbytes / r.time_s)}


def _estimate(args: Mapping[str, Any], chip: str, run: Sequence[str]) -> dict[str, Figure]:
    import torch  # the estimate runs fake tensors through the neuron device: an app may import it here

    from torch_bridge.timing.estimate import EstimateError, estimate_inference, estimate_train

    from ..workload.plan import PlanError

    a = dict(args)
    mode = a.pop("mode", None)
    a["overrides"] = _overrides(a, run)
    a.pop("set", None)
    if "plan" in a and mode == "train":  # a published run's plan (configs/plans), the row's keys over it
        from ..workload.training import Recipe, load_plan

        plan = a.pop("plan")
        base = load_plan(plan)
        _uncalibrated(base["overrides"], f"predict: plan {clip_text(str(plan), 60)}: set")  # its set is the row's
        fields = {k: a.pop(k) for k in list(a) if k in Recipe.__dataclass_fields__}
        a = {**base, **a, "overrides": list(base.pop("overrides", [])) + list(a["overrides"]),
             "recipe": Recipe.of({**base["recipe"].to_dict(), **fields})}
    a.setdefault("cache_dir", None)  # a stale cost cache must never hide a model change from the ledger
    try:
        if mode == "inference":
            est, _ = estimate_inference(**a)
            return {"ttft": ("time", est.ttft_ms / 1e3), "tpot": ("time", est.tpot_ms / 1e3),
                    "throughput": ("rate", est.system_tokens_per_s), "request_throughput": ("rate", est.tokens_per_s)}
        if mode == "train":
            est, _ = estimate_train(**a)
            return {"step_time": ("time", est.step_ms / 1e3), "throughput": ("rate", est.seq_per_s),
                    "mfu": ("percent", est.mfu_percent)}
    except torch.OutOfMemoryError as e:
        raise PredictionError(f"does not fit: {str(e).split(' - ')[0]}") from None
    except (EstimateError, PlanError) as e:  # the published setup is one trnsim estimate refuses: listed with it
        raise PredictionError(str(e)) from None
    except TypeError as e:
        raise LedgerError(f"predict how: estimate: {e}") from None
    raise LedgerError(f"predict how: estimate: mode = {format_value(mode)}: expected inference or train")


#: predict.how -> function(args, chip, run overrides) -> {figure: (dimension, base-unit value)}
PREDICTORS: dict[str, Callable[[Mapping[str, Any], str, Sequence[str]], dict[str, Figure]]] = {
    "kernel": _kernel, "nki": _nki, "probe": _probe, "collective": _collective, "estimate": _estimate,
}


def predict(how: str, args: Mapping[str, Any], chip: str, run: Sequence[str] = ()) -> dict[str, Figure]:
    """The figures predictor ``how`` computes for ``args``. Bad arguments are a LedgerError; a
    setup trnsim refuses (a kernel rule, a config value, no room) is a PredictionError."""
    fn = PREDICTORS.get(how)
    if fn is None:
        raise LedgerError(f"predict how: {format_value(how)}: expected one of {', '.join(PREDICTORS)} or none")
    from ..collectives import CollectiveError

    try:
        return fn(args, chip, run)
    except LedgerError:
        raise
    except (KernelError, CollectiveError) as e:
        raise PredictionError(str(e)) from None
    except ConfigError as e:  # the row's own arguments (a config, a --set, an estimate option) are wrong
        raise LedgerError(str(e)) from None

