"""Estimate points of a sweep (``estimates:`` beside ``kernels:`` and ``collectives:``).

A spec with estimates names a ``system``; its grid keys are system or chip overrides, so "TPOT
of Llama-70B as HBM bandwidth and link bandwidth vary" is one spec::

    system: trn2.48xlarge
    grid:
      chip.hbm.bandwidth: [2.9TB/s, 4TB/s]
      topology.x.bandwidth: [128GB/s, 256GB/s]
    estimates:
      - {mode: inference, model: llama-3.3-70b, tp: 64, sp: true, batch: 1, input: 10000, output: 1500}
      - {mode: train, model: llama-3.1-8b, tp: 8, dp: 8, micro_batch: 1, seq: 4096, global_batch: 64}

Each entry is checked on the base system before the sweep starts (the model config, the plan
against the system's ranks). Points share the on-disk kernel-cost cache
(:mod:`trnsim.costcache`): kernels repeat across layers, steps and the variants that leave the
chip alone, and are simulated once.
"""

from __future__ import annotations

from typing import Any

from ..config import ConfigError, SystemConfig

__all__ = ["ESTIMATE_KEYS", "ESTIMATE_COLUMNS", "estimate_points", "run_estimate_point", "shape_text"]

_COMMON = {"mode": None, "model": None, "tp": 1, "pp": 1, "dp": 1, "sp": None, "dtype": "bf16"}
_INFERENCE = {"batch": 1, "input": 1024, "output": 128, "samples": 5, "eager": False, "ep": 1, "max_context": None,
              "max_model_len": None, "serving": "vllm-neuron"}
_TRAIN = {"micro_batch": 1, "seq": 2048, "global_batch": None}
ESTIMATE_KEYS = tuple(_COMMON) + tuple(_INFERENCE) + tuple(_TRAIN)
#: CSV columns a spec with estimates adds after the kernel (and collective) columns
ESTIMATE_COLUMNS = ("ttft_ms", "tpot_ms", "tokens_per_s", "step_ms", "mfu_percent_step", "hbm_peak_bytes")
_SHAPE = ("tp", "pp", "dp")


def shape_text(shape: tuple[int, ...]) -> str:
    """The ``shape`` cell of an estimate point: its parallelism."""
    return " ".join(f"{k}={v}" for k, v in zip(_SHAPE, shape))


