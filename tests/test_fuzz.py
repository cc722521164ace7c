"""Adversarial input, generated: malformed chip configs, sweep specs, results files and CLI lines,
and (the second set of surfaces) ``trnsim collective`` lines, ``trnsim estimate`` lines, system
YAMLs, NKI kernel files and ``trnsim run --nproc`` argument errors, each run through
``trnsim.cli.main`` as a user would run the command.

Every case must end with exit status 2 and one line ``trnsim: error: ...`` on stderr (naming the
thing where the case knows what it broke), or be accepted (status 0: the mutation happened to be
valid input) - never a traceback, never a hang (a generous per-case alarm), never a flood of
memory (growth of the driver's peak RSS per case). The cases are deterministic: case ``i`` of
seed ``s`` is always the same, and ``python3 tests/test_fuzz.py --seed s --case i`` reruns one.

The driver runs in a subprocess with an address-space limit, so an unbounded input fails this
test instead of the machine. ``python3 tests/test_fuzz.py --cases 3000`` is the long run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
# A hang, not a slow case (the slowest accepted cases take a few seconds): a case may use
# CASE_SECONDS of CPU time - its wall time on a machine of its own - and CASE_WALL_SECONDS of wall
# time, the backstop for a case that waits on nothing (no CPU). On a shared machine wall time is
# the work times the load (2 cores under 7 agents ran 5-8x slower), so a wall alarm of 30 s
# counted cases of 4 s of work as hangs.
CASE_SECONDS = 30.0
CASE_WALL_SECONDS = 300.0
CASE_RSS_BYTES = 400 * 2**20  # growth of peak RSS one case may cause
ERROR_PREFIX = "trnsim: error: "

# ---------------------------------------------------------------------------------------------
# ingredients
# ---------------------------------------------------------------------------------------------


def alias_bomb(levels: int, width: int = 9) -> str:
    """A flow-style YAML value whose aliases expand to width**levels scalars."""
    parts = [f"&a0 [{', '.join(['x'] * width)}]"]
    for i in range(1, levels + 1):
        parts.append(f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return "[" + ", ".join(parts) + "]"


def alias_bomb_block(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


SCALARS = ["", " ", "lots", "-1", "0", "1", "3", "128", "4096", "65536", "1e999", "nan", ".nan", "inf", "-.inf",
           "0x10", "1_000", "224KB/s", "224 KiB", "2.4 GHz", "1e-50ns", "1e400KiB", "1e9999999999GHz", "0B", "1B",
           "1GiB", "1TiB", "99999999999999999999", "9" * 5000, "x" * 100_000, "é", "\U0001f642" * 20, "true", "null",
           "~", "2001-13-45", "2001-01-01", "!!binary AAA", "!!python/object:os.system", "!!int abc", "0o777",
           "1:30", "'unclosed", '"unclosed', "[", "{", "]", "}", "- a", ": b", "%YAML 1.1", "---", "...", "*nope",
           "&a", "? x", "|", ">", "@x", "`x", "'a\nb'", "1.5GHz", "0.1ps", "2.9TB/s", "23B/ns", "3us", "1300ns"]


def bad_value(rng: random.Random) -> str:
    """A YAML value (flow style, one line unless it is a multi-line string) a config never has."""
    r = rng.random()
    if r < 0.55:
        return rng.choice(SCALARS)
    if r < 0.65:
        return alias_bomb(rng.randint(1, 9))
    if r < 0.72:
        n = rng.choice([10, 100, 1000, 10_000, 30_000])
        return "[" * n + "]" * n
    if r < 0.8:
        return "[" + ", ".join(rng.choice(SCALARS[:20]) for _ in range(rng.randint(0, 6))) + "]"
    if r < 0.86:
        return "{" + ", ".join(f"k{i}: {rng.choice(SCALARS[:20])}" for i in range(rng.randint(0, 4))) + "}"
    if r < 0.93:
        return "".join(rng.choice("abc01 :-[]{}#&*!|>'\"%@`,?\t\\") for _ in range(rng.randint(1, 40)))
    return "".join(chr(rng.randint(1, 0x2FFF)) for _ in range(rng.randint(1, 20)))


def mutate_yaml(text: str, rng: random.Random) -> tuple[bytes, list[str]]:
    """One to three mutations of a YAML document; returns the bytes and what a message may name."""
    lines = text.split("\n")
    names: list[str] = []
    for _ in range(rng.randint(1, 3)):
        keyed = [i for i, ln in enumerate(lines) if ":" in ln and not ln.lstrip().startswith("#")]
        op = rng.randrange(10)
        if op <= 2 and keyed:  # a value replaced
            i = rng.choice(keyed)
            key, _, _ = lines[i].partition(":")
            lines[i] = f"{key}: {bad_value(rng)}"
            names.append(key.strip())
        elif op == 3 and keyed:  # a key twice
            i = rng.choice(keyed)
            lines.insert(i + 1, lines[i])
            names.append("duplicate key")
        elif op == 4 and lines:  # a line gone
            del lines[rng.randrange(len(lines))]
        elif op == 5 and keyed:  # an unknown key beside a known one
            i = rng.choice(keyed)
            indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
            lines.insert(i, f"{indent}{rng.choice(['speed', 'sbufz', 'x' * 300, '1', 'null'])}: 1")
        elif op == 6:  # cut anywhere
            joined = "\n".join(lines)
            lines = joined[: rng.randrange(len(joined) + 1)].split("\n")
        elif op == 7 and keyed:  # indentation broken
            i = rng.choice(keyed)
            lines[i] = rng.choice(["\t", " ", "   ", ""]) + lines[i].lstrip()
        elif op == 8:  # a whole bad document in front or instead
            bomb = rng.choice([alias_bomb_block(rng.randint(3, 10)), "[" * 5000 + "]" * 5000,
                               "".join("  " * i + "- \n" for i in range(rng.choice([100, 2000]))), "- 1\n- 2\n",
                               "just a string\n", "", "&a [*a]\n", "a: &a {b: *a}\n"])
            lines = (bomb + ("\n".join(lines) if rng.random() < 0.5 else "")).split("\n")
        else:  # a value becomes a structure or an alias of one
            if keyed:
                i = rng.choice(keyed)
                key, _, _ = lines[i].partition(":")
                lines[i] = f"{key}: {rng.choice([alias_bomb(rng.randint(4, 8)), '[1, [2, [3]]]', '{a: {b: 1}}'])}"
                names.append(key.strip())
    data = "\n".join(lines).encode("utf-8", "surrogatepass")
    if rng.random() < 0.05:  # bytes that are not UTF-8, or a NUL
        pos = rng.randrange(len(data) + 1)
        data = data[:pos] + rng.choice([b"\xff\xfe", b"\x00", b"\xc3", b"\x80\x80"]) + data[pos:]
    return data, names


NAMES = ["matmul", "rmsnorm", "softmax", "transpose", "unary", "binary", "reduce", "layernorm", "embedding",
         "nope", "", "matmul ", "MATMUL", "x" * 10_000, "../x.py:f", "k.py", "k.py:", ":f", "a:b:c",
         "raises.py:build", "import_error.py:build", "returns_int.py:build", "foreign.py:build",
         "free_slice.py:build", "queue16.py:build", "recursion.py:build", "many.py:build", "ok.py:build",
         "ok.py:missing", "nonexistent.py:build", "fifo.py:build", "dir.py:build", "x" * 5000 + ".py:f"]
SMALL = [1, 2, 3, 64, 100, 128, 129, 256, 512]
FILE_KERNELS = {
    "ok.py": "import trnsim\ndef build(rows, cols, config='trn2'):\n"
             "    k = trnsim.Kernel('ok', config)\n    x = k.input('x', (rows, cols), 'fp32')\n"
             "    y = k.output('y', (rows, cols), 'fp32')\n    t = k.sbuf((rows, cols), 'fp32')\n"
             "    k.dma_copy(t, x)\n    k.dma_copy(y, t)\n    return k\n",
    "raises.py": "def build(*dims, config=None):\n    raise ValueError('boom ' * 10000)\n",
    "import_error.py": "import not_a_module_anywhere\n",
    "returns_int.py": "def build(*dims):\n    return 42\n",
    "foreign.py": "import trnsim\ndef build(*dims, config='trn2'):\n    a = trnsim.Kernel('a', config)\n"
                  "    b = trnsim.Kernel('b', config)\n    t = a.sbuf((128, 64), 'fp32')\n"
                  "    x = b.input('x', (128, 64), 'fp32')\n    b.dma_copy(t, x)\n    return b\n",
    "free_slice.py": "import trnsim\ndef build(*dims, config='trn2'):\n    k = trnsim.Kernel('k', config)\n"
                     "    t = k.sbuf((128, 64), 'fp32')\n    k.free(t[:, :32])\n    return k\n",
    "queue16.py": "import trnsim\ndef build(*dims, config='trn2'):\n    k = trnsim.Kernel('k', config)\n"
                  "    t = k.sbuf((128, 64), 'fp32')\n    x = k.input('x', (128, 64), 'fp32')\n"
                  "    k.dma_copy(t, x, queue=16)\n    return k\n",
    "recursion.py": "def build(*dims, config=None):\n    return build(*dims, config=config)\n",
    "many.py": "import trnsim\ndef build(*dims, config='trn2'):\n    k = trnsim.Kernel('k', config)\n"
               "    t = k.sbuf((128, 64), 'fp32')\n    while True:\n        k.memset(t, 0.0)\n",
}


def shape(rng: random.Random, dims: int | None = None) -> str:
    """A --shape: small dims (a fast run), or dims so big no HBM holds them, or garbage."""
    n = dims if dims is not None else rng.choice([1, 2, 3, 3, 4])
    r = rng.random()
    if r < 0.5:
        return "x".join(str(rng.choice(SMALL)) for _ in range(n))
    if r < 0.65:
        return "x".join(str(rng.choice([10**7, 10**9, 2**40])) for _ in range(n))
    return rng.choice(["", "x", "0x1x1", "-1x2x3", "1e3x2x2", "128X128X128", "128×128×128", "9" * 50, "1x" * 500,
                       "128 x 128 x 128", "0", "a", "\x00", "128x128x", "x128", "1.5x2x2", "nan", "99999999999999999999"])


def set_pair(rng: random.Random) -> tuple[str, str]:
    key = rng.choice(["core.sbuf.partition_bytes", "core.tensor.clock", "core.dma.queues", "chip.lnc",
                      "core.tensor.fp8_double_row", "chip.neuronlink.version", "core.vector.min_ii_cycles",
                      "core.sbuf", "core", "nope.key", "core..x", "", ".", "core.sbuf.partition_bytes.x",
                      "x" * 3000, "core.tensor.throttle_initial_util"])
    return key, bad_value(rng)


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------


class Case:
    def __init__(self, kind: str, argv: list[str], names: list[str] | None = None, env: dict[str, str] | None = None,
                 allow_status_1: bool = False):
        self.kind = kind
        self.argv = argv
        self.names = names or []  # the message should contain one of these (when given)
        self.env = env or {}
        self.allow_status_1 = allow_status_1


SPEC_BASE = """\
config: trn2
grid:
  core.tensor.clock: [2.4GHz, 3GHz]
  core.sbuf.partition_bytes: [224KiB]
