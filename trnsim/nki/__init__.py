"""trnsim.nki: run NKI kernels on the virtual Trainium, with their cycle report.

An NKI kernel file runs with its imports changed and nothing else::

    import trnsim.nki as nki                  # was: import neuronxcc.nki as nki  (or: import nki)
    import trnsim.nki.language as nl          # was: neuronxcc.nki.language
    import trnsim.nki.isa as nisa             # was: neuronxcc.nki.isa

    @nki.jit
    def add(a, b):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.load(a) + nl.load(b))
        return out

    c = add(a, b)                             # numpy in, numpy out, as nki.simulate_kernel
    r = nki.run(add, a, b)                    # the outputs and the KernelReport: r.report.total_us

The kernel is traced to an instruction stream (:mod:`trnsim.nki._core`), scheduled and laid out
as the Neuron compiler would (:mod:`trnsim.schedule`) and simulated (:class:`trnsim.Chip`).
``nki.simulate_kernel``, ``nki.simulate``, ``nki.baremetal`` and ``nki.benchmark`` exist for
code that uses them; :func:`family` makes a kernel a family of the device model, costed by input
shapes, as a framework op needs it (``torch_bridge.nki`` registers kernels as torch ops so).
What trnsim does not support fails with one line naming the construct.

:mod:`trnsim.nki.library` gives the NKI library's transformer kernels (``nkilib.core``: QKV,
attention for decode and prefill, MLP, output projection, RoPE, router, MoE experts) as kernels
of this module, with the instruction streams of :mod:`trnsim.kernels.transformer`.
"""

from ..compat import renamed
from . import isa, language, typing
from ._core import NkiError, NkiTensor
from ._jit import (Benchmarked, JitKernel, NkiRun, TensorSpec, Traced, as_kernel, baremetal, benchmark, jit, run,
                   simulate, simulate_kernel, tensor_spec, trace)
from .family import NkiFamily, family

__all__ = [
    "jit", "run", "trace", "simulate", "simulate_kernel", "baremetal", "benchmark", "tensor_spec",
    "JitKernel", "NkiRun", "Traced", "TensorSpec", "Benchmarked", "NkiError", "NkiTensor",
    "language", "isa", "typing", "family", "NkiFamily", "as_kernel",
]


def __getattr__(name: str) -> object:  # names renamed so one name means one thing (trnsim.compat.RENAMED)
    return renamed(__name__, name)
