"""torch.compile on the neuron device: the ``neuron`` backend (``backend="neuron"``, or the
default after ``torch.compiler.set_default_backend("neuron")``). See :mod:`.backend` (how it is
found), :mod:`.fusion` (which nodes fuse into which kernel) and :mod:`.graph` (how a compiled
graph runs and is charged)."""

from __future__ import annotations

from .backend import INDUCTOR_WARNING, divert_inductor, neuron_backend, register

__all__ = ["neuron_backend", "register", "divert_inductor", "INDUCTOR_WARNING"]
