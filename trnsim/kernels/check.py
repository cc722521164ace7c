"""Checking a library kernel's values against its numpy reference (``trnsim kernel --check``, tests)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ..sim.chip import Chip, check_host_memory
from ..config import ChipConfig, load_config
from ..isa import KernelError
from .registry import KernelEntry

__all__ = ["check_entry"]


def check_entry(entry: KernelEntry, shape: tuple[int, ...], dtype: str, config: ChipConfig | str = "trn2",
                params: Mapping[str, Any] | None = None, seed: int = 0, schedule: bool = False) -> dict[str, Any]:
    """Run ``entry`` with values and compare every output with its reference (list-scheduled
    first with ``schedule``, :mod:`trnsim.schedule`).

    Returns ``{"report": KernelReport, "errors": {output: max abs error / max |ref|}, "ok": bool}``.
    """
    cfg = load_config(config)
    merged = {**entry.params, **(params or {})}
    if entry.inputs is None or entry.reference is None:
        raise KernelError(f"kernel '{entry.name}' has no reference to check against")
    kernel = entry.make(shape, dtype, cfg, merged)
    if schedule:
        from ..sim.list_schedule import schedule as schedule_pass

        kernel = schedule_pass(kernel)
    # inputs (float32) and their rounded copies and the reference (float64): ~20 bytes an element
    elements = sum(math.prod(t.shape) for t in kernel.tensors.values())
    check_host_memory(kernel, extra=20 * elements)
    inputs = entry.inputs(shape, dtype, merged, np.random.default_rng(seed))
    result = Chip(cfg).run(kernel, inputs)
    ref = entry.reference(inputs, shape, dtype, merged)
    rtol, atol = entry.tolerance(dtype)
    errors: dict[str, float] = {}
    ok = True
    for name, want in ref.items():
        got = np.asarray(result[name], dtype=np.float64)
        want = np.asarray(want, dtype=np.float64)
        if got.shape != want.shape:
            raise KernelError(f"kernel '{entry.name}': output '{name}' has shape {got.shape}, reference {want.shape}")
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        diff = np.abs(got - want)
        err = float(np.max(diff)) / scale if scale and diff.size else float(np.max(diff, initial=0.0))
        errors[name] = err
        # atol is relative to the largest reference magnitude, as small as it is (a floor of 1
        # let an all-zero bf16 softmax of 4096 columns, every value under 0.005, pass)
        if not np.all(np.isfinite(got)) or np.any(diff > atol * (scale or 1.0) + rtol * np.abs(want)):
            ok = False
    return {"report": result.report, "errors": errors, "ok": ok}
