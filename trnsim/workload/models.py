"""Model configs for estimates: Hugging Face ``config.json`` files, by name or path (torch-free).

``configs/models/`` ships a few (``llama-3.1-8b``, ``llama-3.3-70b``, ``llama-3.1-405b``,
``mixtral-8x7b``, ...); any ``config.json`` path works. A config is read as bounded JSON (a
regular file of at most 4 MiB, UTF-8, no key twice) and checked for the fields an estimate needs,
so a typo is one line naming the file and the field, before torch is imported.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import CONFIG_DIR, ConfigError, clip_text, read_bounded

__all__ = ["MODEL_DIR", "ModelConfig", "model_names", "load_model"]

MODEL_DIR = CONFIG_DIR / "models"

# fields every decoder an estimate runs must have (the Hugging Face names), with their types
_REQUIRED = {"model_type": str, "hidden_size": int, "num_hidden_layers": int, "num_attention_heads": int,
             "vocab_size": int}


@dataclass(frozen=True)
class ModelConfig:
    """A model's Hugging Face config: ``name`` (the file's stem), ``path``, ``fields`` (the
    parsed JSON object)."""

    name: str
    path: Path
    fields: dict[str, Any]

    @property
    def model_type(self) -> str:
        return str(self.fields["model_type"])

    @property
    def layers(self) -> int:
        return int(self.fields["num_hidden_layers"])

    @property
    def heads(self) -> int:
        return int(self.fields["num_attention_heads"])

    @property
    def kv_heads(self) -> int:
        return int(self.fields.get("num_key_value_heads") or self.heads)

    @property
    def hidden(self) -> int:
        return int(self.fields["hidden_size"])

    @property
    def head_dim(self) -> int:
        return int(self.fields.get("head_dim") or self.hidden // self.heads)

    @property
    def source(self) -> str:
        return str(self.fields.get("_source", self.path))

    def with_layers(self, layers: int) -> "ModelConfig":
        """The same model with ``layers`` decoder layers (a shorter model: ``--layers``; a per-layer
        ``layer_types`` list keeps its first ``layers``)."""
        fields = {**self.fields, "num_hidden_layers": layers}
        if isinstance(fields.get("layer_types"), list):
            fields["layer_types"] = fields["layer_types"][:layers]
        return ModelConfig(self.name, self.path, fields)


def model_names() -> list[str]:
    """The shipped model configs, by name."""
    return sorted(p.stem for p in MODEL_DIR.glob("*.json"))


def load_model(name_or_path: str | os.PathLike[str]) -> ModelConfig:
    """A shipped model by name (``llama-3.3-70b``) or a ``config.json`` path; every problem is a
    one-line :class:`ConfigError`."""
    text = os.fspath(name_or_path)
    shown = clip_text(text)
    if "/" not in text and not text.endswith(".json"):
        if text not in model_names():  # a name, not a probe of the file system
            raise ConfigError(f"unknown model '{shown}': expected one of {', '.join(model_names())}, or a path to a "
                              f"Hugging Face config.json")
        path = MODEL_DIR / f"{text}.json"
    else:
        path = Path(text)
        try:
            if path.is_dir():
                path = path / "config.json"
        except OSError as e:  # e.g. a name too long for the file system
            raise ConfigError(f"model config '{shown}': cannot read it ({e.strerror or type(e).__name__})") from None
    where = clip_text(path.name if path.parent == MODEL_DIR else str(path))
    raw = _read_json(path, where)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object (a Hugging Face config.json)")
    for key, tp in _REQUIRED.items():
        if key not in raw:
            raise ConfigError(f"{where}: missing '{key}'; a Hugging Face config.json of a decoder has "
                              f"{', '.join(_REQUIRED)}")
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, tp) or (tp is int and value < 1):
            want = "a positive integer" if tp is int else "a string"
            raise ConfigError(f"{where}: {key}: expected {want}, got {clip_text(repr(value))}")
    for key in ("num_key_value_heads", "intermediate_size", "head_dim"):
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{where}: {key}: expected a positive integer, got {clip_text(repr(value))}")
    heads, kv = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    if heads % kv:
        raise ConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if not raw.get("head_dim") and raw["hidden_size"] % heads:
        raise ConfigError(f"{where}: hidden_size {raw['hidden_size']} is not a multiple of num_attention_heads {heads}")
    name = path.stem if path.name != "config.json" else path.parent.name or "config"
    return ModelConfig(name, path, dict(raw))


def _read_json(path: Path, where: str) -> Any:
    """The JSON object in ``path``, read the way configs are (see the module docstring)."""
    text = read_bounded(path, where, "model config")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise ConfigError(f"{where}: key '{clip_text(k)}' appears twice; a key may appear once")
            out[k] = v
        return out

    try:
        return json.loads(text, object_pairs_hook=pairs)
    except (json.JSONDecodeError, RecursionError) as e:
        detail = f"line {e.lineno} column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else "nested too deeply"
        raise ConfigError(f"{where}: not valid JSON ({detail})") from None
