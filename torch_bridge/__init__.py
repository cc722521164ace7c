"""torch_bridge: the ``neuron`` PyTorch device, backed by trnsim's virtual Trainium.

``import torch`` is enough: the package's ``torch.backends`` entry point calls :func:`register`
(set ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` to turn that off and call it yourself). Then::

    model = model.to("neuron")          # plain torch.Tensors with real storage on neuron:0
    loss = model(x.to("neuron")).sum()  # values from the datapath / CPU kernels, time simulated
    print(torch.neuron.report())        # where the simulated device time went

The chip comes from ``TRNSIM_CONFIG`` (a config name or YAML path; default trn2) or
``torch.neuron.set_config(...)`` before first use.
"""

from __future__ import annotations

from typing import Any

import torch  # noqa: F401  (first: with autoload on, it loads .backend itself)

from trnsim.sim.report import OpRow, RunReport

from .backend import register, register_or_report

__all__ = ["register", "RunReport", "OpRow"]

register_or_report()


def __getattr__(name: str) -> Any:
    """An old module name (``torch_bridge.values``) is the moved module (trnsim.compat's table)."""
    from trnsim.compat import ALIASES

    if f"torch_bridge.{name}" in ALIASES:
        import importlib

        return importlib.import_module(f"torch_bridge.{name}")
    raise AttributeError(f"module 'torch_bridge' has no attribute '{name}'")
