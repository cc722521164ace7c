# setuptools reads everything from pyproject.toml; this file exists only because cffi's
# build hook (cffi_modules) is not expressible in pyproject.toml yet, and for the one plain
# CPython extension (trnsim/native/scan.c reads Python objects, which cffi cannot hand to C).
from setuptools import Extension, setup

setup(cffi_modules=["trnsim/native/build.py:ffibuilder", "trnsim/native/build.py:sched_ffibuilder",
                     "trnsim/native/build.py:deptrack_ffibuilder"],
      # not abi3: scan.c reads __slots__ members through the member descriptor's layout
      ext_modules=[Extension("trnsim.native._scan", ["trnsim/native/scan.c"], extra_compile_args=["-O2", "-std=gnu11"])])
