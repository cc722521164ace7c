"""The system the ranks run on and this process's place in it: the system chosen (``TRNSIM_SYSTEM``
or :func:`set_system`), what every rank must agree on, this rank's identity once its first group
exists, the group timeout, and the exits (so a rank left waiting can name the peer that is gone)."""

from __future__ import annotations

import atexit
import json
import os
import threading
from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist

from trnsim.config import ConfigError, SystemConfig, is_system_key, load_system

from ..runtime import runtime

DEFAULT_SYSTEM = "trn2.48xlarge"


class NeuronDistError(dist.DistError):
    """A distributed call that cannot go on as written: the message is one line and names the
    rank, the call and what was expected. Every rank of the group raises it together."""


# ---------------------------------------------------------------------------------------------
# the system and this process's place in it
# ---------------------------------------------------------------------------------------------


_state_lock = threading.RLock()
_requested_system: SystemConfig | None = None
_system: SystemConfig | None = None


def set_system(name_or_path: str | os.PathLike[str] | SystemConfig,
               overrides: Sequence[str] = ()) -> SystemConfig:
    """Choose the system the ranks run on (a name such as ``trn2-ultraserver``, a YAML path or a
    SystemConfig, with dotted ``topology.``/``collectives.`` overrides) before the first process
    group; ``TRNSIM_SYSTEM`` does the same from the environment."""
    global _requested_system
    with _state_lock:
        if _system is not None:
            raise RuntimeError(f"neuron backend: the system is already {_system.name}; call set_system before "
                               f"init_process_group")
        sysc = load_system(name_or_path, list(overrides))  # a bad name fails here
        _requested_system = sysc
        return sysc


def system() -> SystemConfig:
    """The system the ranks run on, built on the neuron device's chip config (its overrides
    included). Its chip must be the device's: a trn2 system cannot hold trn3 NeuronCores."""
    global _system
    with _state_lock:
        if _system is not None:
            return _system
        cfg = runtime().config
        base: SystemConfig | str = _requested_system or os.environ.get("TRNSIM_SYSTEM", "").strip() or DEFAULT_SYSTEM
        chip_overrides = [f"{k}={v}" for k, v in cfg.overrides if not is_system_key(k)]
        try:
            sysc = load_system(base, chip_overrides)
        except ConfigError as e:
            raise NeuronDistError(f"neuron backend: {e}") from None
        if sysc.chip.name != cfg.name:
            raise NeuronDistError(
                f"neuron backend: the system {sysc.name} is built of {sysc.chip.name} chips, but this rank's neuron "
                f"device runs {cfg.name}: choose a {cfg.name} system (TRNSIM_SYSTEM) or the {sysc.chip.name} chip "
                f"(TRNSIM_CONFIG)")
        _system = sysc
        return sysc


def config_fingerprint() -> str:
    """What every rank must agree on: the chip config and the system, overrides included."""
    cfg, sysc = runtime().config, system()
    return json.dumps([cfg.name, list(map(list, cfg.overrides)), sysc.name, list(map(list, sysc.overrides))])


# ---------------------------------------------------------------------------------------------
# exits (so a waiting rank can say which peer is gone) and registration
# ---------------------------------------------------------------------------------------------

_stores: list[Any] = []


def _exit_key(rank: int) -> str:
    return f"trnsim/exited/{rank}"


def mark_exit(how: str = "exited") -> None:
    """Tell the other ranks this one is gone (``how``: "finished its script", "exited"), so a
    rank left waiting for it at a collective can name it."""
    rank = _info.get("rank")
    if rank is None:
        return
    for store in _stores:
        try:
            if not store.check([_exit_key(rank)]):
                store.set(_exit_key(rank), how)
        except Exception:  # noqa: BLE001 - the store may be gone at exit
            pass


def exited_peers(store: Any, peers: Sequence[int]) -> dict[int, str]:
    gone: dict[int, str] = {}
    for r in peers:
        try:
            if store.check([_exit_key(r)]):
                gone[r] = store.get(_exit_key(r)).decode()
        except Exception:  # noqa: BLE001
            break
    return gone


_info: dict[str, Any] = {}


def rank_info() -> dict[str, Any]:
    """This process's rank, world size and system (empty before init_process_group)."""
    return dict(_info)


def parse_seconds(text: Any, what: str) -> float:
    """A timeout in seconds (a number > 0, as torchrun takes them); ValueError naming ``what``."""
    try:
        secs = float(text)
        if not 0 < secs < 1e9:
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{what} {text}: expected a number of seconds > 0") from None
    return secs


def group_timeout(given: timedelta) -> timedelta:
    """The group's timeout: ``TRNSIM_DIST_TIMEOUT`` (seconds; ``trnsim run --timeout``) if set."""
    text = os.environ.get("TRNSIM_DIST_TIMEOUT", "").strip()
    if not text:
        return given
    try:
        return timedelta(seconds=parse_seconds(text, "TRNSIM_DIST_TIMEOUT="))
    except ValueError as e:
        raise NeuronDistError(f"neuron backend: {e}") from None


def joined() -> bool:
    """Whether this process has made its first group (its rank is known)."""
    return bool(_info)


def world_size() -> int | None:
    """The world's size once this process has joined it."""
    return _info.get("world")


def join(info: dict[str, Any], store: Any) -> None:
    """This process's first group: its rank, world and system; exits are told through ``store``."""
    _info.update(info)
    _stores.append(dist.PrefixStore("trnsim", store))
    atexit.register(mark_exit)


def group_store(given: Any) -> Any:
    """The store a group tells and reads exits through: the world's, else the group's own."""
    return _stores[0] if _stores else given
