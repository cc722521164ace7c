"""Recomputation in a timing-only run: a function under non-reentrant checkpointing whose
recompute (on the autograd engine's thread) runs with the run's function mode and the forward's
sequence-parallel state (:mod:`torch_bridge.timing.train_step`, :func:`torch_bridge.timing.models.core_attention`)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

__all__ = ["checkpointed"]


def _function_mode() -> Any:
    """The timing-only run's function mode (fused attention) on this thread: the autograd engine's
    thread, where a recompute runs, does not inherit it."""
    from torch.overrides import _get_current_function_mode_stack

    from .fake import FunctionMode, active

    run = active()
    if run is None or any(isinstance(m, FunctionMode) for m in _get_current_function_mode_stack()):
        return contextlib.nullcontext()
    return FunctionMode(run)


def checkpointed(fn: Any, comm: Any = None) -> Any:
    """``fn`` under non-reentrant checkpointing; its recompute in the backward runs with the
    sequence-parallel state ``comm`` had in the forward (the blocks gather their input again)."""
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        sp = getattr(comm, "sp_active", False)

        def again(*a: Any, **k: Any) -> Any:
            with _function_mode():
                if comm is None:
                    return fn(*a, **k)
                was, comm.sp_active = comm.sp_active, sp
                try:
                    return fn(*a, **k)
                finally:
                    comm.sp_active = was
        return checkpoint(again, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
    return run
