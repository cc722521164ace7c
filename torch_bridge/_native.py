"""The device's native extension (``csrc/neuron.cpp``): built on first use, cached, loaded with ctypes.

PyTorch lets only C++ provide some parts of a PrivateUse1 device: pinned host memory, storage
resize, generators (the ``PrivateUse1HooksInterface``) and a device guard that remembers the
current device (without one, autograd makes a single neuron queue and ``backward()`` on
``neuron:1`` asserts). ``csrc/neuron.cpp`` implements them against torch's C++ headers.

Why it is compiled here rather than by ``pip install``: the headers come with the installed torch,
and the package build runs isolated from it (putting torch in ``build-system.requires`` would
pull PyPI's multi-GB CUDA wheel into every build environment, and torch may not even be
installed yet when pip builds this package). So the first registration of the device compiles
one C++ file against the torch that is actually imported (about 15 s, once), and caches the
library under ``$TRNSIM_CACHE_DIR`` (default ``~/.cache/trnsim``) keyed by the source, the
torch version and the compiler; later imports load it in milliseconds. No compiler: a one-line
:class:`NativeBuildError` naming what to install.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["NativeBuildError", "library_path", "load", "lib"]

SOURCE = Path(__file__).with_name("csrc") / "neuron.cpp"

lib: ctypes.CDLL | None = None


class NativeBuildError(RuntimeError):
    """The native extension could not be built, loaded or registered (the message is one line)."""


def _compiler() -> str:
    cxx = os.environ.get("CXX", "").strip() or "c++"
    found = shutil.which(cxx.split()[0])
    if found is None:
        raise NativeBuildError(
            f"trnsim: the neuron device needs a C++ compiler once, to build its native extension against "
            f"torch {torch.__version__}, and '{cxx}' was not found: install one (apt-get install g++) or set CXX")
    return cxx


def _flags() -> list[str]:
    """What torch.utils.cpp_extension would pass, without importing it (it pulls in setuptools,
    and this runs inside every ``import torch``)."""
    root = Path(torch.__file__).parent
    abi = int(torch.compiled_with_cxx11_abi())
    includes = [f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    libdir = root / "lib"
    links = [f"-L{libdir}", f"-Wl,-rpath,{libdir}", "-lc10", "-ltorch_cpu"]
    return ["-std=c++20", "-O2", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w", *includes, *links]


def _cache_dir() -> Path:
    base = os.environ.get("TRNSIM_CACHE_DIR", "").strip()
    if base and base.lower() != "off":  # ("off" turns the estimates' cost cache off; the build stays where it is)
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "trnsim"


def library_path() -> Path:
    """Where the library for this source, torch and compiler lives (built or not)."""
    cxx = _compiler()
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(f"{torch.__version__}|{sys.version_info[:2]}|{sysconfig.get_platform()}|{cxx}".encode())
    key.update(" ".join(_flags()).encode())
    return _cache_dir() / f"neuron_ext-{key.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    cxx = _compiler()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    except OSError as e:  # TRNSIM_CACHE_DIR names a file, or a directory that cannot be written
        why = "it is not a directory" if isinstance(e, (FileExistsError, NotADirectoryError)) else \
            e.strerror or type(e).__name__
        raise NativeBuildError(f"trnsim: cannot build the neuron device's native extension in {target.parent} "
                               f"({why}); set TRNSIM_CACHE_DIR to a writable directory") from None
    os.close(fd)
    print(f"trnsim: building the neuron device's native extension for torch {torch.__version__} "
          f"(once; ~15 s) -> {target}", file=sys.stderr, flush=True)
    cmd = [*cxx.split(), str(SOURCE), "-o", tmp, *_flags()]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            first = next((ln for ln in res.stderr.splitlines() if "error" in ln), res.stderr.strip()[:300])
            raise NativeBuildError(f"trnsim: building the neuron device's native extension failed ({cxx}): {first}")
        os.replace(tmp, target)  # atomic: a concurrent build of the same key loses nothing
    except OSError as e:  # the compiler could not start, or the disk filled up
        raise NativeBuildError(f"trnsim: building the neuron device's native extension in {target.parent} failed "
                               f"({e.strerror or type(e).__name__})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_ops: dict[str, Any] = {}  # name -> the C++ callable of torch.ops.trnsim.<name>, or None without it
_UNSEEN = object()


def op(name: str) -> Any:
    """The C++ callable of the extension's ``torch.ops.trnsim.<name>`` (csrc/neuron.cpp: calling it
    skips OpOverload.__call__'s frame), or None before the extension is loaded (looked up again
    then) or where it lacks the op."""
    got = _ops.get(name, _UNSEEN)
    if got is not _UNSEEN:
        return got
    if lib is None:
        return None
    from . import _torch

    try:
        got = _torch.cpp_op(getattr(torch.ops.trnsim, name).default)
    except (AttributeError, RuntimeError):
        got = None
    _ops[name] = got
    return got


def load() -> ctypes.CDLL:
    """The loaded extension (built first if this torch has none cached)."""
    global lib
    if lib is not None:
        return lib
    if not SOURCE.is_file():
        raise NativeBuildError(f"trnsim: the neuron device's native source {SOURCE} is missing from the install")
    path = library_path()
    if not path.is_file():
        _build(path)
    try:
        handle = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise NativeBuildError(f"trnsim: cannot load the neuron device's native extension {path}: {e}") from None
    handle.trnsim_register_hooks.restype = ctypes.c_int
    handle.trnsim_set_device_count.argtypes = [ctypes.c_int]
    handle.trnsim_device_count.restype = ctypes.c_int
    handle.trnsim_current_device.restype = ctypes.c_int
    handle.trnsim_set_device.argtypes = [ctypes.c_int]
    handle.trnsim_set_device.restype = ctypes.c_int
    handle.trnsim_set_allocator.argtypes = [ALLOC_FN, RELEASE_FN]
    handle.trnsim_is_pinned.argtypes = [ctypes.c_void_p]
    handle.trnsim_is_pinned.restype = ctypes.c_int
    handle.trnsim_pinned_bytes.restype = ctypes.c_int64
    handle.trnsim_pinned_allocations.restype = ctypes.c_int64
    i64, p64 = ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
    handle.trnsim_fast_register.argtypes = [ctypes.c_char_p, i64]
    handle.trnsim_fast_screen.argtypes = [ctypes.c_char_p, i64]
    handle.trnsim_fast_register.restype = ctypes.c_int
    for name in ("trnsim_fast_enable", "trnsim_fast_gate", "trnsim_fast_history", "trnsim_fast_tracing"):
        getattr(handle, name).argtypes = [ctypes.c_int]
    handle.trnsim_fast_capture.argtypes = [i64]
    handle.trnsim_fast_hits.restype = i64
    handle.trnsim_fast_kind.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    handle.trnsim_fast_kind.restype = ctypes.c_int
    handle.trnsim_log_count_ptr.restype = ctypes.c_void_p
    handle.trnsim_log_take.argtypes = [ctypes.c_void_p, i64]
    handle.trnsim_log_take.restype = i64
    handle.trnsim_log_take_captured.argtypes = [ctypes.c_void_p, i64, ctypes.c_void_p, ctypes.c_void_p]
    handle.trnsim_log_take_captured.restype = i64
    handle.trnsim_fast_name.argtypes = [i64]
    handle.trnsim_fast_ticks.argtypes = [i64, i64]
    handle.trnsim_log_place.argtypes = [ctypes.c_void_p] * 4
    handle.trnsim_log_place.restype = i64
    handle.trnsim_log_close.argtypes = [i64, ctypes.c_int]
    handle.trnsim_log_close.restype = ctypes.c_int
    handle.trnsim_log_learning.argtypes = [i64, ctypes.c_int]
    handle.trnsim_fast_name.restype = ctypes.c_char_p
    handle.trnsim_fast_learning.argtypes = [ctypes.c_char_p]
    handle.trnsim_fast_learning.restype = ctypes.c_int
    handle.trnsim_fast_learn.argtypes = [i64]
    handle.trnsim_fast_learn_many.argtypes = [ctypes.c_void_p, i64]
    handle.trnsim_mem_set_pool.argtypes = [ctypes.c_void_p, ctypes.c_int]
    handle.trnsim_mem_reserve.argtypes = [ctypes.c_void_p, i64]
    handle.trnsim_mem_reserve.restype = ctypes.c_int
    handle.trnsim_mem_sub.argtypes = [ctypes.c_void_p, i64, ctypes.c_int]
    handle.trnsim_fast_blocks.argtypes = [ctypes.c_void_p, i64]
    handle.trnsim_fast_blocks.restype = i64
    handle.trnsim_fast_freed.argtypes = [ctypes.c_void_p, i64]
    handle.trnsim_fast_freed.restype = i64
    handle.trnsim_fast_datapath.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                            i64]
    handle.trnsim_fast_datapath_ns.restype = i64
    handle.trnsim_fast_conv_datapath.argtypes = [ctypes.c_void_p]
    handle.trnsim_fast_all_finite.argtypes = [ctypes.c_void_p, i64]
    handle.trnsim_fast_launch.argtypes = [i64, i64]
    handle.trnsim_fast_launch.restype = ctypes.c_int
    handle.trnsim_fast_launch_many.argtypes = [i64, ctypes.c_void_p, i64]
    handle.trnsim_fast_launch_many.restype = ctypes.c_int
    handle.trnsim_fast_all_finite.restype = ctypes.c_int
    handle.trnsim_fast_max_abs.argtypes = [ctypes.c_void_p, i64, ctypes.c_int]
    handle.trnsim_fast_max_abs.restype = ctypes.c_double
    handle.trnsim_host_scope.argtypes = [ctypes.c_int]
    handle.trnsim_host_release.restype = i64
    handle.trnsim_host_stats.argtypes = [ctypes.c_void_p]
    del p64
    lib = handle
    return lib


# the storage allocator the C++ resize asks (see csrc/neuron.cpp, "storage resize")
ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p),
                            ctypes.c_void_p, ctypes.c_int)
RELEASE_FN = ctypes.CFUNCTYPE(None, ctypes.c_int64)
