"""cffi (out-of-line, API mode) builder for ``trnsim.native._deptrack``, the kernel builder's
dependency tracker in C (deptrack.c; :class:`trnsim.kernel.DependencyTracker` is the same
algorithm in Python and stays the reference).

``pip install -e .`` runs it through setup.py's ``cffi_modules`` beside the datapath's builder
and leaves ``trnsim/native/_deptrack.abi3.so`` in place; after editing deptrack.c run
``python setup.py build_ext --inplace``. A separate module so the datapath's build (and its
floating-point flags) stays untouched. Integer code only: plain ``-O2``.
"""

from __future__ import annotations

import os

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))


def _rel(path: str) -> str:
    return os.path.relpath(path, _ROOT)  # setuptools runs from the project root


def _cdef() -> str:
    """deptrack.h without its preprocessor lines (so the declarations cannot drift)."""
    with open(os.path.join(_HERE, "deptrack.h"), encoding="utf-8") as f:
        return "\n".join(line for line in f.read().splitlines() if not line.lstrip().startswith("#"))


def make_ffibuilder(relative_paths: bool = True) -> FFI:
    path = _rel if relative_paths else os.path.abspath
    builder = FFI()
    builder.cdef(_cdef())
    builder.set_source(
        "trnsim.native._deptrack",
        '#include "deptrack.h"',
        sources=[path(os.path.join(_HERE, "deptrack.c"))],
        include_dirs=[path(_HERE)],
        depends=[path(os.path.join(_HERE, "deptrack.h"))],
        extra_compile_args=["-O2", "-std=gnu11"],
    )
    return builder


ffibuilder = make_ffibuilder()
