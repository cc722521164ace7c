"""Kernels a sweep names: a library kernel by name or a builder function by ``path:function``
(:class:`KernelRef`, :func:`resolve_kernel`)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..config import ChipConfig, ConfigError, clip_text
from ..isa import KernelError
from ..builder.kernel import Kernel
from ..kernels.registry import KernelEntry, call_build, get_kernel
from ..native.dtypes import get_dtype

# ---------------------------------------------------------------------------------------------
# kernels by name or by path:function
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelRef:
    """A kernel the CLI can build: a registry entry, or a user's ``file.py:function`` (which
    follows the registry's calling convention but has no defaults, inputs or reference)."""

    name: str
    build: Callable[..., Kernel]
    entry: KernelEntry | None = None

    @property
    def default_shape(self) -> tuple[int, ...] | None:
        return self.entry.default_shape if self.entry else None

    @property
    def params(self) -> Mapping[str, Any] | None:
        """Parameter defaults (None: unknown, the user's function checks its own)."""
        return self.entry.params if self.entry else None

    def dtype(self, dtype: str | None) -> str | None:
        """``dtype`` normalised to its short name, or the kernel's default."""
        if dtype is None:
            return self.entry.default_dtype if self.entry else None
        try:
            return get_dtype(dtype).short
        except ValueError as e:
            raise KernelError(f"kernel '{self.name}': {e}") from None

    def make(self, shape: tuple[int, ...], dtype: str | None, config: ChipConfig,
             params: Mapping[str, Any]) -> Kernel:
        """Build the kernel. A user's function that raises is a one-line KernelError naming it
        and its exception (a library kernel's bug keeps its traceback)."""
        if self.entry is not None:
            return self.entry.make(shape, dtype or self.entry.default_dtype, config, params)
        what = f"kernel '{clip_text(self.name, 300)}'"
        try:
            return call_build(self.build, shape, dtype, config, params, what=what)
        except (KernelError, ConfigError):
            raise
        except RecursionError:
            raise KernelError(f"{what}: {getattr(self.build, '__name__', 'it')} recursed too deeply") from None
        except Exception as e:
            raise KernelError(f"{what}: {getattr(self.build, '__name__', 'it')} raised "
                              f"{type(e).__name__}: {clip_text(e, 200)}") from None


_USER_MODULES: dict[Path, Any] = {}


def _load_file(path: Path) -> Any:
    """Import a kernel file under a private module name (once per process), so a user's
    ``kernels.py`` never shadows or replaces an installed module of the same name."""
    shown = clip_text(path)
    try:
        path = path.resolve()
        if path in _USER_MODULES:
            return _USER_MODULES[path]
        found = path.is_file()
    except OSError as e:  # e.g. a name too long for the file system
        raise KernelError(f"kernel file '{shown}': cannot read it ({e.strerror or type(e).__name__})") from None
    if not found:
        raise KernelError(f"kernel file '{shown}' not found")
    mod_name = "_trnsim_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise KernelError(f"kernel file '{shown}' cannot be imported; expected a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look modules up here
    # its own folder first while it loads, as `python file.py` (and `trnsim run`) would have it:
    # a kernel file that imports a module beside it loads from any working directory
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise KernelError(f"kernel file '{shown}' failed to import: {type(e).__name__}: {clip_text(e, 200)}") from None
    finally:
        if sys.path and sys.path[0] == str(path.parent):
            del sys.path[0]
    _USER_MODULES[path] = module
    return module


def resolve_kernel(name: str, base_dir: Path | None = None) -> KernelRef:
    """``matmul`` (registered) or ``path/to/file.py:function`` (relative to ``base_dir``, default
    the working directory)."""
    file, sep, fn = name.rpartition(":")
    if not sep or not file.endswith(".py"):
        return KernelRef(name, get_kernel(name).build, get_kernel(name))
    path = Path(file) if base_dir is None else base_dir / file
    module = _load_file(path)
    build = getattr(module, fn, None)
    if not callable(build):
        raise KernelError(f"kernel file '{clip_text(file)}' has no function '{clip_text(fn)}'")
    return KernelRef(name, build)


def shape_text(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))
