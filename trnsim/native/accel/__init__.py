"""The simulator's C accelerators: code that makes trnsim fast and decides no value or tick on
its own. Each has a Python definition that stays the reference, and tests that compare the two:

* ``_sched`` (sched.c, cffi): the event loop of :func:`trnsim.sim.simulate` (reference: the simpy
  processes, ``timeline="simpy"``; tests/sim/test_sim_equivalence.py);
* ``_scan`` (scan.c, a CPython extension): the simulator's one pass over a kernel's instruction
  objects (reference: map() passes; tests/sim/test_sim_scan.py);
* ``_deptrack`` (deptrack.c, cffi): the builder's dependency tracker (reference:
  :class:`trnsim.builder.deps.DependencyTracker`; tests/builder/test_build_equivalence.py);
* ``_clone`` (clone.c, a CPython extension): a replayed block's instruction copies and
  dependency tuples (reference: the builder's Python copies; tests/native/test_native_clone.py).

The numerics - the TensorE datapath (datapath.c) and the dtype emulation - are
:mod:`trnsim.native`'s own modules, one folder up: they define values. All are built by
``trnsim/native/build.py`` and setup.py (``python3 setup.py build_ext --inplace``); without a
module here the simulator runs its Python reference (same results, slower).
"""