kernels:
  - name: ok.py:build
    shapes: [128x64]
  - {name: matmul, shape: 128x128x128, dtype: bf16}
out: r.csv
"""


FIRST_KINDS = ("config", "spec", "results", "cli", "env")
SECOND_KINDS = ("collective", "estimate", "system", "nki", "nproc")

TINY_MODEL = ROOT / "tests" / "data" / "tiny-llama.json"
SIZES = ["1B", "2B", "8B", "1KiB", "64KiB", "1MiB", "3MB", "0B", "9B", "1e30B", "1PiB", "1EiB", "-1B", "B", "1.5B",
         "1KiB:1MiB", "1MiB:1KiB", "0B:1KiB", "8B:64MiB", "1,2,3", "1KiB,1MiB", ":", "1KiB:", "1B:2B:4B", "x" * 3000,
         "24GiB", "25GiB", "nan B", "1e-3B", "0x10B", "64MiB", "1_000B"]
COUNTS = ["1", "2", "4", "8", "16", "0", "-1", "3", "48", "65", "2048", "1000000000", "99999999999999999999", "x",
          "", "1.5", "1e3", "\u0663"]


def _collective_argv(rng: random.Random, system: str | None = None) -> list[str]:
    """A ``trnsim collective`` line: small work when it happens to be valid (at most 64 ranks
    of the base systems, sizes up to 64 MiB, always an explicit --bytes)."""
    name = rng.choice(["all-reduce", "allr", "all-gather", "allg", "reduce-scatter", "all-to-all", "broadcast",
                       "reduce", "send-recv", "permute", "bogus", "", "ALL-REDUCE", "x" * 500])
    argv = ["collective", name, "--bytes", rng.choice(SIZES)]
    if system is not None:
        argv += ["--system", system]
    elif rng.random() < 0.3:
        argv += ["--system", rng.choice(["trn2.48xlarge", "trn1.32xlarge", "trn9", "", "x" * 300,
                                         "trn3-ultraserver-gen1", "/dev/null", "../configs/trn2.yaml"])]
    if rng.random() < 0.7 or system is not None:
        argv += ["--ranks", rng.choice(COUNTS[:6] + COUNTS[6:] * (rng.random() < 0.5))]
    if rng.random() < 0.3:
        argv += ["--factor", rng.choice(["2", "8", "1", "0", "-2", "1000000", "x", "2.5"])]
    if rng.random() < 0.3:
        argv += ["--algo", rng.choice(["ring", "mesh", "kangaring", "rdh", "hierarchical", "per-dim-ring", "nope", ""])]
    if rng.random() < 0.3:
        argv += ["--dtype", rng.choice(["bf16", "fp32", "fp8", "int8", "", "x", "bfloat16"])]
    for _ in range(rng.choice([0, 0, 1])):
        argv += ["--set", rng.choice(["topology.x.bandwidth=", "topology.efa.size=4096", "topology.efa.size=0",
                                      "topology.q.size=2", "core.dma.engine_bandwidth=40GB/s", "collectives.window=0",
                                      "topology.x.latency=1e15s", "topology.x.size=3", "chip.lnc=3", "=1", "x"])
                 + ("" if rng.random() < 0.5 else rng.choice(["", "1", "1e999", "nan", "-1"]))]
    if rng.random() < 0.1:
        argv += ["--trace", rng.choice(["/dev/null", ".", "t.json", "no/dir/t.json", "fifo.json"])]
    if rng.random() < 0.2:
        argv += ["--json"]
    return argv


def _estimate_argv(rng: random.Random) -> list[str]:
    """A ``trnsim estimate`` line on the tiny model (or a bad one); valid lines are one layer, a
    short prompt and few decode samples."""
    mode = rng.choice(["inference", "train", "serve", ""])
    model = rng.choice([str(TINY_MODEL)] * 4 + ["llama-3.1-8b", "llama-3.3-70b", "llama-9", "", "/no/such.json",
                                                "x" * 3000, str(ROOT / "configs" / "trn2.yaml")])
    argv = ["estimate", mode, "--model", model, "--no-cache"]
    if mode == "serve":
        return argv + _serve_flags(rng)
    if mode == "inference" and rng.random() < 0.4:  # the kernel lowering's own options
        argv += [rng.choice(["--max-context", "--max-model-len", "--ep", "--context-buckets", "--kv-buckets",
                             "--batch-buckets"]),
                 rng.choice(["0", "-1", "16", "8,x", "1000000000", "128,64", "", "2", "3", "1e3"])]
        if rng.random() < 0.2:
            argv += [rng.choice(["--eager", "--sp", "--no-sp"])]
    if rng.random() < 0.85:  # a size flag somewhere outside what the model or a run allows
        flag = rng.choice(["--layers", "--tp", "--pp", "--dp"] + (["--batch", "--input", "--output", "--samples"]
                          if mode == "inference" else ["--micro-batch", "--seq", "--global-batch"]))
        argv += [flag, rng.choice(["0", "-1", "1000000000", "99999999999999999999", "x", "3", "5", "65", "128",
                                   "4097", "1e3", ""])]
    else:
        argv += ["--layers", "1"]
    argv += ["--input", "16", "--output", "2", "--samples", "2"] if mode == "inference" else \
        ["--seq", "32"] if mode == "train" else []
    if rng.random() < 0.3:
        argv += ["--dtype", rng.choice(["bf16", "fp32", "fp8", "x"])]
    if rng.random() < 0.3:
        argv += ["--system", rng.choice(["trn2.48xlarge", "trn9", "trn1.32xlarge", ""])]
    if rng.random() < 0.2:
        argv += ["--set", rng.choice(["topology.efa.size=4096", "chip.hbm.capacity=1MiB", "nope=1",
                                      "core.dma.start_latency=1e15s"])]
    return argv


def _serve_flags(rng: random.Random) -> list[str]:
    """``trnsim estimate serve`` flags: a few requests of a short prompt when valid, and most of the
    time one flag outside what it takes."""
    argv = ["--requests", "4", "--input", "16", "--output", "2"]
    if rng.random() < 0.9:
        flag = rng.choice(["--rate", "--requests", "--input", "--output", "--max-batch", "--chunk", "--kv-tokens",
                           "--prefix-len", "--kv-buckets", "--batch-buckets", "--context-buckets", "--sweep", "--trace",
                           "--ep", "--tp", "--max-model-len", "--seed", "--plot", "--dtype", "--layers", "--dp",
                           "--serving"])
        argv += [flag, rng.choice(["0", "-1", "1000000000", "99999999999999999999", "x", "3", "65", "inf", "nan",
                                   "1,2,x", "", "1e3", "/dev/null", "no/such.csv", "p.txt", "2,4"])]
    if rng.random() < 0.2:
        argv += [rng.choice(["--prefix-caching", "--json"])]
    return argv


NKI_KERNEL = """\
import trnsim.nki as nki
import trnsim.nki.isa as nisa
import trnsim.nki.language as nl


