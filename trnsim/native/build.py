"""cffi (out-of-line, API mode) builders for trnsim's three cffi C modules, one ``FFI`` each:

* ``trnsim.native._datapath`` (datapath.c), the TensorE datapath (numerics): ``ffibuilder``;
* ``trnsim.native.accel._sched`` (accel/sched.c), the scheduler's event loop: ``sched_ffibuilder``;
* ``trnsim.native.accel._deptrack`` (accel/deptrack.c), the kernel builder's dependency tracker
  (:class:`trnsim.builder.deps.DependencyTracker` is the same algorithm in Python and stays the
  reference): ``deptrack_ffibuilder``.

``pip install -e .`` runs them through setup.py's ``cffi_modules`` and leaves the
``_*.abi3.so`` files beside their sources; after editing a C file, run it again (or
``python setup.py build_ext --inplace``, which builds the same files). Separate modules, so each
keeps its own compiler flags:

* the datapath: ``-O3`` for speed, ``-ffp-contract=off`` so the compiler never fuses a multiply
  and an add on its own (the definition's fused MACs are explicit FMA intrinsics and ``fmaf``
  calls; the unfused test kernel must stay unfused), and no ``-ffast-math``/``-march=native``:
  the module must give the same bits on every x86-64 (it picks AVX-512 / AVX2 kernels at run
  time) and on other CPUs;
* the scheduler: no ``-ffast-math`` and ``-ffp-contract=off`` too: TensorE's power ramp computes
  a utilisation in doubles, which must round exactly as the Python model's arithmetic does;
* the dependency tracker: integer code only, plain ``-O2``.

``trnsim.native.accel._scan`` (accel/scan.c: the simulator's one pass over a kernel's instruction objects)
is a plain CPython extension named in setup.py's ``ext_modules`` (as clone.c is), not a cffi
one: it reads Python objects, which cffi does not hand to C. Without it, ``simulate()`` reads
the instructions with map() passes (the same results, slower). ``trnsim.native.accel._clone``
(accel/clone.c: a replayed block's instruction copies and a batched record's dependency tuples) is
one for the same reason: it makes Python objects. Without it the builder makes them in Python.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
_ACCEL = os.path.join(_HERE, "accel")  # the simulator's accelerators (trnsim.native.accel)
_ROOT = os.path.dirname(os.path.dirname(_HERE))


def _rel(path: str) -> str:
    # Paths relative to the project root: setuptools runs the build from there and wants
    # relative source paths.
    return os.path.relpath(path, _ROOT)


def _header_cdef(header: str, constants: tuple[str, ...] = (), where: str = _HERE) -> str:
    """The declarations cffi needs, read from the header itself (so they cannot drift):
    everything but the preprocessor lines (include guard, #include); ``#define`` constants whose
    names start with one of ``constants`` are given to cffi as ``...`` (their values come from
    the header when the module compiles)."""
    out = []
    with open(os.path.join(where, header), encoding="utf-8") as f:
        for line in f.read().splitlines():
            s = line.strip()
            if constants and s.startswith("#define ") and s.split()[1].startswith(constants):
                out.append(f"#define {s.split()[1]} ...")
            elif not s.startswith("#"):
                out.append(line)
    return "\n".join(out)


CDEF = _header_cdef("datapath.h")


def _builder(module: str, stem: str, cdef: str, relative_paths: bool, where: str = _HERE, **options: Any) -> FFI:
    """The builder of ``trnsim.native.<module>`` (``trnsim.native.accel.<module>`` from accel/)
    from ``<stem>.c``/``<stem>.h`` in ``where``; relative paths for setuptools, absolute ones for
    ``FFI.compile(tmpdir=...)``."""
    path: Callable[[str], str] = _rel if relative_paths else os.path.abspath
    package = "trnsim.native" if where == _HERE else "trnsim.native.accel"
    builder = FFI()
    builder.cdef(cdef)
    builder.set_source(
        f"{package}.{module}",
        f'#include "{stem}.h"',
        sources=[path(os.path.join(where, f"{stem}.c"))],
        include_dirs=[path(where)],
        depends=[path(os.path.join(where, f"{stem}.h"))],
        **options,
    )
    return builder


def make_ffibuilder(relative_paths: bool = True) -> FFI:
    # gcc or clang (datapath.c uses their builtins and target attributes).
    return _builder("_datapath", "datapath", CDEF, relative_paths,
                    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11", "-pthread"],
                    extra_link_args=["-pthread"])


def make_sched_ffibuilder(relative_paths: bool = True) -> FFI:
    return _builder("_sched", "sched", _header_cdef("sched.h", ("SCHED_", "SEG_"), _ACCEL), relative_paths, _ACCEL,
                    extra_compile_args=["-O2", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"],
                    libraries=["m"])


def make_deptrack_ffibuilder(relative_paths: bool = True) -> FFI:
    return _builder("_deptrack", "deptrack", _header_cdef("deptrack.h", where=_ACCEL), relative_paths, _ACCEL,
                    extra_compile_args=["-O2", "-std=gnu11"])


ffibuilder = make_ffibuilder()
sched_ffibuilder = make_sched_ffibuilder()
deptrack_ffibuilder = make_deptrack_ffibuilder()
