"""trnsim.serve: continuous batching, chunked prefill, prefix caching and KV admission against
timelines worked by hand (constant step times), and the workloads."""

import pytest

from trnsim.buckets import Buckets
from trnsim.serve import HostLoop, Request, ServeConfig, ServeError, poisson_requests, read_trace, simulate


class Steps:
    """Prefill 1.0 s, decode 0.5 s, whatever the shape; every call recorded."""

    def __init__(self, prefill=1.0, decode=0.5):
        self.p, self.d = prefill, decode
        self.calls = []

    def prefill(self, batch, tokens, prior=0):
        self.calls.append(("prefill", batch, tokens, prior))
        return self.p

    def decode(self, batch, kv):
        self.calls.append(("decode", batch, kv))
        return self.d


B = Buckets(context=(4, 8), kv=(128, 256), batch=(1, 2, 4))


def cfg(**kw):
    return ServeConfig(**{"max_batch": 4, "chunk": 8, "buckets": B, "kv_tokens": 1024, "block": 1, **kw})


def test_two_requests_continuous_batching_by_hand():
    """A (t=0, 4 in, 3 out) and B (t=1.2, 4 in, 2 out):
    0.0-1.0 prefill A -> A's 1st token at 1.0;   1.0-1.5 decode [A] -> A's 2nd at 1.5 (B arrived at 1.2);
    1.5-2.5 prefill B -> B's 1st at 2.5;          2.5-3.0 decode [A, B] -> A's 3rd, B's 2nd at 3.0: both done."""
    steps = Steps()
    res = simulate([Request(0.0, 4, 3), Request(1.2, 4, 2)], steps, cfg(), keep_requests=True)
    assert steps.calls == [("prefill", 1, 4, 0), ("decode", 1, 128), ("prefill", 1, 4, 0), ("decode", 2, 128)]
    a, b = res.per_request
    assert (a["ttft_s"], a["e2e_s"]) == (1.0, 3.0) and (b["ttft_s"], b["e2e_s"]) == pytest.approx((1.3, 1.8))
    assert res.duration_s == 3.0 and res.request_throughput == pytest.approx(2 / 3)
    assert res.output_throughput == pytest.approx(5 / 3)
    assert res.ttft.mean_ms == pytest.approx(1150) and res.e2e.mean_ms == pytest.approx(2400)
    assert res.tpot.mean_ms == pytest.approx((1000 + 500) / 2)  # A: (3.0 - 1.0) / 2; B: (3.0 - 2.5) / 1
    assert res.itl.mean_ms == pytest.approx((500 + 1500 + 500) / 3)  # A's gaps 0.5, 1.5; B's 0.5
    assert (res.decode_steps, res.prefill_steps, res.mean_decode_batch, res.max_running) == (2, 2, 1.5, 2)


def test_the_engine_host_loop_sync_and_async_by_hand():
    """One request (4 in, 4 out), host 0.2 s per iteration, device prefill 1.0 s, decode 0.5 s.
    vllm-v0 (sync): every step host + device: tokens at 1.2, 1.9, 2.6, 3.3.
    vllm-neuron (async): the prefill and the first decode after it break the flow (the batch
    changed): 1.2, 1.9; then the host prepares a step ahead: max(0.2, 0.5) = 0.5 each: 2.4, 2.9.
    A host slower than the device (0.8 s) sets the pace: 1.8, 3.1, 3.9, 4.7."""
    def run(mode, host):
        res = simulate([Request(0.0, 4, 4)], Steps(), cfg(host=HostLoop.of(mode, host)), keep_requests=True)
        return res.per_request[0]["ttft_s"], res.per_request[0]["e2e_s"]

    assert run("vllm-v0", 0.2) == pytest.approx((1.2, 3.3))
    assert run("vllm-neuron", 0.2) == pytest.approx((1.2, 2.9))
    assert run("vllm-neuron", 0.8) == pytest.approx((1.8, 4.7))
    assert run("none", 0.8) == pytest.approx((1.0, 2.5))  # no engine: the device steps alone


def test_a_request_joining_breaks_the_async_flow():
    """A (t=0, 4 in, 4 out), B (t=1.5, 4 in, 3 out); host 0.2 s, async. A: prefill to 1.2, decode
    [A] 1.2-1.9 (flow broken by the prefill); B arrived: prefill B 1.9-3.1; decode [A, B] 3.1-3.8
    (the batch changed: sync); decode [A, B] 3.8-4.3 (kept: max) -> A done (4 tokens), B done (3)."""
    res = simulate([Request(0.0, 4, 4), Request(1.5, 4, 3)], Steps(), cfg(host=HostLoop.of("vllm-neuron", 0.2)),
                   keep_requests=True)
    a, b = res.per_request
    assert a["e2e_s"] == pytest.approx(4.3) and b["ttft_s"] == pytest.approx(3.1 - 1.5)
    assert b["e2e_s"] == pytest.approx(4.3 - 1.5)


