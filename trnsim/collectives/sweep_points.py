"""Collective points of a sweep (``collectives:`` beside ``kernels:`` in a spec).

A spec with collectives names a ``system`` (instead of a chip ``config``); its grid keys are
system overrides (``topology.x.bandwidth``, ``collectives.rdh_below``) or chip overrides
(``core.dma.engine_bandwidth``), as ``trnsim collective --set`` takes them. Each entry::

    collectives:
      - {name: all-reduce, bytes: 1MiB:1GiB, factor: 4, ranks: [16, 64], algo: ring, dtype: bf16}

runs every size x ranks (``bytes`` takes what ``--bytes`` takes, or a list; ``ranks`` one value or
a list, default the whole system; ``algo`` optional). Every point is checked on the base system
before the sweep starts, like kernel points.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..config import ConfigError, SystemConfig

__all__ = ["COLLECTIVE_KEYS", "COLLECTIVE_COLUMNS", "collective_points", "run_collective_point", "shape_of"]

COLLECTIVE_KEYS = ("name", "bytes", "factor", "ranks", "algo", "dtype")
#: CSV columns a spec with collectives adds after the kernel columns
COLLECTIVE_COLUMNS = ("algorithm", "algbw_gib_s", "busbw_gib_s", "estimate_us")


def shape_of(ranks: int, nbytes: int) -> str:
    """The ``shape`` cell of a collective point."""
    return f"{ranks} ranks, {nbytes} B"


def collective_points(entries: Any, where: str, system: SystemConfig
                      ) -> list[tuple[str, tuple[int, int], str, tuple[tuple[str, Any], ...]]]:
    """(collective, (ranks, bytes), dtype, params) per point, each checked on ``system``."""
    from .algorithms import CollectiveError, canonical_collective
    from .runner import CollectiveCall, parse_sizes, resolve_call

    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: collectives: expected a non-empty list of {{name, bytes, ranks, algo, dtype}}")
    out = []
    for i, e in enumerate(entries):
        loc = f"{where}: collectives[{i}]"
        if not isinstance(e, dict) or "name" not in e:
            raise ConfigError(f"{loc}: expected a mapping with a 'name'")
        bad = [k for k in e if k not in COLLECTIVE_KEYS]
        if bad:
            raise ConfigError(f"{loc}: unknown key '{bad[0]}'; expected {', '.join(COLLECTIVE_KEYS)}")
        loc = f"{loc} ({e['name']})"
        try:
            name = canonical_collective(str(e["name"]))
            factor = e.get("factor", 2)
            if isinstance(factor, bool) or not isinstance(factor, int):
                raise CollectiveError(f"factor: expected an integer >= 2, got {factor!r}")
            raw = e.get("bytes", "1MiB")
            sizes: list[int] = []
            for text in raw if isinstance(raw, list) else [raw]:
                sizes += parse_sizes(str(text), factor, "bytes")
            rk = e.get("ranks", system.ranks)
            ranks: Sequence[Any] = rk if isinstance(rk, list) else [rk]
            dtype = str(e.get("dtype", "bf16"))
            algo = e.get("algo")
            if algo is not None and not isinstance(algo, str):
                raise CollectiveError(f"algo: expected one algorithm's name, e.g. ring, got {algo!r}")
            params: tuple[tuple[str, Any], ...] = (("algo", str(algo)),) if algo is not None else ()
            for r in ranks:
                if isinstance(r, bool) or not isinstance(r, int):
                    raise CollectiveError(f"ranks: expected whole numbers, got {r!r}")
                for n in sizes:
                    res = resolve_call(system, CollectiveCall(name, n, r, None, dtype, algo))
                    out.append((name, (r, n), res.dtype, params))
        except (CollectiveError, ConfigError) as err:
            raise ConfigError(f"{loc}: {err}") from None
    return out


def run_collective_point(system: SystemConfig, name: str, shape: tuple[int, int], dtype: str,
                         params: dict[str, Any]) -> dict[str, Any]:
    """Simulate one point; its CSV cells (an ``error`` cell when this variant cannot run it)."""
    from .algorithms import CollectiveError
    from .api import simulate_collective

    ranks, nbytes = shape
    try:
        rep = simulate_collective(system, name, nbytes, ranks=ranks, dtype=dtype, algorithm=params.get("algo"))
    except CollectiveError as e:
        return {"error": str(e)}
    tensor_hz = system.chip.core.tensor.clock
    return {"error": "", "cycles": round(rep.time_s * tensor_hz, 1), "us": round(rep.time_us, 4), "bound": rep.bound,
            "algorithm": rep.algorithm, "algbw_gib_s": round(rep.algbw / 2**30, 4),
            "busbw_gib_s": round(rep.busbw / 2**30, 4), "estimate_us": round(rep.estimate.time_us, 4)}