def estimate_points(entries: Any, where: str, system: SystemConfig
                    ) -> list[tuple[str, tuple[int, ...], str, tuple[tuple[str, Any], ...]]]:
    """(model, (tp, pp, dp), dtype, params) per entry, each checked on ``system``."""
    from ..workload.plan import DTYPE_BYTES, check_batch, check_plan, check_sizes
    from ..workload.models import load_model

    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: estimates: expected a non-empty list of {{mode, model, tp, ...}}")
    out = []
    for i, e in enumerate(entries):
        loc = f"{where}: estimates[{i}]"
        if not isinstance(e, dict) or "model" not in e or e.get("mode") not in ("inference", "train"):
            raise ConfigError(f"{loc}: expected a mapping with 'mode' (inference or train) and 'model'")
        own = _INFERENCE if e["mode"] == "inference" else _TRAIN
        bad = [k for k in e if k not in _COMMON and k not in own]
        if bad:
            raise ConfigError(f"{loc}: unknown key '{bad[0]}' for {e['mode']}; expected "
                              f"{', '.join([*_COMMON, *own])}")
        loc = f"{loc} ({e['model']})"
        values = {**_COMMON, **own, **e}
        for k, v in values.items():
            if k in ("mode", "model", "dtype", "sp") or (k in ("global_batch", "sp", "max_context", "max_model_len")
                                                          and v is None):
                continue
            if k == "serving":
                from ..workload.serve import SERVING

                if v not in SERVING:
                    raise ConfigError(f"{loc}: serving: expected one of {', '.join(SERVING)}, got {v!r}")
                continue
            if k == "eager":
                if not isinstance(v, bool):
                    raise ConfigError(f"{loc}: eager: expected true or false, got {v!r}")
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{loc}: {k}: expected a positive whole number, got {v!r}")
        if values["sp"] is not None and not isinstance(values["sp"], bool):
            raise ConfigError(f"{loc}: sp: expected true or false, got {values['sp']!r}")
        if values["dtype"] not in DTYPE_BYTES:  # else every variant's row records the same error
            raise ConfigError(f"{loc}: dtype: expected one of {', '.join(DTYPE_BYTES)}, got {values['dtype']!r}")
        try:
            model = load_model(str(e["model"]))
            check_plan(model, system, values["tp"], values["pp"], values["dp"], str(values["dtype"]))
            if e["mode"] == "inference":
                check_sizes(model, input_tokens=values["input"], output_tokens=values["output"],
                            samples=values["samples"])
                check_batch(model, system, values["tp"], values["pp"], str(values["dtype"]), batch=values["batch"],
                            tokens=values["input"] + values["output"])
            else:
                gbs = values["global_batch"] or values["micro_batch"] * values["dp"]
                check_sizes(model, seq=values["seq"], micro_batches=gbs // (values["micro_batch"] * values["dp"]))
                check_batch(model, system, values["tp"], values["pp"], str(values["dtype"]),
                            micro_batch=values["micro_batch"], seq=values["seq"])
        except ConfigError as err:
            raise ConfigError(f"{loc}: {err}") from None
        params = tuple(sorted((k, v) for k, v in values.items()
                              if k not in ("model", "tp", "pp", "dp", "dtype") and v is not None))
        out.append((str(e["model"]), (values["tp"], values["pp"], values["dp"]), str(values["dtype"]), params))
    return out


def run_estimate_point(system: SystemConfig, model: str, shape: tuple[int, ...], dtype: str,
                       params: dict[str, Any]) -> dict[str, Any]:
    """Run one estimate point; its CSV cells (an ``error`` cell when this variant cannot run it)."""
    try:
        import torch

        from torch_bridge.timing.estimate import estimate_inference, estimate_train
    except ImportError as e:
        return {"error": f"estimates need PyTorch and transformers ({e})"}
    tp, pp, dp = shape
    p = dict(params)
    try:
        if p["mode"] == "inference":
            extra = {k: p[k] for k in ("max_context", "max_model_len") if p.get(k) is not None}
            if not p.get("eager"):
                extra["ep"] = p.get("ep", 1)
            est, _ = estimate_inference(model, system, tp=tp, pp=pp, dp=dp, sp=p.get("sp"), batch=p["batch"],
                                        eager=bool(p.get("eager")), serving=p.get("serving", "vllm-neuron"), **extra,
                                        input_tokens=p["input"], output_tokens=p["output"], dtype=dtype,
                                        samples=p["samples"])
            row = {"us": round(est.ttft_ms * 1e3, 4), "ttft_ms": round(est.ttft_ms, 4), "tpot_ms": round(est.tpot_ms, 4),
                   "tokens_per_s": round(est.system_tokens_per_s, 3), "bound": est.decode.bound}
        else:
            est, _ = estimate_train(model, system, tp=tp, pp=pp, dp=dp, sp=bool(p.get("sp")),
                                    micro_batch=p["micro_batch"], seq=p["seq"], global_batch=p.get("global_batch"),
                                    dtype=dtype)
            row = {"us": round(est.step_ms * 1e3, 4), "step_ms": round(est.step_ms, 4),
                   "tokens_per_s": round(est.tokens_per_s, 3), "mfu_percent_step": round(est.mfu_percent, 3),
                   "mfu_percent": round(est.mfu_percent, 2), "bound": est.forward.bound}
    except torch.OutOfMemoryError as e:
        return {"error": f"out of memory: {e}"}
    except ConfigError as e:
        return {"error": str(e)}
    except ImportError as e:  # a broken transformers: the model's code does not import
        return {"error": f"importing {e.name or 'the model code'} failed ({e})"}
    row.update(error="", hbm_peak_bytes=max(m.peak_bytes for m in est.memory))
    return row
