# setuptools reads everything from pyproject.toml; this file exists only because cffi's
# build hook (cffi_modules) is not expressible in pyproject.toml yet, and for the C modules
# written against Python's own C API, built as plain extensions: clone.c (it makes Python
# objects, which cffi cannot hand back) and scan.c (it reads them, which cffi cannot hand to C;
# not abi3: it reads __slots__ members through the member descriptor's layout).
from setuptools import Extension, setup

setup(cffi_modules=["trnsim/native/build.py:ffibuilder", "trnsim/native/build.py:sched_ffibuilder",
                     "trnsim/native/build.py:deptrack_ffibuilder"],
      ext_modules=[Extension("trnsim.native._clone", ["trnsim/native/clone.c"], depends=["trnsim/native/slots.h"],
                             extra_compile_args=["-O2"]),
                   Extension("trnsim.native._scan", ["trnsim/native/scan.c"], depends=["trnsim/native/slots.h"],
                             extra_compile_args=["-O2", "-std=gnu11"])])
