# setuptools reads everything from pyproject.toml; this file exists only because cffi's
# build hook (cffi_modules) is not expressible in pyproject.toml yet, and for the one C module
# written against Python's own C API (clone.c: it makes Python objects, which cffi cannot hand
# back), built as a plain extension.
from setuptools import Extension, setup

setup(cffi_modules=["trnsim/native/build.py:ffibuilder", "trnsim/native/build.py:sched_ffibuilder",
                     "trnsim/native/build.py:deptrack_ffibuilder"],
      ext_modules=[Extension("trnsim.native._clone", ["trnsim/native/clone.c"], extra_compile_args=["-O2"])])
