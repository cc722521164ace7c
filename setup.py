# setuptools reads everything from pyproject.toml; this file exists only because cffi's
# build hook (cffi_modules) is not expressible in pyproject.toml yet, and for the C modules
# written against Python's own C API, built as plain extensions: clone.c (it makes Python
# objects, which cffi cannot hand back) and scan.c (it reads them, which cffi cannot hand to C;
# not abi3: it reads __slots__ members through the member descriptor's layout).
# And for the data the package opens that lives at the top of the repository (configs/: chips,
# systems, models, sweeps; validation/: the ledger): a wheel carries a copy in trnsim/shipped/,
# which trnsim.config reads when it is there (an installed package has no repository around it).
import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

SHIPPED = ("configs", "validation")


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the repository's own folders
        for name in SHIPPED:
            dst = os.path.join(self.build_lib, "trnsim", "shipped", name)
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(name, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithData},
      cffi_modules=["trnsim/native/build.py:ffibuilder", "trnsim/native/build.py:sched_ffibuilder",
                    "trnsim/native/build.py:deptrack_ffibuilder"],
      ext_modules=[Extension("trnsim.native.accel._clone", ["trnsim/native/accel/clone.c"],
                             depends=["trnsim/native/accel/slots.h"], extra_compile_args=["-O2"]),
                   Extension("trnsim.native.accel._scan", ["trnsim/native/accel/scan.c"],
                             depends=["trnsim/native/accel/slots.h"],
                             extra_compile_args=["-O2", "-std=gnu11"])])