def test_admission_holds_a_request_while_the_cache_holds_max_model_len_for_each_running():
    """Neuron does not preempt: with 20 tokens of cache and max_model_len 8, at most 20 // 8 = 2
    requests run, though a third's 6 tokens of blocks would fit. A, B, C (t=0, 4 in, 2 out):
    prefill A 0-1, prefill B 1-2, decode [A, B] 2-2.5 (both done), then C: prefill 2.5-3.5,
    decode [C] 3.5-4.0."""
    res = simulate([Request(0.0, 4, 2)] * 3, Steps(), cfg(kv_tokens=20, max_model_len=8), keep_requests=True)
    assert [r["e2e_s"] for r in res.per_request] == pytest.approx([2.5, 2.5, 4.0])
    assert res.waited_for_kv == 1
    free = simulate([Request(0.0, 4, 2)] * 3, Steps(), cfg(kv_tokens=24, max_model_len=8), keep_requests=True)
    assert [r["e2e_s"] for r in free.per_request] == pytest.approx([3.5, 3.5, 3.5])  # 3 fit: one batch of 3


def test_data_parallel_replicas_by_hand():
    """Two replicas, A (t=0, 4 in, 3 out), B (t=0.2, 4, 2), C (t=0.4, 4, 2); a request goes to the
    replica with the fewest requests. A -> r0: prefill 0-1. B -> r1 (r0 has A): prefill 0.2-1.2,
    decode [B] 1.2-1.7. C (r0 and r1 one each: r0) waits for r0's step at 1.0: prefill 1-2, decode
    [A, C] 2-2.5 (C done), decode [A] 2.5-3 (A done)."""
    reqs = [Request(0.0, 4, 3), Request(0.2, 4, 2), Request(0.4, 4, 2)]
    res = simulate(reqs, Steps(), cfg(), keep_requests=True, dp=2)
    a, b, c = res.per_request
    assert (a["ttft_s"], a["e2e_s"]) == pytest.approx((1.0, 3.0))
    assert (b["ttft_s"], b["e2e_s"]) == pytest.approx((1.0, 1.5))
    assert (c["ttft_s"], c["e2e_s"]) == pytest.approx((1.6, 2.1))
    assert (res.prefill_steps, res.decode_steps, res.duration_s) == (3, 3, 3.0)
    one = simulate(reqs, Steps(), cfg(), keep_requests=True)  # one replica: B and C prefill after A
    assert [r["e2e_s"] for r in one.per_request] == pytest.approx([4.0, 3.3, 3.1])
    with pytest.raises(ServeError, match=r"--dp 0: expected a whole number in 1\.\.65,536"):
        simulate(reqs, Steps(), cfg(), dp=0)


def test_a_bad_engine_is_one_line():
    with pytest.raises(ServeError, match=r"--serving 'vllm': expected one of vllm-neuron, vllm-v0, none"):
        HostLoop.of("vllm", 0.1)


def test_a_full_batch_makes_the_second_request_wait():
    """max batch 1: B is admitted only when A's last token is out (2.0), then 2.0-3.0 prefill, 3.0-3.5 decode."""
    res = simulate([Request(0.0, 4, 3), Request(1.2, 4, 2)], Steps(), cfg(max_batch=1), keep_requests=True)
    a, b = res.per_request
    assert a["e2e_s"] == 2.0 and b["ttft_s"] == pytest.approx(1.8) and b["e2e_s"] == pytest.approx(2.3)


def test_kv_capacity_bounds_admission():
    """7 + 6 tokens do not fit a 10-token cache: B waits for A's blocks though a batch slot is free."""
    res = simulate([Request(0.0, 4, 3), Request(1.2, 4, 2)], Steps(), cfg(kv_tokens=10), keep_requests=True)
    assert res.waited_for_kv == 1 and res.per_request[1]["ttft_s"] == pytest.approx(1.8)
    with pytest.raises(ServeError, match="request 1: 7 tokens of KV cache, more than its capacity of 6 tokens"):
        simulate([Request(0.0, 4, 3)], Steps(), cfg(kv_tokens=6))


def test_chunked_prefill_and_its_buckets():
    """A 10-token prompt with chunk 4: chunks of 4, 4 and 2 tokens (buckets 4, 4, 4) attending to 0, 4, 8 before."""
    steps = Steps()
    res = simulate([Request(0.0, 10, 2)], steps, cfg(chunk=4))
    assert steps.calls[:3] == [("prefill", 1, 4, 0), ("prefill", 1, 4, 4), ("prefill", 1, 4, 8)]
    assert res.ttft.mean_ms == pytest.approx(3000) and res.prefill_padding_percent == pytest.approx(100 * 2 / 12)


