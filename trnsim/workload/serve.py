"""A serving simulation: requests arriving over time, scheduled as vLLM on Neuron schedules them, on
step times of the simulated kernels (torch-free; the step times come from a :class:`StepCosts`,
in ``trnsim estimate serve`` :class:`torch_bridge.estimate_kernels.StepCosts`, whose every step
shape is the lowered model's kernels simulated once and cached - never a formula fitted to them).

The scheduler (vLLM Neuron's, ``neuron-scheduler.md``): continuous batching - a request joins the
running batch when its prefill ends and leaves it when its last token is out; prefill and decode
are never mixed in one step, one prefill per step, prefills first (a waiting request is admitted
as soon as there is room: fewer than ``max_batch`` running and its KV blocks free); a prompt longer
than ``chunk`` tokens is prefilled in chunks of ``chunk`` (chunked prefill), each chunk a step of
its own at the smallest context bucket that holds it, attending to the chunks before it
(``prior``); a decode step runs every running request's next token at the batch bucket of the
running count and the KV bucket of the longest sequence. Preemption is not supported on Neuron
(``neuron-scheduler.md``), so admission prevents it: a request is admitted only while fewer than
``kv_tokens // max_model_len`` requests run or prefill (the scheduler's ``_max_kv_concurrent``:
every running request may grow to ``max_model_len``), and it reserves its whole KV (prompt +
output, in blocks of ``block`` tokens); with
``prefix_caching`` a request's leading ``prefix`` tokens that an earlier request of the same
``prefix_id`` already prefilled are not computed again (whole blocks; the cached blocks stay).

The serving engine's host work (:class:`HostLoop`): every iteration the host schedules, prepares
the step's inputs and processes its outputs, ``host.serve_step`` of the chip config. vLLM's
synchronous engine (the V0 engine of the Neuron fork, ``--serving vllm-v0``) does it between device
steps, so a step takes host + device. vLLM Neuron (``vllm-neuron``, the default) schedules
asynchronously (``async-scheduling-and-async-execution.md``): a queue of depth 2 and the sampled
token fed back on the device let the host prepare step n + 1 while the device runs step n, so a
step takes max(host, device) - unless the batch changed (a request joined or left, a prefill ran):
then "the async flow must be broken" and that step runs synchronously, host + device. ``none``
charges no engine (a bare NxDI or transformers-neuronx generation loop).

What it reports is what ``vllm bench serve`` prints: request throughput, output and total token
throughput, and mean / p50 / p90 / p99 of TTFT, TPOT (per request: ``(E2E - TTFT) / (output - 1)``),
ITL (every gap between two tokens of a request) and E2E latency, plus the padding the buckets added.
"""

from __future__ import annotations

import csv
import json
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from .buckets import Buckets
from ..config import ConfigError

__all__ = ["Request", "StepCosts", "HostLoop", "SERVING", "ServeConfig", "ServeResult", "Latency", "ServeError", "poisson_requests",
           "read_trace", "simulate", "PERCENTILES", "MAX_REQUESTS", "MAX_ARRIVAL_S"]

#: the percentiles reported beside the mean
PERCENTILES = (50, 90, 99)
#: requests one simulation takes at most (a trace or --requests)
MAX_REQUESTS = 100_000
#: the latest arrival a run takes, in seconds (~116 days). Times are float seconds, which resolve
#: ~2 ns here; at 1e300 s a step added to an arrival was lost whole (TTFT 0.00 ms, duration 0)
MAX_ARRIVAL_S = 1e7


class ServeError(ConfigError):
    """A serving setup that cannot run as asked (one line)."""


@dataclass(frozen=True)
class Request:
    """One request: ``arrival`` seconds after the start, ``prompt`` and ``output`` tokens; its
    first ``prefix`` prompt tokens are shared with every request of the same ``prefix_id``."""

    arrival: float
    prompt: int
    output: int
    prefix: int = 0
    prefix_id: str = ""


class StepCosts(Protocol):
    """Seconds of one step: a prefill of ``batch x tokens`` with ``prior`` tokens cached before
    them, a decode step of ``batch`` sequences over a KV bucket of ``kv`` positions."""

    def prefill(self, batch: int, tokens: int, prior: int = 0) -> float: ...

    def decode(self, batch: int, kv: int) -> float: ...


