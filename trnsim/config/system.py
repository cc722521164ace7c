"""Systems: chips and the links between them (``configs/systems/*.yaml``)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import CONFIG_DIR, ChipConfig, load_config, resolve_config_path
from .loader import ConfigError, clip_text, file_kind, load_yaml_file
from .schema import TYPES, Calibration, build, calibrations_of, override_pairs, override_value
from .schema import bool_field as _bool
from .schema import float_field as _num
from .schema import int_field as _int
from .schema import quantity_field as _q
from .schema import str_field as _str

# ---------------------------------------------------------------------------------------------
# Systems: chips and the links between them (configs/systems/*.yaml)
# ---------------------------------------------------------------------------------------------
#
# A system names a chip config and a topology: an ordered list of dimensions, the first fastest
# in a chip's id (ASTRA-sim's multi-dimensional topology, notes/collectives.md §4.1). Overrides
# share one namespace with the chip's: ``topology.*``, ``collectives.*``, ``name``,
# ``description`` and ``chip`` are the system's; every other key (``core.dma.engine_bandwidth``,
# ``chip.lnc``) goes to its chip config, so ``--set`` means the same as for ``trnsim info``.

SYSTEM_DIR = CONFIG_DIR / "systems"
_SYSTEM_KEYS = ("name", "description", "chip", "topology", "collectives")
_DIM_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class TopologyDimConfig:
    """One dimension of a system's topology.

    ``ring``: each chip links to its two neighbours along the dimension, one link per direction
    (a torus is rings in every dimension); ``full``: a direct link from each chip to every other
    chip along the dimension; ``switch``: each chip has one port (up and down) into a switch that
    reaches every chip that shares its coordinates above this dimension."""

    kind: str = _str(("ring", "switch", "full"), doc="ring, switch or full")
    size: int = _int(1, 4096, doc="chips along the dimension")
    bandwidth: int = _q("bandwidth", doc="per link (ring, full) or per chip port (switch), each direction, bytes/s")
    latency: int = _q("time", lo=0, doc="per link hop (a switch is two hops: up and down), ps")
    inter_instance: bool = _bool(doc="the dimension joins instances (hierarchical algorithms split there)")
    proxy: bool = _bool(doc="traffic across it goes through the runtime's network proxy thread (EFA)")
    name: str = field(default="", metadata={"internal": True})


@dataclass(frozen=True)
class CollectivesConfig:
    """How collectives run on the system: CC cores, DMA packets, reductions and the size rule."""

    cc_cores_per_core: int = _int(1, 64, doc="CC cores per physical NeuronCore; concurrent collectives per core")
    packet_bytes: int = _q("bytes", doc="CC DMA packet size, bytes")
    max_chunks: int = _int(1, 1 << 20, doc="most chunks a transfer is cut into (simulation granularity)")
    window: int = _int(1, 1024, doc="chunks of one transfer in flight at once")
    reduce_engine: str = _str(("dma", "vector"), doc="who adds: DMA accumulate or VectorE")
    dma_accumulate_rate: float = _num(0.01, 1.0, doc="DMA accumulate throughput as a fraction of a copy's")
    mesh_below: int = _q("bytes", lo=0, doc="Mesh below this size, bytes")
    mesh_collectives: str = _str(("all", "all-reduce"), doc="what the runtime runs as a mesh below mesh_below: "
                                 "all (Trn2's mesh family, two-step on multi-rank chips) or all-reduce (Trn1's "
                                 "all-to-all all-reduce only; all-gather and reduce-scatter run rings)")
    rdh_below: int = _q("bytes", lo=0, doc="RDH below this size (and at least mesh_below), bytes")
    rule_ranks: int = _int(1, 1 << 20, doc="the group size mesh_below and rdh_below are stated for; other groups "
                                           "compare their bytes per rank")
    pipeline_segments: int = _int(1, 4096, doc="segments of a pipelined broadcast/reduce chain")
    dma_duplication: bool = _bool(doc="a DMA write can go to two destinations from one read (KangaRing needs it)")
    # the Neuron runtime's costs (trnsim.collectives.runtime): zero them, and dma_rings to a
    # core's engines, for the network alone
    launch: int = _q("time", lo=0, doc="per call of a collective run by itself (nccom-test's ops, torch.distributed "
                                      "calls): runtime -> CC core, before a rank's first transfer, ps")
    graph_launch: int = _q("time", lo=0, doc="per call of a collective inside a compiled graph (trnsim estimate's "
                                            "steps): the engines' trigger write reaching the CC core, ps")
    step_sync: int = _q("time", lo=0, doc="per transfer: the semaphore handshake with its peers before data moves, ps")
    reduce_sync: int = _q("time", lo=0, doc="per transfer that adds what it reads (the reduce steps of a reduce-scatter "
                                            "or all-reduce): the runtime's step before the reduction, on top of "
                                            "step_sync, ps")
    issue: int = _q("time", lo=0, doc="CC core time to issue one transfer; a rank's CC core issues one at a time, ps")
    dma_rings: int = _int(1, 1024, doc="DMA rings (one engine each) per physical core a collective's transfers share")
    p2p_rings: int = _int(1, 1024, doc="DMA rings per physical core of a point-to-point transfer (send/recv, permute)")
    efa_proxy: int = _q("time", lo=0, doc="network proxy thread time per transfer that leaves the instance over EFA, ps")
    ranks_per_proxy: int = _int(1, 1 << 16, doc="ranks that share one network proxy thread")
    flat_ring_channels: int = _int(1, 64, doc="channels of a communicator spanning instances (one per EFA "
                                                          "device): a flat ring's cycles side by side, each leaving an "
                                                          "instance from a different chip, and the cycles of a "
                                                          "hierarchical call's intra-instance rings")
    multistream_mesh: bool = _bool(doc="with collectives on several CC streams at once the runtime still runs Mesh, "
                                       "RDH and KangaRing (false: rings only)")
    sdk: str = _str(doc="the Neuron SDK release whose runtime the costs above describe; the system file's runtimes: "
                        "lists what other releases' runtimes do differently (collectives.sdk=<release> selects one)")


@dataclass(frozen=True)
class _SystemHead:
    name: str = _str()
    description: str = _str()
    chip: str = _str(doc="a chip config name or a path relative to the system file")


@dataclass(frozen=True)
class SystemConfig:
    """A whole system: ``chip`` is the loaded chip config, ``topology`` its dimensions in order."""

    name: str
    description: str
    chip: ChipConfig
    topology: tuple[TopologyDimConfig, ...]
    collectives: CollectivesConfig
    source: str = ""
    overrides: tuple[tuple[str, str], ...] = ()
    calibrations: tuple[Calibration, ...] = ()  # the system's own (its chip's are chip.calibrations)

    @property
    def chips(self) -> int:
        return math.prod(d.size for d in self.topology)

    @property
    def ranks_per_chip(self) -> int:
        """Logical NeuronCores per chip: the ranks a chip holds, as on Neuron."""
        return self.chip.logical_cores

    @property
    def ranks(self) -> int:
        return self.chips * self.ranks_per_chip

    @property
    def instance_chips(self) -> int:
        return math.prod(d.size for d in self.topology if not d.inter_instance)

    @property
    def tick_hz(self) -> int:
        return self.chip.tick_hz

    def dim(self, name: str) -> TopologyDimConfig:
        for d in self.topology:
            if d.name == name:
                return d
        raise KeyError(name)

    def describe_overrides(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.overrides)


for _cls in (TopologyDimConfig, CollectivesConfig, _SystemHead):
    TYPES[_cls.__name__] = _cls


def system_names() -> list[str]:
    """Names of the built-in systems (``configs/systems/*.yaml``)."""
    return sorted(p.stem for p in SYSTEM_DIR.glob("*.yaml"))


def resolve_system_path(text: str) -> Path:
    p = Path(text)
    shown = clip_text(text)
    if p.suffix in (".yaml", ".yml") or os.sep in text or "/" in text:
        try:
            found = p.is_file()
        except OSError as e:  # e.g. a name too long for the file system
            raise ConfigError(f"{shown}: cannot read it ({e.strerror or type(e).__name__})") from None
        if not found:
            try:
                st = os.stat(p)
            except OSError:
                raise ConfigError(f"{shown}: no such system file") from None
            raise ConfigError(f"{shown}: it is {file_kind(st.st_mode)}, not a regular file")  # it exists
        return p
    if text in system_names():  # a name, not a probe of the file system (a 3,000-character name is not a file)
        return SYSTEM_DIR / f"{text}.yaml"
    raise ConfigError(f"unknown system '{shown}': expected one of {', '.join(system_names())} or a path to a .yaml "
                      f"file")


def is_system_key(key: str) -> bool:
    """Whether a dotted override belongs to the system (else to its chip config)."""
    head = key.split(".", 1)[0]
    return key == "chip" or head in ("topology", "collectives", "name", "description")


def _fields_of(cls: Any) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _apply_system_override(raw: dict[str, Any], key: str, value: str, where: str) -> None:
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"{where}: bad override key '{key}': expected dotted keys like topology.x.bandwidth")
    head = parts[0]
    if head in ("name", "description", "chip"):
        if len(parts) != 1:  # pragma: no cover - chip.* goes to the chip config
            raise ConfigError(f"{where}: override '{key}': '{head}' is a value, not a section")
        raw[head] = value
        return
    if head == "collectives":
        fields = _fields_of(CollectivesConfig)
        if len(parts) != 2 or parts[1] not in fields:
            bad = parts[1] if len(parts) > 1 else "<nothing>"
            raise ConfigError(f"{where}: unknown key '{key}': '{bad}' is not in collectives; expected one of "
                              f"{', '.join(fields)}")
        sec = raw.get("collectives")
        raw["collectives"] = sec = dict(sec) if isinstance(sec, dict) else {}
        sec[parts[1]] = override_value(value, fields[parts[1]])
        return
    topo = raw.get("topology")
    dims = list(topo) if isinstance(topo, dict) else []
    if len(parts) < 2 or parts[1] not in dims:
        bad = parts[1] if len(parts) > 1 else "<nothing>"
        raise ConfigError(f"{where}: unknown key '{key}': '{bad}' is not a dimension of topology; expected one of "
                          f"{', '.join(dims)}")
    fields = _fields_of(TopologyDimConfig)
    if len(parts) != 3 or parts[2] not in fields:
        bad = parts[2] if len(parts) > 2 else "<nothing>"
        raise ConfigError(f"{where}: unknown key '{key}': '{bad}' is not in topology.{parts[1]}; expected one of "
                          f"{', '.join(fields)}")
    assert isinstance(topo, dict)
    raw["topology"] = topo = dict(topo)
    dim = topo[parts[1]]
    topo[parts[1]] = dim = dict(dim) if isinstance(dim, dict) else {}
    dim[parts[2]] = override_value(value, fields[parts[2]])


def _apply_runtime(raw: dict[str, Any], base: Any, where: str, sys_pairs: Mapping[str, str]) -> set[str]:
    """Another SDK release's runtime: where ``collectives.sdk`` names a release of the file's
    ``runtimes:`` (each maps a release, a quoted string like '2.28', to the collectives keys its
    runtime has other values of), those values in place of the file's (a ``--set`` of the same
    key still wins). Returns the collectives keys replaced (their own provenance no longer holds)."""
    runtimes = raw.get("runtimes", {})
    if not isinstance(runtimes, dict) or not all(isinstance(k, str) and isinstance(v, dict) and v
                                                 for k, v in runtimes.items()):
        raise ConfigError(f"{where}: runtimes must map an SDK release (a quoted string like '2.28') to the "
                          f"collectives keys its runtime has other values of")
    fields = _fields_of(CollectivesConfig)
    for rel, keys in runtimes.items():
        for k in keys:
            if k not in fields or k == "sdk":
                raise ConfigError(f"{where}: unknown key 'runtimes.{clip_text(rel, 20)}.{clip_text(str(k), 40)}': "
                                  f"expected collectives keys ({', '.join(f for f in fields if f != 'sdk')})")
    coll = raw.get("collectives")
    if not isinstance(coll, dict) or coll.get("sdk") == base:
        return set()
    sdk = coll.get("sdk")
    if sdk not in runtimes:
        given = f" (--set collectives.sdk={clip_text(str(sys_pairs['collectives.sdk']))})" \
            if "collectives.sdk" in sys_pairs else ""
        known = ", ".join(repr(r) for r in [base, *runtimes])
        raise ConfigError(f"{where}{given}: collectives.sdk = {clip_text(repr(sdk))}: expected a release this file "
                          f"describes: {known}")
    raw["collectives"] = coll = dict(coll)
    out = set()
    for k, v in runtimes[sdk].items():
        if f"collectives.{k}" not in sys_pairs:
            coll[k] = v
            out.add(f"collectives.{k}")
    return out


def _read_system_yaml(path: Path, where: str) -> Any:
    """A system file through the bounded YAML loader (aliases, depth, duplicate keys, size)."""
    return load_yaml_file(path, where, "system config")


def load_system(
    name_or_path: str | os.PathLike[str] | SystemConfig = "trn2.48xlarge",
    overrides: Iterable[str] | Mapping[str, Any] | None = None,
) -> SystemConfig:
    """Load a system by name (``trn2.48xlarge``) or path, applying dotted ``overrides``.

    Keys under ``topology.``/``collectives.`` (and ``name``, ``description``, ``chip``) change the
    system; any other key is passed to its chip config (``core.dma.engine_bandwidth=40GB/s``).
    Errors are one-line :class:`ConfigError`\\ s naming the file, the key, the value and what was
    expected."""
    if isinstance(overrides, str):
        overrides = [overrides]
    prior: tuple[tuple[str, str], ...] = ()
    if isinstance(name_or_path, SystemConfig):
        prior = name_or_path.overrides
        if not overrides:
            return name_or_path
        name_or_path = name_or_path.source
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ConfigError(f"a system is a name ({', '.join(system_names())}), a path to a .yaml file or a "
                          f"SystemConfig, got {type(name_or_path).__name__}")
    path = resolve_system_path(os.fspath(name_or_path))
    where = path.name if path.parent == SYSTEM_DIR else str(path)
    raw = _read_system_yaml(path, where)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with keys {', '.join(_SYSTEM_KEYS)}")
    cals = calibrations_of(raw, where)
    pairs = override_pairs(prior, overrides)
    chip_pairs = [(k, v) for k, v in pairs if not is_system_key(k)]
    sys_pairs = {k: v for k, v in pairs if is_system_key(k)}
    base_sdk = raw["collectives"].get("sdk") if isinstance(raw.get("collectives"), dict) else None
    for key, value in sys_pairs.items():
        _apply_system_override(raw, key, value, f"{where} (--set {key}={value})")
    for key in raw:
        if key not in _SYSTEM_KEYS and key != "runtimes":
            raise ConfigError(f"{where}: unknown key '{key}': expected one of {', '.join(_SYSTEM_KEYS)}, runtimes")
    released = _apply_runtime(raw, base_sdk, where, sys_pairs)
    for key in _SYSTEM_KEYS:
        if key not in raw:
            raise ConfigError(f"{where}: missing key '{key}'")
    head = build(_SystemHead, {k: raw[k] for k in ("name", "description", "chip")}, "", where, sys_pairs)
    topo_raw = raw["topology"]
    if not isinstance(topo_raw, dict) or not topo_raw:
        raise ConfigError(f"{where}: topology must be a mapping of dimension name -> {{kind, size, bandwidth, "
                          f"latency, inter_instance}}, first dimension fastest")
    dims = []
    for dname, draw in topo_raw.items():
        if not isinstance(dname, str) or not _DIM_NAME.match(dname):
            raise ConfigError(f"{where}: topology.{dname}: expected a dimension name like x or efa "
                              f"(lower case letters, digits, _)")
        d = build(TopologyDimConfig, draw, f"topology.{dname}", where, sys_pairs)
        dims.append(dataclasses.replace(d, name=dname))
    coll = build(CollectivesConfig, raw["collectives"], "collectives", where, sys_pairs)
    seen_inter = None
    for d in dims:
        if d.inter_instance:
            seen_inter = d.name
        elif seen_inter is not None:
            raise ConfigError(f"{where}: topology.{d.name}.inter_instance = False: expected the dimensions inside an "
                              f"instance to come before the ones between instances ('{seen_inter}')")
    if coll.rdh_below < coll.mesh_below:
        raise ConfigError(f"{where}: collectives.rdh_below = {coll.rdh_below} bytes: expected at least "
                          f"collectives.mesh_below ({coll.mesh_below} bytes)")
    chips = math.prod(d.size for d in dims)
    if chips > 65536:
        raise ConfigError(f"{where}: topology has {chips:,} chips: expected at most 65,536")
    chip_ref = head.chip
    if chip_ref.endswith((".yaml", ".yml")) or "/" in chip_ref:
        chip_ref = str(path.parent / chip_ref)
    try:
        resolve_config_path(chip_ref)
    except ConfigError as e:  # named where it was given: the system's file or its --set
        given = f" (--set chip={sys_pairs['chip']})" if "chip" in sys_pairs else ""
        raise ConfigError(f"{where}{given}: chip: {e}") from None
    chip = load_config(chip_ref, dict(chip_pairs))
    return SystemConfig(name=head.name, description=head.description, chip=chip, topology=tuple(dims),
                        collectives=coll, source=str(path), overrides=tuple(pairs),
                        calibrations=tuple(c for c in cals if c.key not in sys_pairs and c.key not in released))
