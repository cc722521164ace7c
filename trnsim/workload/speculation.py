"""Fused speculative decoding as NxD Inference runs it (torch-free: the options, the acceptance and
what a step yields; the steps' kernels are :mod:`torch_bridge.timing.estimate_kernels`').

NxDI's fused speculation (``enable_fused_speculation``, ``speculation_length`` k; NxDI
``models/model_base.py``, ``NeuronFusedSpecModel``) compiles the draft and the target model into
one graph:

* **context encoding**: the target's prefill, then the draft's prefill of the same prompt (the
  draft without sequence parallelism), in one NEFF;
* **token generation**: k single-token decode steps of the draft (greedy; the k-th only fills the
  draft's KV cache), then one target step over k tokens (the last accepted token and k - 1 draft
  tokens), sampling each of its k positions, in one NEFF. The drafts the target agrees with are
  kept, up to the first disagreement, and the target's token there is the step's last one: a step
  yields 1..k tokens.

What a step yields depends on how often the target agrees with the draft - the acceptance, a
property of the draft, the target and the prompts that no simulation of the chip gives. The
estimate takes it as a per-position rate ``a`` (each draft token accepted with probability ``a``,
independently, as Leviathan et al. 2023 model it), so a step yields ``(1 - a^k) / (1 - a)`` tokens
on average. It is an input: a number, or a named entry of ``configs/speculation/acceptance.yaml``
whose provenance (a ``calibration`` row of the ledger) the file states.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import CONFIG_DIR, ConfigError, clip_text, format_value

__all__ = ["SpeculationError", "Speculation", "ACCEPTANCE_FILE", "acceptance_calibrations", "acceptance_names",
           "load_acceptance", "tokens_per_step"]

ACCEPTANCE_FILE = CONFIG_DIR / "speculation" / "acceptance.yaml"


class SpeculationError(ConfigError):
    """A speculation option that is missing or malformed (one line)."""


def tokens_per_step(acceptance: float, k: int) -> float:
    """Tokens a fused step of speculation length ``k`` yields on average when each of its k - 1
    draft tokens is accepted with probability ``acceptance`` until the first rejection:
    ``sum_{i<k} a^i`` (1 at a = 0, k at a = 1)."""
    return float(sum(acceptance ** i for i in range(k)))


def _read(path: Path) -> dict[str, Any]:
    import yaml

    from ..config.schema import check_calibrations, take_calibrations

    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SpeculationError(f"{path.name}: cannot read ({clip_text(str(e).splitlines()[0], 80)})") from None
    if not isinstance(raw, dict):
        raise SpeculationError(f"{path.name}: expected a mapping of named acceptances")
    out: dict[str, Any] = {}
    for name, entry in raw.items():
        if not isinstance(entry, dict) or "acceptance" not in entry:
            raise SpeculationError(f"{path.name}: {clip_text(str(name), 40)}: expected a mapping with 'acceptance'")
        cals: list[Any] = []
        entry = dict(entry)
        take_calibrations(entry, str(name), path.name, cals)
        check_calibrations(cals, path.name)
        out[str(name)] = (entry, cals)
    return out


def acceptance_calibrations() -> list[Any]:
    """The :class:`trnsim.config.schema.Calibration` of every named acceptance (its ledger rows)."""
    if not ACCEPTANCE_FILE.exists():
        return []
    return [c for _, cals in _read(ACCEPTANCE_FILE).values() for c in cals]


def acceptance_names() -> list[str]:
    return sorted(_read(ACCEPTANCE_FILE)) if ACCEPTANCE_FILE.exists() else []


def load_acceptance(value: Any) -> tuple[float, str]:
    """(acceptance rate, where it comes from) of ``value``: a number in [0, 1], or the name of an
    entry of ``configs/speculation/acceptance.yaml`` (its ``fit`` and calibration rows quoted)."""
    if isinstance(value, bool):
        value = None
    if isinstance(value, (int, float)) and value is not None:
        a = float(value)
        if not 0.0 <= a <= 1.0:
            raise SpeculationError(f"--acceptance {format_value(value)}: expected a rate in [0, 1] (each draft token "
                                   f"accepted with this probability) or a name from {ACCEPTANCE_FILE.name}")
        return a, f"--acceptance {a:g} as given"
    if isinstance(value, str):
        try:
            return load_acceptance(float(value))
        except ValueError:
            pass
        entries = _read(ACCEPTANCE_FILE) if ACCEPTANCE_FILE.exists() else {}
        if value not in entries:
            raise SpeculationError(f"--acceptance {clip_text(value, 60)}: expected a rate in [0, 1] or one of "
                                   f"{', '.join(sorted(entries)) or 'no names'} ({ACCEPTANCE_FILE.name})")
        entry, cals = entries[value]
        a = entry["acceptance"]
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= float(a) <= 1.0:
            raise SpeculationError(f"{ACCEPTANCE_FILE.name}: {value}: acceptance = {format_value(a)}: expected a rate "
                                   f"in [0, 1]")
        rows = ", ".join(r for c in cals for r in c.rows)
        how = f"calibrated on {rows}" if rows else "as the file states"
        return float(a), f"{value} ({ACCEPTANCE_FILE.name}: {how})"
    raise SpeculationError(f"--acceptance {format_value(value)}: expected a rate in [0, 1] or a name from "
                           f"{ACCEPTANCE_FILE.name}")


@dataclass(frozen=True)
class Speculation:
    """Fused speculation of an estimate: the draft model, the speculation length ``k`` and the
    per-position acceptance (with where it comes from)."""

    draft: str
    k: int
    acceptance: float
    source: str

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_step(self.acceptance, self.k)

    @classmethod
    def of(cls, draft: str | None, k: int | None, acceptance: Any) -> "Speculation | None":
        """The options checked: all three or none (one line naming the missing one)."""
        if draft is None:
            for name, v in (("--speculation-length", k), ("--acceptance", acceptance)):
                if v is not None:
                    raise SpeculationError(f"{name}: speculation needs a draft model (--draft-model)")
            return None
        if k is None:
            raise SpeculationError("--draft-model: give --speculation-length (NxDI's speculation_length: draft steps "
                                   "and target tokens per fused step)")
        if isinstance(k, bool) or not isinstance(k, int) or k < 2:
            raise SpeculationError(f"--speculation-length {format_value(k)}: expected a whole number >= 2 (the draft "
                                   f"steps and target tokens of a fused step)")
        if acceptance is None:
            raise SpeculationError("--draft-model: give --acceptance (the rate at which the target accepts a draft "
                                   "token: a property of the models and prompts, not of the chip; a number in [0, 1] "
                                   f"or a name from configs/speculation/{ACCEPTANCE_FILE.name})")
        a, source = load_acceptance(acceptance)
        return cls(str(draft), k, a, source)
