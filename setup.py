# setuptools reads everything from pyproject.toml; this file exists only because cffi's
# build hook (cffi_modules) is not expressible in pyproject.toml yet.
from setuptools import setup

setup(cffi_modules=["trnsim/native/build.py:ffibuilder", "trnsim/native/build.py:sched_ffibuilder",
                     "trnsim/native/build.py:deptrack_ffibuilder"])
