"""A digest of what trnsim computes, to show that a change which should not change behaviour
(a move, a split, a rename) does not: run it before and after, and compare the two files.

    python benchmarks/behaviour_digest.py > before.txt
    ...
    python benchmarks/behaviour_digest.py > after.txt && diff before.txt after.txt

One line per item, ``<what> <sha256 prefix>``: the stream fingerprint (every instruction's
fields, deps and DMA plan), the simulated timeline (total ticks, every instruction's ready/end
tick, the trace segments) and the output values of every registered library kernel on
trn1/trn2/trn3; the stdout of the CLI commands whose output the golden files pin; a sample of
torch ops on the neuron device (values, and the simulated time each one cost) and a training step.
Nothing here reads wall time. ``--no-torch`` leaves the torch part out; ``--quick`` does trn2 only.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import sys
from typing import Any

import numpy as np

CONFIGS = ("trn1", "trn2", "trn3")


def _h(obj: Any) -> str:
    if isinstance(obj, np.ndarray):
        data = obj.dtype.str.encode() + repr(obj.shape).encode() + np.ascontiguousarray(obj).tobytes()
    elif isinstance(obj, bytes):
        data = obj
    else:
        data = repr(obj).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def kernels(configs: tuple[str, ...]) -> list[str]:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "builder"))
    from test_build_equivalence import SMALL  # the set the build-equivalence test uses

    from trnsim import Chip, load_config
    from trnsim.isa import KernelError
    from trnsim.kernels import get_kernel, kernel_names
    try:
        from trnsim.builder.kernel import reference_build, stream_fingerprint
    except ImportError:
        from trnsim.kernel import reference_build, stream_fingerprint
    try:
        from trnsim.sim import simulate
    except ImportError:  # pragma: no cover
        raise
    out = []
    for name in sorted(kernel_names()):
        entry = get_kernel(name)
        shape = SMALL.get(name, entry.default_shape if name not in ("matmul", "bmm", "attention") else None)
        if shape is None:
            shape = {"matmul": (384, 256, 1030), "bmm": (2, 128, 128, 512), "attention": (1, 1, 256, 128)}[name]
        for cfg in configs:
            config = load_config(cfg)
            try:
                fast = entry.make(shape, entry.default_dtype, config, {})
                with reference_build():
                    ref = entry.make(shape, entry.default_dtype, config, {})
            except KernelError as e:
                out.append(f"kernel {name} {cfg} refused {_h(str(e))}")
                continue
            out.append(f"kernel {name} {cfg} stream {_h(stream_fingerprint(fast))} ref {_h(stream_fingerprint(ref))}")
            for eng in ("native", "simpy"):
                tl = simulate(config, [fast], engine=eng)[0]
                out.append(f"kernel {name} {cfg} simulate[{eng}] total={tl.total_ticks} "
                           f"{_h((tl.ready, tl.end, tl.trigger, tl.owner, tl.segments))}")
            if cfg == "trn2":
                chip = Chip(cfg)
                rng = np.random.default_rng(0)
                inputs = {}
                for tname, t in kernel_inputs(fast).items():
                    # small integers for integer inputs (indices), a seeded normal otherwise
                    if "int" in str(t.dtype.short):
                        inputs[tname] = rng.integers(0, 2, size=tuple(t.shape)).astype(np.int32)
                    else:
                        inputs[tname] = (rng.standard_normal(tuple(t.shape)) * 0.5).astype(np.float32)
                try:
                    res = chip.run(entry.make(shape, entry.default_dtype, config, {}), inputs)
                    vals = {k: _h(np.asarray(v)) for k, v in sorted(res.outputs.items())}
                    out.append(f"kernel {name} {cfg} run total_ticks={res.report.total_ticks} values {_h(vals)}")
                except Exception as e:  # noqa: BLE001 - an input this script cannot make is named, not fatal
                    out.append(f"kernel {name} {cfg} run skipped {type(e).__name__}")
    return out


def kernel_inputs(kernel: Any) -> dict[str, Any]:
    return {n: t for n, t in kernel.tensors.items() if t.kind in ("input", "inout")}


CLI = [["info", "trn2"], ["info", "trn3", "--set", "core.sbuf.partition_bytes=300KiB", "--json"],
       ["kernel", "matmul", "--shape", "512x1024x1024"], ["kernel", "--list"],
       ["kernel", "softmax", "--config", "trn3", "--json"],
       ["collective", "all-reduce", "--bytes", "8B:1GiB", "--factor", "8"],
       ["collective", "allg", "--system", "trn3-ultraserver-gen1", "--ranks", "16", "--bytes", "1MiB,256MiB",
        "--set", "topology.server.bandwidth=512GB/s"]]


def cli(with_torch: bool) -> list[str]:
    import trnsim
    from trnsim.cli import main
    root = os.path.dirname(os.path.dirname(os.path.abspath(trnsim.__file__)))
    out = []
    runs = list(CLI)
    if with_torch:
        runs.append(["demo"])
    for argv in runs:
        buf, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as e:
                code = e.code
        # the checkout's own path (a config's "source") is where the digest runs, not behaviour
        text, errs = (x.getvalue().replace(root, "<repo>") for x in (buf, err))
        out.append(f"cli {' '.join(argv)} -> {code} {_h(text)} stderr {_h(errs)}")
    return out


def torch_sample() -> list[str]:
    import torch
    import torch.nn.functional as F
    out = []
    torch.manual_seed(0)
    a, b = torch.randn(130, 257), torch.randn(257, 300)
    x = torch.randn(2, 3, 16, 16)
    w = torch.randn(4, 3, 3, 3)
    ops = {
        "mm": lambda d: a.to(d) @ b.to(d),
        "mm_bf16": lambda d: a.to(d).bfloat16() @ b.to(d).bfloat16(),
        "softmax": lambda d: torch.softmax(a.to(d), -1),
        "layer_norm": lambda d: F.layer_norm(a.to(d), (257,)),
        "gelu": lambda d: F.gelu(a.to(d)),
        "conv2d": lambda d: F.conv2d(x.to(d), w.to(d), padding=1),
        "sum": lambda d: a.to(d).sum(0),
        "sdpa": lambda d: F.scaled_dot_product_attention(*(t.to(d) for t in (torch.randn(1, 2, 64, 32),) * 3)),
    }
    for name, fn in ops.items():
        torch.neuron.synchronize()
        t0 = torch.neuron.report().total_us if hasattr(torch.neuron.report(), "total_us") else None
        r = fn("neuron").cpu()
        torch.neuron.synchronize()
        rep = torch.neuron.report()
        out.append(f"torch {name} values {_h(r.float().numpy())} report {_h(str(rep))} t0 {t0}")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    xb, yb = torch.randn(32, 64).to("neuron"), torch.randint(0, 10, (32,)).to("neuron")
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out.append(f"torch train losses {_h(losses)} params {_h([p.detach().cpu().numpy() for p in model.parameters()])}"
               f" report {_h(str(torch.neuron.report()))}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--quick", action="store_true", help="trn2 only")
    p.add_argument("--part", choices=("kernels", "cli", "torch"), action="append")
    args = p.parse_args(argv)
    parts = args.part or ["kernels", "cli"] + ([] if args.no_torch else ["torch"])
    lines: list[str] = []
    if "kernels" in parts:
        lines += kernels(("trn2",) if args.quick else CONFIGS)
    if "cli" in parts:
        lines += cli("torch" in parts)
    if "torch" in parts:
        lines += torch_sample()
    for line in lines:
        print(line)
    print(f"digest {_h(lines)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
