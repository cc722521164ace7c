"""cffi (out-of-line, API mode) builder for ``trnsim.native._sched``, the scheduler's event loop
(sched.c). ``pip install -e .`` runs it through setup.py's ``cffi_modules`` beside the datapath's
builder (build.py); after editing sched.c, run ``python setup.py build_ext --inplace``.

No ``-ffast-math`` and ``-ffp-contract=off``: TensorE's power ramp computes a utilisation in
doubles, which must round exactly as the Python model's arithmetic does.
"""

from __future__ import annotations

import os

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))


def _cdef() -> str:
    """The declarations, read from sched.h (so they cannot drift): all but preprocessor lines,
    with the ``#define`` constants given to cffi as ``...`` (their values come from the header)."""
    out = []
    with open(os.path.join(_HERE, "sched.h"), encoding="utf-8") as f:
        for line in f.read().splitlines():
            s = line.strip()
            if s.startswith("#define SCHED_") or s.startswith("#define SEG_"):
                out.append(f"#define {s.split()[1]} ...")
            elif not s.startswith("#"):
                out.append(line)
    return "\n".join(out)


def make_ffibuilder(relative_paths: bool = True) -> FFI:
    """The builder; relative paths for setuptools, absolute ones for ``FFI.compile(tmpdir=...)``."""
    path = (lambda p: os.path.relpath(p, _ROOT)) if relative_paths else os.path.abspath
    builder = FFI()
    builder.cdef(_cdef())
    builder.set_source(
        "trnsim.native._sched",
        '#include "sched.h"',
        sources=[path(os.path.join(_HERE, "sched.c"))],
        include_dirs=[path(_HERE)],
        depends=[path(os.path.join(_HERE, "sched.h"))],
        extra_compile_args=["-O2", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"],
        libraries=["m"],
    )
    return builder


ffibuilder = make_ffibuilder()