def test_prefix_caching_skips_the_prefix_a_previous_request_prefilled():
    steps = Steps()
    reqs = [Request(0.0, 8, 2, prefix=6, prefix_id="sys"), Request(5.0, 8, 2, prefix=6, prefix_id="sys")]
    res = simulate(reqs, steps, cfg(prefix_caching=True, block=2))
    assert [c for c in steps.calls if c[0] == "prefill"] == [("prefill", 1, 8, 0), ("prefill", 1, 4, 6)]
    assert res.cached_prefix_tokens == 6
    steps = Steps()
    simulate(reqs, steps, cfg(block=2))  # without prefix caching both prefill everything
    assert [c for c in steps.calls if c[0] == "prefill"] == [("prefill", 1, 8, 0)] * 2


def test_poisson_arrivals_are_seeded_and_traces_read(tmp_path):
    a, b = poisson_requests(4.0, 50, 512, 128, seed=3), poisson_requests(4.0, 50, 512, 128, seed=3)
    assert a == b and a != poisson_requests(4.0, 50, 512, 128, seed=4)
    assert 8 < a[-1].arrival < 20  # 50 requests at 4 per second
    assert all(r.arrival == 0 for r in poisson_requests(float("inf"), 5, 8, 2))
    with pytest.raises(ServeError, match=r"^--rate 1e-300: 2 requests arrive over 1.7e\+300 s, more than 1e\+07 s; a "
                                         r"higher --rate or fewer --requests$"):
        poisson_requests(1e-300, 2, 8, 2)
    p = tmp_path / "t.csv"
    p.write_text("arrival,input,output\n0.5,100,10\n0.1,200,20\n")
    assert read_trace(p) == [Request(0.1, 200, 20), Request(0.5, 100, 10)]
    j = tmp_path / "t.jsonl"
    j.write_text('{"arrival": 0, "input": 8, "output": 2, "prefix": 4, "prefix_id": "x"}\n')
    assert read_trace(j) == [Request(0.0, 8, 2, 4, "x")]


@pytest.mark.parametrize("text,message", [
    ("arrival,input\n0,5\n", "request 1: missing 'output'"),
    ("arrival,input,output\nsoon,5,5\n", "request 1: arrival must be a number"),
    ("arrival,input,output\n-1,5,5\n", "request 1: expected arrival >= 0 s"),
    ("arrival,input,output\n", "no requests"),
    # was run: the step times added to 1e300 s vanished (TTFT 0.00 ms, benchmark duration 0.00 s)
    ("arrival,input,output\n0,5,5\n1e300,5,5\n", r"request 2: arrival 1e\+300 s, later than 1e\+07 s"),
])
def test_bad_traces_are_one_line(tmp_path, text, message):
    p = tmp_path / "t.csv"
    p.write_text(text)
    with pytest.raises(ServeError, match=message):
        read_trace(p)


def test_one_helper_declares_and_parses_the_bucket_flags_of_every_command():
    import argparse

    from trnsim.cli import estimate as cli_estimate, serve as cli_serve
    from trnsim.workload.buckets import BUCKET_FLAGS, BucketError, add_bucket_flags, parse_bucket_flags

    p = argparse.ArgumentParser()
    add_bucket_flags(p, context=("prompt", "--max-context"), kv=("decode KV", "--max-model-len"), batch="--batch")
    args = p.parse_args(["--kv-buckets", "512,128", "--batch-buckets", "4"])
    parse_bucket_flags(args)
    assert (args.context_buckets, args.kv_buckets, args.batch_buckets) == (None, (128, 512), (4,))
    with pytest.raises(BucketError, match="--context-buckets '0': expected"):
        parse_bucket_flags(p.parse_args(["--context-buckets", "0"]))
    # both commands take them from the helper (their --help states each one's default rule)
    for mod in (cli_estimate, cli_serve):
        assert "add_bucket_flags" in vars(mod) and "parse_buckets" not in vars(mod)
    assert BUCKET_FLAGS == ("context_buckets", "kv_buckets", "batch_buckets")


def test_a_length_over_the_largest_bucket_names_the_flag_that_gives_buckets():
    """It said 'raise KV', which is no flag."""
    from trnsim.workload.buckets import Buckets, BucketError

    b = Buckets((128,), (128,), (1, 2))
    with pytest.raises(BucketError, match=r"^a KV cache of 129: more than the largest KV bucket 128; give --kv-buckets a "
                                          r"larger one, or raise the maximum its default rule runs to$"):
        b.kv_for(129)
    with pytest.raises(BucketError, match=r"^a batch of 3: more than the largest batch bucket 2; give --batch-buckets "):
        b.batch_for(3)