#: the serving engines ``--serving`` names: how each runs its host work beside the device's steps
SERVING = {"vllm-neuron": "async", "vllm-v0": "sync", "none": "none"}


@dataclass(frozen=True)
class HostLoop:
    """The serving engine's host work per iteration (module docstring): ``mode`` ``async`` (vLLM
    Neuron's async scheduling), ``sync`` (vLLM's V0 engine) or ``none``; ``step_s`` seconds."""

    mode: str = "none"
    step_s: float = 0.0

    @staticmethod
    def of(serving: str, step_s: float) -> "HostLoop":
        if serving not in SERVING:
            raise ServeError(f"--serving {serving!r}: expected one of {', '.join(SERVING)}")
        if not (math.isfinite(step_s) and step_s >= 0):
            raise ServeError(f"host.serve_step {step_s!r} s: expected a time >= 0")
        return HostLoop(SERVING[serving], step_s if SERVING[serving] != "none" else 0.0)

    def step(self, device_s: float, same_batch: bool) -> float:
        """Wall seconds of one engine iteration whose device step takes ``device_s``:
        ``same_batch`` when it decodes the same requests as the iteration before (the only case
        async scheduling keeps its one-step lead)."""
        if self.mode == "async" and same_batch:
            return max(self.step_s, device_s)
        return self.step_s + device_s


@dataclass(frozen=True)
class ServeConfig:
    max_batch: int
    chunk: int  # max tokens per prefill step (vLLM's max_num_batched_tokens)
    buckets: Buckets
    kv_tokens: int  # KV-cache capacity, tokens (per sequence-parallel group: each rank holds its heads' share)
    block: int = 32
    prefix_caching: bool = False
    max_model_len: int = 0
    host: HostLoop = HostLoop()


@dataclass(frozen=True)
class Latency:
    """Mean and percentiles of one latency, milliseconds."""

    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @staticmethod
    def of(values: Sequence[float]) -> "Latency":
        if not len(values):
            return Latency(0.0, 0.0, 0.0, 0.0)
        a = np.asarray(values, dtype=np.float64) * 1e3
        p = np.percentile(a, PERCENTILES)
        return Latency(float(a.mean()), float(p[0]), float(p[1]), float(p[2]))


@dataclass
class ServeResult:
    """What a serving run gives (``vllm bench serve``'s figures, and more)."""

    requests: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Latency
    tpot: Latency
    itl: Latency
    e2e: Latency
    prefill_steps: int
    decode_steps: int
    mean_decode_batch: float
    max_running: int
    prefill_padding_percent: float
    decode_batch_padding_percent: float
    decode_kv_padding_percent: float
    cached_prefix_tokens: int
    kv_capacity_tokens: int
    waited_for_kv: int  # requests that waited for KV blocks with a batch slot free
    per_request: list[dict[str, float]] = field(default_factory=list)
    setup: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- workloads ---------------------------------------------------------------------------------------
def poisson_requests(rate: float, n: int, prompt: int, output: int, seed: int = 0, prefix: int = 0) -> list[Request]:
    """``n`` requests of ``prompt`` / ``output`` tokens arriving as a Poisson process of ``rate``
    per second (exponential gaps from ``numpy.random.default_rng(seed)``; ``rate`` inf: all at
    once, as ``vllm bench serve --request-rate inf``); ``prefix`` leading tokens shared by all."""
    if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0):
        raise ServeError(f"--rate {rate!r}: expected a positive number of requests per second (or inf)")
    _count("--requests", n, MAX_REQUESTS)
    if prefix > prompt:
        raise ServeError(f"--prefix-len {prefix}: longer than --input {prompt}")
    if math.isinf(rate):
        times = np.zeros(n)
    else:
        times = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))
        if not times[-1] <= MAX_ARRIVAL_S:
            raise ServeError(f"--rate {rate:g}: {n:,} requests arrive over {times[-1]:.3g} s, more than "
                             f"{MAX_ARRIVAL_S:g} s; a higher --rate or fewer --requests")
    return [Request(float(t), prompt, output, prefix, "shared" if prefix else "") for t in times]


