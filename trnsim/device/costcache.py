"""A kernel-cost cache on disk, so a repeated estimate does not simulate its kernels again.

A cost is what :meth:`trnsim.device.Device.cost` computes for a :class:`~trnsim.device.KernelSpec`
(or :meth:`~trnsim.device.Device.collective_cost` for a collective on a rank). It is stored under
a key that holds everything the number depends on:

* the code: a digest of every ``.py``, ``.c`` and ``.h`` file of the ``trnsim`` package and of its
  built C modules (a changed cost model, kernel or scheduler, in Python or in its C loops, is a
  different key, and so is a C source edited but not yet rebuilt; computed once per process);
* the chip config: every figure, after overrides (its name, description and file path are not
  part of it: two files with the same figures share costs);
* the spec (kernel, shape, dtype, params, label, fallback) and the logical core's LNC, or for a
  collective the system's figures, the call and the rank.

A kernel whose cost depends on more than that is never cached (:func:`cacheable`): a kernel family
registered at run time (an NKI kernel of the user's, whose code may change between runs under the
same name), a kernel registered from outside trnsim, or a parameter that prints as an object's
address.

Each entry is one small JSON file, ``<dir>/<key[:2]>/<key>.json``, written atomically
(:func:`trnsim.config.files.write_atomic`): concurrent estimates and sweeps share the directory safely,
a killed writer leaves no partial entry, and an unreadable entry is simulated again and
rewritten. The directory is ``$TRNSIM_CACHE_DIR`` (``off`` disables the cache), else
``$XDG_CACHE_HOME/trnsim/costs`` (``~/.cache/trnsim/costs``).

The `neuron` device of PyTorch programs uses the same cache when ``$TRNSIM_COST_CACHE`` asks for
it (:func:`device_cache_dir`): a script run again, or another script with the same kernels, takes
its kernels' costs from the disk instead of building and simulating them in its first step. A cost
read back carries every figure of the simulated one; its kernels' own reports (the engine lanes a
trace draws) are simulated again if something reads them (:class:`CachedDevice`'s
``lazy_reports``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..config import ChipConfig
from . import Device, KernelSpec, OpCost
from .ops import CollectiveLaunch
from ..config.files import OutputError, write_atomic
from ..isa import KernelError

__all__ = ["CostCache", "CachedDevice", "cacheable", "code_version", "default_cache_dir", "device_cache_dir"]

_CODE: list[str] = []


def code_version() -> str:
    """A digest of the trnsim package's Python sources (see the module docstring)."""
    if not _CODE:
        root = Path(__file__).resolve().parents[1]  # the trnsim package
        h = hashlib.sha256()
        for p in sorted(q for ext in ("*.py", "*.c", "*.h", "*.so", "*.pyd") for q in root.rglob(ext)):
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
        _CODE.append(h.hexdigest()[:20])
    return _CODE[0]


def _figures(obj: Any) -> Any:
    """A config as plain data without the fields that name it rather than set its figures."""
    d = dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj
    if isinstance(d, dict):
        return {k: _figures(v) for k, v in sorted(d.items()) if k not in ("name", "description", "source", "overrides")}
    if isinstance(d, (list, tuple)):
        return [_figures(v) for v in d]
    return d


def fingerprint(config: Any) -> str:
    """A digest of a chip or system config's figures."""
    return hashlib.sha256(json.dumps(_figures(config), sort_keys=True, default=str).encode()).hexdigest()[:20]


def _spec_data(spec: KernelSpec | None) -> Any:
    if spec is None:
        return None
    return [spec.kernel, list(spec.shape), spec.dtype, [[k, repr(v)] for k, v in spec.params], spec.label,
            spec.generic, _spec_data(spec.fallback)]


def default_cache_dir() -> Path | None:
    env = os.environ.get("TRNSIM_CACHE_DIR", "").strip()
    if env.lower() == "off":
        return None
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trnsim" / "costs"


_OFF, _ON = ("", "off", "0", "false", "no"), ("on", "1", "true", "yes")


def device_cache_dir() -> Path | None:
    """The cost cache of the `neuron` device (PyTorch programs), from ``$TRNSIM_COST_CACHE``:
    unset, empty, ``off``, ``0``, ``false`` or ``no``: none (each process simulates its kernels;
    the default); ``on``, ``1``, ``true`` or ``yes``: :func:`default_cache_dir` (the estimates'
    cache; None when that is off);
    anything else: that directory, made on the first write (a write that fails is counted, never
    raised). ValueError, in one line, when the path is a file."""
    env = os.environ.get("TRNSIM_COST_CACHE", "").strip()
    if env.lower() in _OFF:
        return None
    where = default_cache_dir() if env.lower() in _ON else Path(env)
    if where is not None and where.exists() and not where.is_dir():
        raise ValueError(f"TRNSIM_COST_CACHE={env}: {where} is not a directory; expected a directory for the neuron "
                         f"device's kernel costs, 'on' (the estimates' cache) or 'off'")
    return where


class CostCache:
    """The on-disk cache (see the module docstring). ``hits``/``misses`` count lookups."""

    def __init__(self, directory: str | os.PathLike[str] | None):
        self.dir = Path(directory) if directory is not None else None
        self.hits = 0
        self.misses = 0
        self.errors = 0  # entries that could not be written (a read-only or full disk): costs still right

    def key(self, *parts: Any) -> str:
        blob = json.dumps([code_version(), *parts], sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()

    def _path(self, key: str) -> Path:
        assert self.dir is not None
        return self.dir / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        if self.dir is None:
            return None
        try:
            with open(self._path(key), encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, dict):
                raise ValueError
        except (OSError, ValueError):
            self.misses += 1
            return None
        self.hits += 1
        return data

    def put(self, key: str, data: dict[str, Any]) -> None:
        if self.dir is None:
            return
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, lambda f: json.dump(data, f), "cost cache entry")
        except (OSError, OutputError):
            self.errors += 1


