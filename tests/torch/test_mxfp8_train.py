"""MXFP8 training on trn3 (issue 29, item 4), worked by hand for one layer of the tiny Llama
(hidden 256, 8 heads of 32, 2 KV heads, MLP 512) at TP=1, T = 128 tokens.

Each of the layer's four linears (fused q/k/v N = 256 + 2 x 32 + 2 x 32 = 384, o_proj 256, fused
gate/up 2 x 512, down_proj 256 from K = 512), weight W [N, K] as nn.Linear stores it, runs three
MX matmuls a step, each operand cast along the contraction by ``mx_quantize`` first:

* forward  y = x W^T:  x [T, K] (rows), W [N, K] (rows);     matmul_mx (T, K, N)
* dgrad   gx = g W:    g [T, N] (rows), W [N, K] along N (cols); matmul_mx (T, N, K)
* wgrad   gW = g^T x:  g along T (cols), x along T (cols);     matmul_mx (N, T, K)

So the forward launches 8 casts and 4 MX matmuls (the LM head stays a bf16 ``mm``), the backward
16 and 8, and their time is those kernels' costs on trn3.
"""

from pathlib import Path

import pytest

from torch_bridge.estimate import estimate_train
from trnsim.cli import main
from trnsim.config import load_system
from trnsim.device import Device, KernelSpec

TINY = str(Path(__file__).parent.parent / "data" / "tiny-llama.json")
SYSTEM = "trn3-ultraserver-gen1"
T = 128
LINEARS = [(256, 384), (256, 256), (256, 1024), (512, 256)]  # (K, N): qkv, o, gate/up, down
FMT = "mxfp8_e4m3fn"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("costs")


def _q(r, k, layout):
    return KernelSpec.of("mx_quantize", (r, k), "bf16", {"fmt": FMT, "layout": layout})


def _mx(m, k, n):
    return KernelSpec.of("matmul_mx", (m, k, n), FMT, {"out_dtype": "bfloat16"})


def _kind(report, name):
    return next(k for k in report.kinds if k.kind == name)


def test_mxfp8_linears_are_charged_the_casts_and_the_mx_matmuls(cache):
    sysc = load_system(SYSTEM)
    dev = Device(sysc.chip)
    ms = lambda specs: sum(dev.cost(s).ticks for s in specs) / sysc.tick_hz * 1e3  # noqa: E731
    fwd_q = [s for k, n in LINEARS for s in (_q(T, k, "rows"), _q(n, k, "rows"))]
    fwd_mx = [_mx(T, k, n) for k, n in LINEARS]
    bwd_q = [s for k, n in LINEARS for s in (_q(T, n, "rows"), _q(k, n, "cols"), _q(n, T, "cols"), _q(k, T, "cols"))]
    bwd_mx = [s for k, n in LINEARS for s in (_mx(T, n, k), _mx(n, T, k))]

    est, _ = estimate_train(TINY, SYSTEM, layers=1, seq=T, cache_dir=cache, mxfp8=True)
    plain, _ = estimate_train(TINY, SYSTEM, layers=1, seq=T, cache_dir=cache)
    for rep, casts, mxs, mm in ((est.forward, fwd_q, fwd_mx, 1), (est.backward, bwd_q, bwd_mx, 2)):
        q = _kind(rep, "quantize")
        assert q.calls == len(casts) and q.time_ms == pytest.approx(ms(casts), rel=1e-9)
        mx = [o for o in rep.ops if o[0] == "matmul_mx"]
        assert len(mx) == 1 and mx[0][2] == len(mxs) and mx[0][3] == pytest.approx(ms(mxs), rel=1e-9)
        assert [o[2] for o in rep.ops if o[0] == "mm"] == [mm]  # the LM head's, in bf16
    for rep in (plain.forward, plain.backward):
        assert all(k.kind != "quantize" for k in rep.kinds) and not [o for o in rep.ops if o[0] == "matmul_mx"]
    assert est.recipe["mxfp8"] is True
    assert est.train_memory == plain.train_memory  # the casts are transient; bf16 x and W are what is kept


@pytest.mark.parametrize("argv,message", [
    (["--system", "trn2.48xlarge", "--mxfp8"],
     "trnsim: error: --mxfp8: trn2 has no MX matmul (nc_matmul_mx is NeuronCore-v4's: core.tensor.mx_quad is false); "
     "use a trn3 system\n"),
    (["--system", "trn1.32xlarge", "--mxfp8"],
     "trnsim: error: --mxfp8: trn1 has no MX matmul (nc_matmul_mx is NeuronCore-v4's: core.tensor.mx_quad is false); "
     "use a trn3 system\n"),
    (["--system", SYSTEM, "--mxfp8", "--dtype", "fp32"],
     "trnsim: error: --mxfp8: --dtype fp32: MXFP8 training casts bf16 linears (TorchAO's recipe); use --dtype bf16\n"),
])
def test_cli_refuses_mxfp8_off_trn3(argv, message, capsys):
    code = main(["estimate", "train", "--model", TINY, "--seq", "64", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err == message
