"""cffi (out-of-line, API mode) builder for ``trnsim.native._datapath``.

``pip install -e .`` runs it through setup.py's ``cffi_modules`` and leaves
``trnsim/native/_datapath.abi3.so`` in place; after editing datapath.c, run it again (or
``python setup.py build_ext --inplace``, which builds the same file).

Flags: ``-O3`` for speed, ``-ffp-contract=off`` so the compiler never fuses a multiply and an
add on its own (the definition's fused MACs are explicit FMA intrinsics and ``fmaf`` calls; the
unfused test kernel must stay unfused), and no ``-ffast-math``/``-march=native``: the module
must give the same bits on every x86-64 (it picks AVX-512 / AVX2 kernels at run time) and on
other CPUs.
"""

from __future__ import annotations

import os

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))


def _rel(path: str) -> str:
    # Paths relative to the project root: setuptools runs the build from there and wants
    # relative source paths.
    return os.path.relpath(path, _ROOT)


def _cdef() -> str:
    """The declarations cffi needs, read from datapath.h itself (so they cannot drift):
    everything but the preprocessor lines (include guard, #include)."""
    with open(os.path.join(_HERE, "datapath.h"), encoding="utf-8") as f:
        return "\n".join(line for line in f.read().splitlines() if not line.lstrip().startswith("#"))


CDEF = _cdef()

# gcc or clang (datapath.c uses their builtins and target attributes).
_COMPILE_ARGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11", "-pthread"]


def make_ffibuilder(relative_paths: bool = True) -> FFI:
    """The builder; relative paths for setuptools, absolute ones for ``FFI.compile(tmpdir=...)``."""
    path = _rel if relative_paths else os.path.abspath
    builder = FFI()
    builder.cdef(CDEF)
    builder.set_source(
        "trnsim.native._datapath",
        '#include "datapath.h"',
        sources=[path(os.path.join(_HERE, "datapath.c"))],
        include_dirs=[path(_HERE)],
        depends=[path(os.path.join(_HERE, "datapath.h"))],
        extra_compile_args=_COMPILE_ARGS,
        extra_link_args=["-pthread"],
    )
    return builder


ffibuilder = make_ffibuilder()