def _cost_data(cost: OpCost) -> dict[str, Any]:
    return {"kernel": cost.kernel, "generic": cost.generic, "ticks": cost.ticks, "busy": cost.busy,
            "cores": cost.cores, "hbm_bytes": cost.hbm_bytes, "matmul_flops": cost.matmul_flops,
            "demand": cost.demand, "engine_flops": cost.engine_flops, "hbm_read_bytes": cost.hbm_read_bytes,
            "hbm_write_bytes": cost.hbm_write_bytes, "dma_bytes": cost.dma_bytes,
            "collective": None if cost.collective is None else list(cost.collective)}


def _cost_of(data: dict[str, Any]) -> OpCost:
    """The cost an entry holds (KeyError for an entry without one of its figures, such as one
    written before the read/write split and a collective's row were kept: simulated again and
    rewritten)."""
    return OpCost(str(data["kernel"]), bool(data["generic"]), int(data["ticks"]),
                  {str(k): int(v) for k, v in data["busy"].items()}, int(data["cores"]), int(data["hbm_bytes"]),
                  int(data["matmul_flops"]), {str(k): int(v) for k, v in data["demand"].items()},
                  engine_flops=int(data["engine_flops"]), hbm_read_bytes=int(data["hbm_read_bytes"]),
                  hbm_write_bytes=int(data["hbm_write_bytes"]), dma_bytes=int(data["dma_bytes"]),
                  collective=None if data["collective"] is None else CollectiveLaunch(*data["collective"]))


class _LazyReports(Sequence[Any]):
    """A cost's kernel reports, simulated when first read (a cost read from the cache has none):
    the same reports the simulation that wrote the entry made, since a simulation is a
    function of the spec, the config and the code the entry's key names. Their number (one per
    physical core) is known without simulating. Pickled as the reports."""

    def __init__(self, device: Device, spec: KernelSpec, count: int):
        self._device, self._spec, self._count = device, spec, count  # (one report per physical core)
        self._reports: tuple[Any, ...] | None = None

    def _get(self) -> tuple[Any, ...]:
        if self._reports is None:
            with self._device._lock:  # (as Device.cost simulates)
                self._reports = Device._simulate(self._device, self._spec).reports
        return self._reports

    def __len__(self) -> int:  # (not simulated: a trace asks every launch whether it ran a kernel)
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __getitem__(self, i: Any) -> Any:
        return self._get()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._get())

    def __eq__(self, other: object) -> bool:
        return tuple(self) == tuple(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> Any:
        return (tuple, (self._get(),))

    def __repr__(self) -> str:
        return "<kernel reports, simulated when read>" if self._reports is None else repr(self._reports)


def cacheable(spec: KernelSpec) -> bool:
    """True when everything ``spec``'s cost depends on is in its key: a library kernel (or the
    generic stream kernel) whose parameters print as their contents. Not a kernel family
    registered at run time (a user's NKI kernel, whose code is not trnsim's and may change from
    one run to the next under the same name), nor a kernel registered from outside trnsim, nor
    a parameter printed as an object's address. Those are simulated every time, as without the
    cache."""
    from ..kernels.registry import FAMILIES, KERNELS

    while spec is not None:
        entry = KERNELS.get(spec.kernel)
        if spec.kernel in FAMILIES or any(" at 0x" in repr(v) for _, v in spec.params) or \
                (entry is not None and not getattr(entry.build, "__module__", "").startswith("trnsim.")):
            return False
        spec = spec.fallback
    return True


class CachedDevice(Device):
    """A :class:`~trnsim.device.Device` whose kernel and collective costs go through a
    :class:`CostCache`. Costs read back carry no per-kernel reports, unless ``lazy_reports``:
    then their ``reports`` are simulated when something reads them (a trace's engine lanes)."""

    def __init__(self, config: ChipConfig, cache: CostCache, lazy_reports: bool = False):
        super().__init__(config)
        self.cache = cache
        self.lazy_reports = lazy_reports
        self._config_key = fingerprint(config)

    def _simulate(self, spec: KernelSpec) -> OpCost:
        if not cacheable(spec):
            return super()._simulate(spec)
        key = self.cache.key("kernel", self._config_key, self.lnc, _spec_data(spec))
        data = self.cache.get(key)
        if data is not None:
            try:
                if "refused" in data:
                    raise KernelError(str(data["refused"]))
                cost = _cost_of(data)
                return dataclasses.replace(cost, reports=_LazyReports(self, spec, cost.cores)) if self.lazy_reports \
                    else cost
            except (KeyError, TypeError, ValueError, AttributeError):
                pass  # an entry from a damaged file: simulate again
        try:
            cost = super()._simulate(spec)
        except KernelError as e:
            self.cache.put(key, {"refused": str(e)})
            raise
        self.cache.put(key, _cost_data(cost))
        return cost

    def cached_collective(self, system: Any, call: tuple[Any, ...], rank: int, simulate: Any) -> OpCost:
        """The launch cost of collective ``call`` on ``rank`` (``simulate()`` gives its
        :class:`~trnsim.collectives.CollectiveReport` on a miss)."""
        key = self.cache.key("collective", fingerprint(system), list(call), rank)
        data = self.cache.get(key)
        if data is not None:
            try:
                return _cost_of(data)
            except (KeyError, TypeError, ValueError, AttributeError):
                pass
        cost = self.collective_cost(simulate(), rank)
        self.cache.put(key, _cost_data(cost))
        return cost
