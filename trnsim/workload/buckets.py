"""Neuron's shape buckets: the fixed sequence lengths and batch sizes it compiles graphs for.

Neuron compiles a graph (a NEFF) per shape, so NxD Inference and vLLM on Neuron run every step
at one of a few fixed shapes - *buckets* - and pad the step up to it:

* **context (prefill) buckets**: a prompt (or a prefill chunk) of ``n`` tokens runs the graph of
  the smallest context bucket ``>= n``;
* **token-generation (KV) buckets**: a decode step attends over the smallest KV bucket ``>=``
  the longest sequence in the batch (the cache positions past a sequence's length are masked);
* **batch buckets**: a decode batch of 3 runs the batch-4 graph.

Neuron's default rule (NxDI ``enable_bucketing`` / ``autobucketing``; vLLM Neuron's
``num_batched_tokens_buckets`` and ``num_seqs_buckets``): powers of two from 128 up to the
maximum, and the maximum itself - context buckets up to the maximum context length, KV buckets
up to the maximum sequence length - and batch buckets as powers of two up to the maximum batch
and the maximum itself. :func:`default_buckets` builds them; any list given instead overrides
a rule. A length over the largest bucket is refused (one line), as Neuron has no graph for it.
A KV bucket is a multiple of 128 (the cache is tiled by 128 positions); with sequence
parallelism a context bucket is a multiple of the TP degree (vLLM Neuron: "prefill buckets must
be divisible by TP").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..config import ConfigError

__all__ = ["Buckets", "BucketError", "default_buckets", "parse_buckets", "power_buckets", "MIN_BUCKET", "BUCKET_FLAGS",
           "add_bucket_flags", "parse_bucket_flags"]

MIN_BUCKET = 128


class BucketError(ConfigError):
    """A length or batch no bucket holds, or a bucket list that is not one (one line)."""


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def power_buckets(lo: int, hi: int, multiple: int = 1) -> tuple[int, ...]:
    """Powers of two ``lo <= p < hi``, then ``hi`` (each rounded up to ``multiple``)."""
    out: list[int] = []
    p = 1
    while p < lo:
        p *= 2
    while p < hi:
        out.append(p)
        p *= 2
    out.append(hi)
    return tuple(sorted({_round_up(b, multiple) for b in out}))


#: the bucket lists a command line may give (argparse destinations of --context/kv/batch-buckets)
BUCKET_FLAGS = ("context_buckets", "kv_buckets", "batch_buckets")


def add_bucket_flags(parser: Any, *, context: tuple[str, str], kv: tuple[str, str], batch: str) -> None:
    """Add ``--context-buckets``, ``--kv-buckets`` and ``--batch-buckets`` to an argparse parser;
    ``context`` and ``kv`` are (what the buckets are called, what their default rule runs up to),
    ``batch`` what the batch buckets run up to (the default rule of :func:`default_buckets`)."""
    for flag, (what, upto) in (("--context-buckets", context), ("--kv-buckets", kv)):
        parser.add_argument(flag, metavar="N,N,...", help=f"{what} buckets (default: powers of 2 from {MIN_BUCKET} to "
                                                          f"{upto}, and it)")
    parser.add_argument("--batch-buckets", metavar="N,N,...", help=f"decode batch buckets (default: powers of 2 up to "
                                                                   f"{batch}, and it)")


def parse_bucket_flags(args: Any) -> None:
    """The bucket lists of :func:`add_bucket_flags` parsed in place (a one-line BucketError each)."""
    for name in BUCKET_FLAGS:
        v = getattr(args, name)
        if isinstance(v, str):
            setattr(args, name, parse_buckets(v, "--" + name.replace("_", "-")))


def parse_buckets(text: Any, flag: str) -> tuple[int, ...]:
    """``"128,512,2048"`` (or a list of ints) as a sorted tuple of positive whole numbers."""
    items = text.split(",") if isinstance(text, str) else list(text) if isinstance(text, (list, tuple)) else None
    if not items:
        raise BucketError(f"{flag} {text!r}: expected a comma-separated list of positive whole numbers, e.g. 128,512,2048")
    out = []
    for it in items:
        try:
            v = int(str(it).strip()) if not isinstance(it, bool) else 0
        except ValueError:
            v = 0
        if v < 1 or v > 1 << 24:
            raise BucketError(f"{flag} {text!r}: expected a comma-separated list of whole numbers in 1..{1 << 24:,}, "
                              f"e.g. 128,512,2048")
        out.append(v)
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class Buckets:
    """The context, KV and batch buckets of one compiled model (each sorted, ascending)."""

    context: tuple[int, ...]
    kv: tuple[int, ...]
    batch: tuple[int, ...]

    def _pick(self, which: tuple[int, ...], n: int, what: str, flag: str) -> int:
        for b in which:
            if b >= n:
                return b
        raise BucketError(f"{what} {n:,}: more than the largest {flag} bucket {which[-1]:,}; give --{flag.lower()}-buckets "
                          f"a larger one, or raise the maximum its default rule runs to")

    def context_for(self, n: int) -> int:
        return self._pick(self.context, n, "a prefill of", "context")

    def kv_for(self, n: int) -> int:
        return self._pick(self.kv, n, "a KV cache of", "KV")

    def batch_for(self, n: int) -> int:
        return self._pick(self.batch, n, "a batch of", "batch")

    def to_dict(self) -> dict[str, list[int]]:
        return {"context": list(self.context), "kv": list(self.kv), "batch": list(self.batch)}


def default_buckets(max_context: int, max_seq: int, max_batch: int, *, tp: int = 1, sp: bool = False,
                    seq_default: bool = False,
                    context: Sequence[int] | None = None, kv: Sequence[int] | None = None,
                    batch: Sequence[int] | None = None) -> Buckets:
    """Neuron's default buckets (see the module docstring) for prompts up to ``max_context``
    tokens, sequences up to ``max_seq`` and decode batches up to ``max_batch``; a list given for
    ``context``/``kv``/``batch`` replaces that rule (context buckets still rounded to TP with SP,
    KV buckets to 128)."""
    for name, v in (("--max-context", max_context), ("--max-model-len", max_seq), ("--max-batch", max_batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise BucketError(f"{name} {v!r}: expected a positive whole number")
    if max_context > max_seq:
        raise BucketError(f"--max-context {max_context:,}: more than --max-model-len {max_seq:,}"
                          f"{' (its default: --input + --output)' if seq_default else ''}; a prompt is part of its "
                          f"sequence")
    cm = tp if sp and tp > 1 else 1
    ctx = tuple(sorted({_round_up(b, cm) for b in context})) if context else \
        power_buckets(min(MIN_BUCKET, max_context), max_context, cm)
    kvb = tuple(sorted({_round_up(b, MIN_BUCKET) for b in kv})) if kv else \
        power_buckets(MIN_BUCKET, _round_up(max_seq, MIN_BUCKET), MIN_BUCKET)
    bb = tuple(sorted(set(batch))) if batch else power_buckets(1, max_batch)
    return Buckets(ctx, kvb, bb)


#: ``--moe-routing``: how a step's routed tokens spread over the expert-parallel ranks (the lowering's
#: ``torch_bridge.timing.nxdi.ROUTINGS``; the busiest rank bounds the step)
MOE_ROUTINGS = ("random", "balanced")


def add_moe_routing_flag(p: Any) -> None:
    """``--moe-routing`` for the commands that lower MoE layers (estimate inference, serve)."""
    p.add_argument("--moe-routing", choices=MOE_ROUTINGS, default="random",
                   help="how a step's routed tokens spread over the EP ranks, the busiest rank bounding the step: "
                        "random (default: the expected busiest rank when each token's picks land uniformly at "
                        "random) or balanced (every rank its mean share)")
