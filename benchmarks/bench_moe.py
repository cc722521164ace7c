"""A Mixtral MoE layer on the virtual chip: the one ``moe`` kernel against the block's ops run
one by one, in one run.

The same ``MixtralSparseMoeBlock`` (transformers, random weights, bf16) runs twice on one
``neuron`` logical core on the same tokens: as it runs by default on neuron (``block(h)``: the
``trnsim::moe_block`` op, one launch of the library ``moe`` kernel) and through the block's own
forward with the ``eager`` experts loop (router linear, softmax, top-k, one-hot, and per expert
hit a ``where``, gather, two linears, silu, product, scale and ``index_add_``: each a device
kernel, with host syncs at ``nonzero`` and the expert loop's ``item()``). For each the script
prints the simulated elapsed time (host issue included), the device time, launches, HBM
traffic and the busiest engines; then the ratio. Values are checked equal (the op computes the
block's own ops; exit status 1 if not).

    OMP_NUM_THREADS=1 python3 benchmarks/bench_moe.py            # Mixtral-8x7B layer, 512 tokens (~3 min)
    OMP_NUM_THREADS=1 python3 benchmarks/bench_moe.py --quick    # 256 tokens, hidden 512, ffn 1024, 8 experts
    python3 benchmarks/bench_moe.py --tokens 2048 --hidden 4096 --ffn 14336 --experts 8 --top-k 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TRNSIM_NATIVE_THREADS"):
    os.environ.setdefault(_name, "1")

import torch  # noqa: E402  (after the thread pins)

from _args import whole  # noqa: E402  (the script beside this one)

MIXTRAL_8X7B = dict(tokens=512, hidden=4096, ffn=14336, experts=8, top_k=2)
QUICK = dict(tokens=256, hidden=512, ffn=1024, experts=8, top_k=2)


def _block(hidden: int, ffn: int, experts: int, top_k: int, dtype: torch.dtype) -> Any:
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    transformers.utils.logging.set_verbosity_error()
    cfg = transformers.MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=experts,
                                     num_experts_per_tok=top_k, num_attention_heads=8, num_key_value_heads=8,
                                     num_hidden_layers=1, vocab_size=128, experts_implementation="eager")
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, hidden ** -0.5)
    return block.to(dtype).to("neuron").eval()


def _run(fn: Any, h: torch.Tensor) -> tuple[torch.Tensor, Any, float]:
    torch.neuron.synchronize()  # the weights' copies finish before the scope starts
    t0 = time.perf_counter()
    with torch.neuron.report_scope() as scope, torch.no_grad():
        out = fn(h)
        torch.neuron.synchronize()
    return out, scope.report, time.perf_counter() - t0


def _busiest(report: Any) -> str:
    rows = [r for r in report.rows if r.time_us > 0]
    total: dict[str, float] = {}
    for r in rows:
        for eng, pct in r.engine_percent.items():
            total[eng] = total.get(eng, 0.0) + pct * r.time_us / 100.0
    top = sorted(total.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{e} {100.0 * t / report.device_us:.0f}%" for e, t in top) if report.device_us else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"a small layer: {QUICK}")
    for k, v in MIXTRAL_8X7B.items():
        ap.add_argument("--" + k.replace("_", "-"), type=whole(1, 1 << 20), default=None, help=f"default {v} ({QUICK[k]} quick)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = ap.parse_args(argv)
    dims = dict(QUICK if args.quick else MIXTRAL_8X7B)
    for k in dims:
        if getattr(args, k) is not None:
            dims[k] = getattr(args, k)
    if dims["top_k"] > dims["experts"]:
        ap.error(f"--top-k {dims['top_k']}: expected at most the {dims['experts']} experts")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    from torch_bridge import moe

    block = _block(dims["hidden"], dims["ffn"], dims["experts"], dims["top_k"], dtype)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(1, dims["tokens"], dims["hidden"], generator=g).to(dtype).to("neuron")
    print(f"Mixtral MoE layer on {torch.neuron.config().name}, one logical core: tokens {dims['tokens']}, hidden "
          f"{dims['hidden']}, ffn {dims['ffn']}, {dims['experts']} experts, top-{dims['top_k']}, {args.dtype}")
    fused, rep_f, wall_f = _run(block, h)
    loop, rep_l, wall_l = _run(lambda x: moe.original_forward(type(block))(block, x), h)
    for name, rep, wall in (("moe kernel (trnsim::moe_block)", rep_f, wall_f), ("op by op (eager experts)", rep_l,
                                                                                 wall_l)):
        print(f"\n{name}")
        print(f"  simulated elapsed us          {rep.elapsed_us:12,.1f}")
        print(f"  device time us                {rep.device_us:12,.1f}")
        print(f"  device waiting on the host us {rep.host_wait_us:12,.1f}")
        print(f"  kernel launches               {rep.launches:12d}")
        print(f"  HBM MB                        {rep.hbm_bytes / 1e6:12,.1f}")
        print(f"  busiest engines               {_busiest(rep)}")
        print(f"  wall s                        {wall:12.2f}")
    row = rep_f.row("moe_block")
    print(f"\nmoe kernel: {row.time_us:,.1f} us, MFU {row.mfu_percent:.1f}%, bound {row.bound}")
    print(f"op by op / moe kernel: {rep_l.elapsed_us / rep_f.elapsed_us:.2f}x elapsed, "
          f"{rep_l.device_us / rep_f.device_us:.2f}x device time, {rep_l.launches} launches -> {rep_f.launches}")
    same = torch.equal(fused.cpu(), loop.cpu())
    print(f"values equal: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