def _count(flag: str, v: Any, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
        raise ServeError(f"{flag} {v!r}: expected a whole number in 1..{hi:,}")
    return v


def read_trace(path: str | Path) -> list[Request]:
    """Requests from a trace file: CSV with a header, or JSON Lines, with ``arrival`` (seconds),
    ``input`` and ``output`` tokens, optional ``prefix`` (shared leading tokens) and ``prefix_id``."""
    from ..config import clip_text, read_bounded

    p = Path(path)
    where = clip_text(str(path))
    text = read_bounded(p, where, "trace")
    rows: list[dict[str, Any]] = []
    if p.suffix.lower() in (".jsonl", ".json"):
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ServeError(f"{where}: line {i}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ServeError(f"{where}: line {i}: expected an object with arrival, input, output")
            rows.append(obj)
    else:
        reader = csv.DictReader(text.splitlines())
        rows = [dict(r) for r in reader]
    if not rows:
        raise ServeError(f"{where}: no requests (expected a CSV header arrival,input,output or JSON Lines)")
    if len(rows) > MAX_REQUESTS:
        raise ServeError(f"{where}: {len(rows):,} requests; at most {MAX_REQUESTS:,}")
    out = []
    for i, r in enumerate(rows, 1):
        try:
            arrival = float(r["arrival"])
            prompt, output = int(str(r["input"])), int(str(r["output"]))
            prefix = int(str(r.get("prefix") or 0))
        except KeyError as e:
            raise ServeError(f"{where}: request {i}: missing {e.args[0]!r} (expected arrival, input, output)") from None
        except (TypeError, ValueError):
            raise ServeError(f"{where}: request {i}: arrival must be a number of seconds and input, output, prefix "
                             f"whole numbers") from None
        if not math.isfinite(arrival) or arrival < 0 or prompt < 1 or output < 1 or not 0 <= prefix <= prompt:
            raise ServeError(f"{where}: request {i}: expected arrival >= 0 s, input >= 1, output >= 1 and 0 <= prefix "
                             f"<= input")
        if arrival > MAX_ARRIVAL_S:
            raise ServeError(f"{where}: request {i}: arrival {arrival:g} s, later than {MAX_ARRIVAL_S:g} s (times are "
                             f"float seconds: a later one loses the step times added to it)")
        out.append(Request(arrival, prompt, output, prefix, str(r.get("prefix_id") or ("shared" if prefix else ""))))
    out.sort(key=lambda q: q.arrival)
    return out


# ---- the scheduler ---------------------------------------------------------------------------------
@dataclass
class _Live:
    req: Request
    index: int
    done: int = 0  # prompt tokens prefilled (cached prefix included)
    generated: int = 0
    times: list[float] = field(default_factory=list)  # each token's time
    blocks: int = 0


class _Replica:
    """One model replica's scheduler (a DP rank of vLLM Neuron: its own queue, batch and KV cache)."""

    def __init__(self, index: int, costs: StepCosts, cfg: ServeConfig, finished: list[_Live]):
        self.index, self.costs, self.cfg, self.finished = index, costs, cfg, finished
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self.prefilling: _Live | None = None
        self.cached: set[tuple[str, int]] = set()  # (prefix_id, cached tokens) ready to reuse
        self.free = cfg.kv_tokens // cfg.block
        self.t = 0.0
        self.last: tuple[int, ...] | None = None  # the requests the previous iteration decoded (None: it prefilled)
        # Neuron's _max_kv_concurrent: requests the cache holds at max_model_len each
        self.concurrent = (cfg.kv_tokens // cfg.max_model_len or cfg.max_batch) if cfg.max_model_len else cfg.max_batch
        self.n_pre = self.n_dec = self.dec_seqs = self.max_run = self.waited = self.cached_tokens = 0
        self.pad = {"pre_real": 0, "pre_run": 0, "bat_real": 0, "bat_run": 0, "kv_real": 0, "kv_run": 0}
        self.waited_ids: set[int] = set()

    def load(self) -> int:
        return len(self.waiting) + len(self.running) + (self.prefilling is not None)

    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling is not None)

    def step(self) -> None:
        """One engine iteration at ``self.t``: admit, then a prefill chunk or a decode step."""
        cfg, b, block = self.cfg, self.cfg.buckets, self.cfg.block
        if self.prefilling is None and self.waiting and len(self.running) < cfg.max_batch:
            head = self.waiting[0]
            need = -(-(head.req.prompt + head.req.output) // block)
            if need <= self.free and len(self.running) < self.concurrent:
                self.waiting.popleft()
                self.free -= need
                head.blocks = need
                self.prefilling = head
                if cfg.prefix_caching and head.req.prefix:
                    reuse = head.req.prefix // block * block
                    if (head.req.prefix_id, reuse) in self.cached and reuse:
                        reuse = min(reuse, head.req.prompt - 1)  # the last prompt token is always computed
                        head.done = reuse
                        self.cached_tokens += reuse
            elif head.index not in self.waited_ids:
                self.waited_ids.add(head.index)
                self.waited += 1
        if self.prefilling is not None:
            r = self.prefilling
            chunk = min(cfg.chunk, r.req.prompt - r.done)
            tokens = b.context_for(chunk)
            self.t += cfg.host.step(self.costs.prefill(1, tokens, r.done), False)
            self.last = None
            self.n_pre += 1
            self.pad["pre_real"] += chunk
            self.pad["pre_run"] += tokens
            r.done += chunk
            if r.done == r.req.prompt:
                if cfg.prefix_caching and r.req.prefix:
                    self.cached.add((r.req.prefix_id, r.req.prefix // block * block))
                r.generated = 1
                r.times.append(self.t)
                self.prefilling = None
                if r.generated >= r.req.output:
                    self.free += r.blocks
                    self.finished.append(r)
                else:
                    self.running.append(r)
                    self.max_run = max(self.max_run, len(self.running))
            return
        if self.running:
            running = self.running
            n = len(running)
            bb = b.batch_for(n)
            longest = max(q.req.prompt + q.generated for q in running)  # positions after this step's token
            kv = b.kv_for(longest)
            ids = tuple(q.index for q in running)
            self.t += cfg.host.step(self.costs.decode(bb, kv), ids == self.last)
            self.last = ids
            self.n_dec += 1
            self.dec_seqs += n
            self.pad["bat_real"] += n
            self.pad["bat_run"] += bb
            self.pad["kv_real"] += sum(q.req.prompt + q.generated for q in running)
            self.pad["kv_run"] += kv * n
            still = []
            for q in running:
                q.generated += 1
                q.times.append(self.t)
                if q.generated >= q.req.output:
                    self.free += q.blocks
                    self.finished.append(q)
                else:
                    still.append(q)
            self.running = still
            return
        # pragma: no cover - a waiting request every replica can admit alone (checked in simulate)
        raise ServeError("a waiting request can never be admitted")


def simulate(requests: Sequence[Request], costs: StepCosts, cfg: ServeConfig, keep_requests: bool = False,
             dp: int = 1) -> ServeResult:
    """Serve ``requests`` (sorted by arrival) on ``costs`` under ``cfg`` (see the module docstring)
    with ``dp`` replicas (vLLM Neuron's data parallelism without expert parallelism: a scheduler,
    batch and KV cache of ``cfg`` each, never synchronised; a request goes, when it arrives, to the
    replica with the fewest requests waiting, prefilling or running as of its last step, the
    lowest-numbered on a tie)."""
    if not requests:
        raise ServeError("no requests to serve")
    _count("--dp", dp, 1 << 16)
    block = cfg.block
    cap_blocks = cfg.kv_tokens // block
    for i, r in enumerate(requests):
        need = r.prompt + r.output
        if cfg.max_model_len and need > cfg.max_model_len:
            raise ServeError(f"request {i + 1}: {r.prompt:,} + {r.output:,} tokens, more than --max-model-len "
                             f"{cfg.max_model_len:,}")
        if -(-need // block) > cap_blocks:
            raise ServeError(f"request {i + 1}: {need:,} tokens of KV cache, more than its capacity of "
                             f"{cfg.kv_tokens:,} tokens")
    arrivals = deque(range(len(requests)))
    finished: list[_Live] = []
    reps = [_Replica(k, costs, cfg, finished) for k in range(dp)]
    while True:
        busy = [r for r in reps if r.busy()]
        if not arrivals and not busy:
            break
        nxt = min(busy, key=lambda r: (r.t, r.index)) if busy else None
        if arrivals and (nxt is None or requests[arrivals[0]].arrival <= nxt.t):
            i = arrivals.popleft()
            rep = min(reps, key=lambda r: (r.load(), r.index))
            if not rep.busy():  # idle until this request arrives
                rep.t = max(rep.t, requests[i].arrival)
            rep.waiting.append(_Live(requests[i], i))
            continue
        assert nxt is not None
        nxt.step()
    n_pre = sum(r.n_pre for r in reps)
    n_dec = sum(r.n_dec for r in reps)
    dec_seqs = sum(r.dec_seqs for r in reps)
    max_run = max(r.max_run for r in reps)
    waited = sum(r.waited for r in reps)
    cached_tokens = sum(r.cached_tokens for r in reps)
    pad = {k: sum(r.pad[k] for r in reps) for k in reps[0].pad}
    finished.sort(key=lambda q: q.index)
    first = min(r.arrival for r in requests)
    duration = max(q.times[-1] for q in finished) - first
    ttft = [q.times[0] - q.req.arrival for q in finished]
    e2e = [q.times[-1] - q.req.arrival for q in finished]
    tpot = [(q.times[-1] - q.times[0]) / (q.req.output - 1) for q in finished if q.req.output > 1]
    itl = [b2 - a for q in finished for a, b2 in zip(q.times, q.times[1:])]
    tin = sum(q.req.prompt for q in finished)
    tout = sum(q.req.output for q in finished)

    def pct(real: int, run: int) -> float:
        return 100.0 * (run - real) / run if run else 0.0

    res = ServeResult(
        requests=len(finished), duration_s=duration, input_tokens=tin, output_tokens=tout,
        request_throughput=len(finished) / duration if duration else 0.0,
        output_throughput=tout / duration if duration else 0.0,
        total_token_throughput=(tin + tout) / duration if duration else 0.0,
        ttft=Latency.of(ttft), tpot=Latency.of(tpot), itl=Latency.of(itl), e2e=Latency.of(e2e),
        prefill_steps=n_pre, decode_steps=n_dec, mean_decode_batch=dec_seqs / n_dec if n_dec else 0.0,
        max_running=max_run, prefill_padding_percent=pct(pad["pre_real"], pad["pre_run"]),
        decode_batch_padding_percent=pct(pad["bat_real"], pad["bat_run"]),
        decode_kv_padding_percent=pct(pad["kv_real"], pad["kv_run"]), cached_prefix_tokens=cached_tokens,
        kv_capacity_tokens=cfg.kv_tokens, waited_for_kv=waited)
    if keep_requests:
        res.per_request = [{"arrival_s": q.req.arrival, "ttft_s": q.times[0] - q.req.arrival,
                            "e2e_s": q.times[-1] - q.req.arrival, "tokens": len(q.times)} for q in finished]
    return res


def sweep_rates(rates: Sequence[float], make: Any) -> list[tuple[float, ServeResult]]:
    """``make(rate)`` -> ServeResult for each rate (a latency-vs-rate sweep)."""
    return [(r, make(r)) for r in rates]


def plot_sweep(points: Sequence[tuple[float, ServeResult]], out: Any, title: str) -> None:
    """Latency against request rate: TTFT and TPOT, p50 and p99 (``out``: a path or the
    :func:`trnsim.plot.reserve` reservation made before the runs)."""
    from ..outputs.plot import new_figure, save_figure

    fig = new_figure(10, 4)
    axes = fig.subplots(1, 2)
    rates = [r for r, _ in points]
    for ax, name in zip(axes, ("ttft", "tpot")):
        for q, style in (("p50_ms", "o-"), ("p99_ms", "s--")):
            ax.plot(rates, [getattr(getattr(res, name), q) for _, res in points], style,
                    label=f"{name.upper()} {q[:3]}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    save_figure(fig, out, "--plot")