@nki.jit
def k(x, y):
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    a = nl.load(x[SLICE])
    b = nl.load(y)
    c = BODY
    acc = nl.zeros(PSUM, nl.float32, buffer=nl.psum)
    nl.store(out[STORE], value=c)
    return out
"""


def _nki_file(rng: random.Random) -> str:
    """An NKI kernel with its slices, body and PSUM tile drawn from good and bad choices."""
    slice_ = rng.choice(["0:128, 0:512", "0:256, 0:512", "0:128, 0:513", "-129:, :", ":, 600:700", "0:128, 0:512:2",
                         "0:0, :", "::-1, :", "0:128", "0:128, 0:512, 0", "nl.arange(256)[:, None], nl.arange(512)[None, :]",
                         ":, :"])
    body = rng.choice(["nl.add(a, b)", "nl.exp(a)", "nl.exp(nl.load(y).view(nl.int32))", "nl.multiply(a, b)",
                       "nisa.activation(op=nl.exp, data=a)", "nl.matmul(a, b)", "nl.relu(a)", "a[t]",
                       "nisa.nc_matmul(a[:, 0:128], b)", "nl.sqrt(nl.ndarray((128, 512), nl.int32))",
                       "nl.add(a, nl.ndarray((64, 512), nl.float32))", "undefined_name", "1 / 0",
                       "nl.exp(a, dtype=nl.int32)", "nl.transpose(a)"])
    psum = rng.choice(["(128, 512)", "(128, 513)", "(128, 4096)", "(256, 512)", "(128, 2048)", "(128, 0)", "(1, 1)"])
    store = rng.choice(["0:128, 0:512", ":, :", "0:256, :", "0:128, 0:1024", "0:64, :"])
    return (NKI_KERNEL.replace("SLICE", slice_).replace("BODY", body).replace("PSUM", psum).replace("STORE", store))


def _nproc_argv(rng: random.Random, d: Path) -> list[str]:
    """A ``trnsim run --nproc`` line with at least one argument error (so no ranks are launched)."""
    fields = {
        "nproc": (["2", "4"], ["0", "-1", "65", "1000000", "x", "", "2.5", "1e3", "99999999999999999999"]),
        "script": ([str(d / "s.py")], [str(d / "missing.py"), str(d), str(d / "fifo.json"), ""]),
        "system": (["trn2.48xlarge", None], ["trn9", "", "/dev/null", "x" * 300, "trn1.32xlarge:1"]),
        "timeout": ([None, "30"], ["0", "-5", "x", "1e999", "nan", "inf", ""]),
        "config": ([None, "trn2"], ["trn3", "trn9", ""]),
        "set": ([None], ["topology.efa.size=0", "core.dma.start_latency=1e15s", "nope=1", "topology.x.size=x"]),
    }
    pick = {k: rng.choice(good) for k, (good, _) in fields.items()}
    for k in rng.sample(sorted(fields), rng.randint(1, 2)):  # at least one bad
        pick[k] = rng.choice(fields[k][1])
    argv = ["run", "--nproc", pick["nproc"]]
    for flag in ("system", "timeout", "config", "set"):
        if pick[flag] is not None:
            argv += [f"--{flag}", pick[flag]]
    return argv + [pick["script"]]


def _second_case(kind: str, rng: random.Random, d: Path) -> Case:
    """A case of the second set of surfaces."""
    if kind == "collective":
        os.mkfifo(d / "fifo.json")
        return Case(kind, _collective_argv(rng))
    if kind == "estimate":
        return Case(kind, _estimate_argv(rng))
    if kind == "system":
        data, names = mutate_yaml((ROOT / "configs" / "systems" / "trn2.48xlarge.yaml").read_text(), rng)
        (d / "sys.yaml").write_bytes(data)
        argv = _collective_argv(rng, str(d / "sys.yaml"))
        argv[1], argv[3] = "all-reduce", rng.choice(["1MiB", "8B:1MiB", "64KiB"])  # the system is the bad input
        argv[argv.index("--ranks") + 1] = rng.choice(["8", "16", "4"])
        # the line's other flags may be what is refused (a bad --set, --factor ...): named as such,
        # a --set by its key (chip.lnc=3 is refused as 'trn2.yaml: chip.lnc = 3: expected a divisor ...')
        sets = [argv[i + 1].split("=", 1)[0] for i, a in enumerate(argv[:-1]) if a == "--set"]
        return Case(kind, argv, ["sys.yaml", "override", "--set", "--factor", "--algo", "dtype", "--trace",
                                 "--bytes", "--ranks", "argument"] + names + [k for k in sets if k])
    if kind == "nki":
        (d / "kern.py").write_text(_nki_file(rng))
        shapes = rng.choice(["128x512", "128x512,128x512", "256x512,128x512", "128x512,64x512", "0x512", "128x512,x",
                             "128x99999999", "1x1", "128x512,128x512,128x512"])
        argv = ["kernel", f"{d / 'kern.py'}:{rng.choice(['k', 'k', 'missing'])}", "--shape", shapes]
        if rng.random() < 0.3:
            argv += ["--dtype", rng.choice(["fp32", "bf16", "int32", "x"])]
        return Case(kind, argv, ["kern.py", "--shape", "--dtype", "kernel"])
    (d / "s.py").write_text("import torch\n")
    os.mkfifo(d / "fifo.json")
    return Case(kind, _nproc_argv(rng, d))


def make_case(seed: int, index: int, work: Path, kinds: Sequence[str] = FIRST_KINDS) -> Case:
    rng = random.Random(seed * 1_000_003 + index)
    d = work / f"c{index}"
    d.mkdir()
    if tuple(kinds) != FIRST_KINDS:  # the first set keeps the draws its seeds were pinned with
        kind = rng.choice(list(kinds))
        if kind in SECOND_KINDS:
            return _second_case(kind, rng, d)
    kind = rng.choice(["config", "config", "spec", "spec", "results", "cli", "cli", "cli", "env"])
    if kind == "config":
        data, names = mutate_yaml((ROOT / "configs" / "trn2.yaml").read_text(), rng)
        path = d / "chip.yaml"
        path.write_bytes(data)
        argv = ["info", str(path)] + (["--json"] if rng.random() < 0.3 else [])
        return Case(kind, argv, ["chip.yaml"] + names)
    if kind in ("spec", "results"):
        for name, text in FILE_KERNELS.items():
            (d / name).write_text(text)
        os.mkfifo(d / "fifo.py")
        (d / "dir.py").mkdir()
        data, names = mutate_yaml(SPEC_BASE, rng) if kind == "spec" else (SPEC_BASE.encode(), [])
        if kind == "spec" and rng.random() < 0.3:  # a big grid, or one value twice
            n = rng.choice([2, 50, 10_000])
            vals = ", ".join(f"{1000 + (i if rng.random() < 0.9 else 0)}MHz" for i in range(n))
            data = data.replace(b"[2.4GHz, 3GHz]", f"[{vals}]".encode())
        spec = d / "spec.yaml"
        spec.write_bytes(data)
        argv = ["sweep", str(spec), "--jobs", "1", "--max-points", "12"]
        out = rng.random()
        if out < 0.1:
            os.mkfifo(d / "fifo.csv")
            argv += ["--out", str(d / "fifo.csv")]
        elif out < 0.15:
            argv += ["--out", str(d)]
        elif out < 0.2:
            argv += ["--out", str(d / "no" / "such" / "dir" / "r.csv")]
        if kind == "results":  # a results file from a killed, older, foreign or damaged run
            header = ("core.tensor.clock,core.sbuf.partition_bytes,kernel,shape,dtype,params,cycles,us,mfu_percent,"
                      "mbu_percent,bound,tensor_active_percent,vector_active_percent,scalar_active_percent,"
                      "gpsimd_active_percent,sync_active_percent,dma_active_percent,instructions,hbm_bytes,"
                      "dma_bytes,matmul_flops,error\n")
            row = "2.4GHz,224KiB,ok.py:build,128x64,,,1.0,1.0,0,0,DMA/HBM,0,0,0,0,0,0,2,1,1,0,\n"
            body = rng.choice([header, header + row, header + row[: rng.randrange(len(row))], header[:20],
                               "a,b\n1,2\n", header + "1,2,3\n" + row, "\xff\xfe", "", header + '"unclosed\n',
                               header + row * 3 + row[:10]])
            (d / "r.csv").write_bytes(body.encode("utf-8", "surrogateescape"))
        return Case(kind, argv, ["spec.yaml", "r.csv", "fifo", "dir", "sweep results", "--out"] + names)
    if kind == "env":
        var = rng.choice(["TRNSIM_NATIVE_THREADS", "TRNSIM_MAX_INSTRUCTIONS"])
        value = rng.choice(["abc", "0", "-1", "65", "1e3", "9" * 5000, " ", "", "4", "\u0663", "0x10", "1.0"])
        return Case(kind, ["kernel", "matmul", "--shape", "128x128x128", "--check"], [var], {var: value},
                    allow_status_1=True)
    # a command line
    cmd = rng.choice(["info", "kernel", "kernel", "kernel", "garbage"])
    for name, text in FILE_KERNELS.items():
        (d / name).write_text(text)
    os.mkfifo(d / "fifo.json")
    (d / "target.json").write_text("old")
    os.symlink(d / "target.json", d / "link.json")
    os.symlink(d / "missing.json", d / "dangling.json")
    names = []
    if cmd == "info":
        argv = ["info", rng.choice(["trn2", "trn3", "trn9", "", "x" * 3000, str(d / "fifo.json"), str(d), "/dev/null",
                                    "../configs/trn2.yaml", str(d / "absent.yaml")])]
        names.append("config")
    elif cmd == "kernel":
        name = rng.choice(NAMES)
        argv = ["kernel", str(d / name) if name.endswith(":build") or name.endswith(":missing") else name]
        kdims = {"matmul": 3, "transpose": 2, "softmax": 2, "rmsnorm": 2}.get(name)
        argv += ["--shape", shape(rng, kdims if rng.random() < 0.7 else None)]
        if rng.random() < 0.3:
            argv += ["--dtype", rng.choice(["bf16", "fp32", "fp8", "int8", "", "bfloat16", "x" * 1000])]
        for _ in range(rng.choice([0, 0, 1, 2])):
            argv += ["--param", rng.choice(["scale=nan", "scale=inf", "transpose_a=maybe", "bufs=2", "eps=1e-6",
                                            "=1", "noeq", "x" * 5000 + "=1", "eps=" + "9" * 5000, "op=exp",
                                            "transpose_a=true", "eps=-inf"])]
            names.append("parameter")
        for _ in range(rng.choice([0, 0, 1])):
            k, v = set_pair(rng)
            argv += ["--set", f"{k}={v}"]
            names.append(k[:40] or "override")
        if rng.random() < 0.3:
            argv += ["--trace", str(d / rng.choice(["fifo.json", "link.json", "dangling.json", "t.json", "", ".",
                                                    "no/dir/t.json"]))]
            names.append("--trace")
        check = rng.random() < 0.2
        argv += ["--check"] if check else []
        return Case(kind, argv, None, allow_status_1=check)
    else:
        pool = ["info", "kernel", "sweep", "--set", "--shape", "--param", "--config", "--json", "--list", "--check",
                "--trace", "--jobs", "--max-points", "-1", "0", "99999999999999999999", "matmul", "trn2", "--",
                "-", "x" * 10_000, "\x00", "é", str(d / "fifo.json"), "--help=x", "--shape=1x1x1", "--jobs=two"]
        argv = [rng.choice(pool) for _ in range(rng.randint(0, 6))]
        if argv and argv[0] == "sweep":
            argv.insert(1, str(d / "fifo.json"))
    return Case(kind, argv, names or None)


# ---------------------------------------------------------------------------------------------
# running one case in this process
# ---------------------------------------------------------------------------------------------


class Hang(BaseException):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise Hang("cpu" if signum == signal.SIGPROF else "wall")


def max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def run_case(case: Case, cwd: Path) -> dict[str, object]:
    from trnsim.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_env = {k: os.environ.get(k) for k in case.env}
    os.environ.update(case.env)
    saved_cwd = os.getcwd()
    os.chdir(cwd)
    rss0 = max_rss()
    t0, cpu0 = time.perf_counter(), time.process_time()
    outcome: dict[str, object] = {"kind": case.kind}
    signal.signal(signal.SIGALRM, _alarm)
    signal.signal(signal.SIGPROF, _alarm)
    signal.setitimer(signal.ITIMER_PROF, CASE_SECONDS)  # CPU time of this process (user + system)
    signal.setitimer(signal.ITIMER_REAL, CASE_WALL_SECONDS)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(case.argv)
            except SystemExit as e:  # argparse's usage errors
                status = e.code if isinstance(e.code, int) else 1
        outcome["status"] = status
    except Hang as e:
        outcome["result"] = "hang"
        outcome["alarm"] = str(e)
    except BaseException as e:  # noqa: BLE001 - a traceback is what this test looks for
        outcome["result"] = "traceback"
        outcome["error"] = "".join(traceback.format_exception_only(type(e), e))[-500:]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.setitimer(signal.ITIMER_PROF, 0)
        os.chdir(saved_cwd)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    outcome["seconds"] = round(time.perf_counter() - t0, 3)
    outcome["cpu_seconds"] = round(time.process_time() - cpu0, 3)
    outcome["rss_growth"] = max_rss() - rss0
    text = err.getvalue()
    outcome["stderr"] = text[:300]
    if "result" in outcome:
        return outcome
    lines = text.splitlines()
    if "Traceback (most recent call last)" in text:
        outcome["result"] = "traceback"
    elif outcome["rss_growth"] > CASE_RSS_BYTES:  # type: ignore[operator]
        outcome["result"] = "flood"
    elif status == 0:
        outcome["result"] = "accepted"
    elif status == 2 and len(lines) == 1 and lines[0].startswith(ERROR_PREFIX) and len(lines[0]) <= 2100:
        named = not case.names or any(n and n.lower() in lines[0].lower() for n in case.names)
        outcome["result"] = "one-line" if named else "unnamed"
    elif status == 1 and case.allow_status_1 and not text:
        outcome["result"] = "accepted"  # --check found a mismatch: documented status 1
    else:
        outcome["result"] = "other"
    return outcome


def drive(seed: int, cases: range, kinds: Sequence[str] = FIRST_KINDS) -> dict[str, object]:
    os.environ["TRNSIM_MAX_INSTRUCTIONS"] = "20000"  # the instruction limit, reached in a second
    results = []
    with tempfile.TemporaryDirectory(prefix="trnsim-fuzz-") as tmp:
        work = Path(tmp)
        for i in cases:
            case = make_case(seed, i, work, kinds)
            r = run_case(case, work / f"c{i}")
            r["case"] = i
            if r["result"] not in ("one-line", "accepted"):
                r["argv"] = [a[:200] for a in case.argv]
            results.append(r)
    counts: dict[str, int] = {"tried": len(results)}
    for r in results:
        counts[str(r["result"])] = counts.get(str(r["result"]), 0) + 1
    kinds: dict[str, int] = {}
    for r in results:
        kinds[str(r["kind"])] = kinds.get(str(r["kind"]), 0) + 1
    per_kind: dict[str, dict[str, int]] = {}
    for r in results:
        k = per_kind.setdefault(str(r["kind"]), {"tried": 0})
        k["tried"] += 1
        k[str(r["result"])] = k.get(str(r["result"]), 0) + 1
    slowest_of = {k: max(float(r["seconds"]) for r in results if r["kind"] == k)  # type: ignore[arg-type]
                  for k in per_kind}
    bad = [r for r in results if r["result"] not in ("one-line", "accepted")]
    slowest = max(results, key=lambda r: r["seconds"])  # type: ignore[arg-type,return-value]
    busiest = max(results, key=lambda r: r["cpu_seconds"])  # type: ignore[arg-type,return-value]
    cpu_of = {k: max(float(r["cpu_seconds"]) for r in results if r["kind"] == k)  # type: ignore[arg-type]
              for k in per_kind}
    return {"seed": seed, "counts": counts, "kinds": kinds, "per_kind": per_kind, "slowest_per_kind": slowest_of,
            "bad": bad[:20],
            "slowest": {"case": slowest["case"], "seconds": slowest["seconds"], "cpu_seconds": slowest["cpu_seconds"]},
            "slowest_cpu_per_kind": cpu_of,
            "busiest": {"case": busiest["case"], "seconds": busiest["seconds"], "cpu_seconds": busiest["cpu_seconds"]},
            "max_rss_growth": max(int(r["rss_growth"]) for r in results)}  # type: ignore[call-overload]


def limit_memory(extra: int = 3 * 2**30) -> None:
    """Cap this process's address space a few GiB above what it holds now, so an input that is
    not bounded fails its case (MemoryError) instead of exhausting the machine."""
    with open("/proc/self/status") as f:
        vm = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra, resource.RLIM_INFINITY))


def _driver_main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--case", type=int, help="run one case and print it")
    ap.add_argument("--surfaces", choices=("first", "second"), default="first",
                    help="first: chip configs, sweep specs, results files, CLI lines, environment; second: "
                         "collective, estimate, system YAMLs, NKI files, run --nproc arguments")
    args = ap.parse_args()
    kinds = FIRST_KINDS if args.surfaces == "first" else SECOND_KINDS
    import trnsim.cli  # noqa: F401  (imported before the limit: its own size is not a case's)

    if args.surfaces == "second":  # PyTorch, transformers and the model code: loaded once, not per case
        import torch_bridge.estimate  # noqa: F401
        import torch_bridge.estimate_kernels  # noqa: F401
        import torch_bridge.launch  # noqa: F401
        import torch_bridge.run  # noqa: F401
        import torch_bridge.serve_costs  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401
    limit_memory()
    if args.case is not None:
        with tempfile.TemporaryDirectory(prefix="trnsim-fuzz-") as tmp:
            case = make_case(args.seed, args.case, Path(tmp), kinds)
            print(json.dumps({"argv": [a[:300] for a in case.argv], "env": case.env}))
            print(json.dumps(run_case(case, Path(tmp) / f"c{args.case}"), indent=1))
        return
    print(json.dumps(drive(args.seed, range(args.cases), kinds), indent=1))


# ---------------------------------------------------------------------------------------------
# the test
# ---------------------------------------------------------------------------------------------


def test_generated_bad_input_gets_one_line_errors_in_bounded_time_and_memory():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "--seed", "9", "--cases", "240"], capture_output=True,
                          text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    counts = summary["counts"]
    print(json.dumps(summary["counts"]), json.dumps(summary["kinds"]))
    assert not summary["bad"], json.dumps(summary["bad"], indent=1)
    assert counts["tried"] == 240 == counts.get("one-line", 0) + counts.get("accepted", 0)
    # the generator must mostly produce bad input, and every kind of it
    assert counts.get("one-line", 0) > 150 and set(summary["kinds"]) == {"config", "spec", "results", "cli", "env"}


def test_a_case_that_spins_or_waits_is_a_hang(monkeypatch, tmp_path):
    """The harness's own alarms: CPU time catches a case that computes for ever however loaded the
    machine is, wall time one that waits on nothing."""
    import trnsim.cli

    monkeypatch.setitem(globals(), "CASE_SECONDS", 0.3)
    monkeypatch.setitem(globals(), "CASE_WALL_SECONDS", 3.0)
    def spin(argv):
        while True:
            pass
    monkeypatch.setattr(trnsim.cli, "main", spin)
    spin = run_case(Case("cli", ["info"]), tmp_path)
    assert (spin["result"], spin["alarm"]) == ("hang", "cpu") and spin["cpu_seconds"] > 0.2  # (clock ticks)
    monkeypatch.setitem(globals(), "CASE_WALL_SECONDS", 0.3)
    monkeypatch.setattr(trnsim.cli, "main", lambda argv: time.sleep(30))
    wait = run_case(Case("cli", ["info"]), tmp_path)
    assert (wait["result"], wait["alarm"]) == ("hang", "wall") and wait["cpu_seconds"] < 0.3 <= wait["seconds"]
    monkeypatch.setattr(trnsim.cli, "main", lambda argv: 0)
    assert run_case(Case("cli", ["info"]), tmp_path)["result"] == "accepted"


def test_the_second_surfaces_get_one_line_errors_in_bounded_time_and_memory():
    """Issue 25: trnsim collective, trnsim estimate, system YAMLs, NKI kernel files and trnsim run
    --nproc argument errors, seeded as the first set is: one line and status 2, or accepted."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "--surfaces", "second", "--seed", "25", "--cases", "300"],
                          capture_output=True, text=True, timeout=1800, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    counts = summary["counts"]
    print(json.dumps(summary["per_kind"]), json.dumps(summary["slowest_per_kind"]))
    assert not summary["bad"], json.dumps(summary["bad"], indent=1)
    assert counts["tried"] == 300 == counts.get("one-line", 0) + counts.get("accepted", 0)
    assert set(summary["kinds"]) == set(SECOND_KINDS) and counts.get("one-line", 0) > 200


if __name__ == "__main__":
    _driver_main()
