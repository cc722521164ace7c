"""Programs as a user would run them, on the neuron device against CPU in the same run: the
steady-state wall time per step, the first step, and (``--split``) where the neuron run's wall
time goes.

Each program is written the way its users write it (small configs, random weights, nothing
downloaded): nanoGPT and GPT-2 training, ResNet-18, EfficientNet-B0 and MobileNetV3 training,
Mamba and Mixtral training, an LSTM, Llama ``generate()`` with a dynamic and with a static
cache, in bf16 and of 128 tokens, BERT inference and ViT training. Each runs in a fresh process (so its first step is a
first step): the first step on CPU, then on neuron, then ``--rounds`` rounds of ``--steps``
steps on CPU and on neuron; a round's ratio is its median neuron step over its median CPU step,
and the verdict is the median of the rounds (the machine is shared: a burst of load spoils a
round, not the verdict); the same ratio in process CPU time (``cpu-t x``) is printed beside it,
and the first steps' process CPU times (``1st cpu-t s``: CPU/neuron, ``!`` past the goal), which
load from other jobs does not inflate as it does wall time. Every step ends in a value on the host (``loss.item()``, the tokens),
so the neuron step includes the device model's work.

The issue's goals (30): every ratio <= 2x, their median <= 1.3x, the first step <= 3x CPU's first
step + 2 s. Values: the first step's loss (or tokens) against CPU's; ``--check-slow`` runs every
program a second time with the fast path off (``TRNSIM_FASTPATH=0``) and checks that every
step's value and simulated time are bit-identical to the fast run's (speed work never changes
a cycle or a value).

``--split`` runs each program once more under :mod:`torch_bridge.neuron.hostprof` and prints, for the
first step and for the steady steps, the wall time of each part of the simulator (kernel builds
and simulations, the device model, the Python path per op name, its CPU kernels) and the rest
(the native fast path with the CPU kernels it runs, autograd, the program's own Python), beside
the same program's CPU step.

``--warm`` runs each program twice more on neuron with one new on-disk cost cache
(``TRNSIM_COST_CACHE``, :func:`trnsim.device.costcache.device_cache_dir`): the first of them
simulates its kernels and stores their costs, the second reads them, and its first step is what a
script run again costs. Both runs' values and simulated times must be identical to the main run's.
Without ``--warm`` the cache is off in the programs' processes whatever the shell sets, so first
steps are cold.

    OMP_NUM_THREADS=1 python benchmarks/bench_zoo.py [--programs lstm,mamba] [--quick] [--split] [--check-slow] [--warm]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from _args import whole  # (the script beside this one)

ROOT = Path(__file__).resolve().parents[1]
TAG = "ZOO_RESULT "


# ---- the programs -----------------------------------------------------------------------------
# Each builder takes `quick` and returns (model on CPU, make_step): make_step(model, device)
# moves a copy of what it needs to `device` and returns a step() that runs one step and returns
# its value on the host (a float loss, or a list of tokens).

def _train(model: Any, inputs: tuple[Any, ...], loss_fn: Callable[..., Any], opt: str = "adamw"):
    def make_step(m: Any, device: str):
        import torch

        m = m.to(device)
        xs = tuple(x.to(device) for x in inputs)
        o = (torch.optim.AdamW(m.parameters(), lr=1e-3) if opt == "adamw"
             else torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))

        def step() -> float:
            o.zero_grad(set_to_none=True)
            loss = loss_fn(m, *xs)
            loss.backward()
            o.step()
            return loss.item()
        return step
    return model, make_step


def _tokens(vocab: int, batch: int, seq: int, seed: int = 1):
    import torch

    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def nanogpt(quick: bool):
    """Karpathy's nanoGPT model.py (the GPT class, flash attention through SDPA), AdamW."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    n_layer, n_head, n_embd, block, vocab, batch = (2, 4, 64, 32, 256, 4) if quick else (4, 4, 128, 64, 512, 8)

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(n_embd, 3 * n_embd)
            self.c_proj = nn.Linear(n_embd, n_embd)

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(n_embd, dim=2)
            k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
            q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
            v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.c_proj(y)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(n_embd)
            self.attn = CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(n_embd)
            self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, n_embd)
            self.wpe = nn.Embedding(block, n_embd)
            self.h = nn.ModuleList([Block() for _ in range(n_layer)])
            self.ln_f = nn.LayerNorm(n_embd)
            self.lm_head = nn.Linear(n_embd, vocab, bias=False)
            self.wte.weight = self.lm_head.weight

        def forward(self, idx, targets):
            pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for b in self.h:
                x = b(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    torch.manual_seed(0)
    x = _tokens(vocab, batch, block)
    return _train(GPT(), (x, torch.roll(x, -1, 1)), lambda m, x, y: m(x, y))


def gpt2_train(quick: bool):
    """Hugging Face GPT2LMHeadModel, language-model loss, AdamW."""
    import torch
    import transformers

    cfg = transformers.GPT2Config(vocab_size=512, n_positions=128, n_embd=64 if quick else 128,
                                  n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    x = _tokens(512, 2 if quick else 4, 32 if quick else 64)
    return _train(transformers.GPT2LMHeadModel(cfg), (x,), lambda m, x: m(input_ids=x, labels=x).loss)


def _image_train(model: Any, batch: int, size: int, classes: int):
    import torch

    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, classes, (batch,), generator=torch.Generator().manual_seed(3))
    return _train(model, (x, y), lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y), opt="sgd")


def resnet18(quick: bool):
    """torchvision's ResNet-18 (BasicBlock, [2, 2, 2, 2]), written out; SGD with momentum."""
    import torch
    from torch import nn

    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            idt = x if self.down is None else self.down(x)
            out = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(out)) + idt)

    w = 32 if quick else 64
    layers: list[nn.Module] = [nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    cin = w
    for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
        for j in range(2):
            layers.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    torch.manual_seed(0)
    return _image_train(nn.Sequential(*layers), 2 if quick else 4, 32 if quick else 64, 10)


def efficientnet_b0(quick: bool):
    """EfficientNet-B0 (benchmarks/bench_first_step.py's, from the paper's table), SGD."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("bench_first_step", ROOT / "benchmarks" / "bench_first_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    torch.manual_seed(0)
    return _image_train(mod.efficientnet_b0(10), 1 if quick else 2, 32 if quick else 64, 10)


def mobilenetv3(quick: bool):
    """MobileNetV3-Small (Howard et al. 2019, Table 2: hard-swish, squeeze-excitation with a hard
    sigmoid, depthwise convolutions), written out; SGD with momentum."""
    import torch
    from torch import nn

    def div8(v):
        return max(8, int(v + 4) // 8 * 8)

    class SE(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.fc = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, div8(c // 4), 1), nn.ReLU(inplace=True),
                                    nn.Conv2d(div8(c // 4), c, 1), nn.Hardsigmoid(inplace=True))

        def forward(self, x):
            return x * self.fc(x)

    class Bneck(nn.Module):
        def __init__(self, cin, k, exp, cout, se, hs, stride):
            super().__init__()
            act = nn.Hardswish if hs else nn.ReLU
            layers: list[nn.Module] = []
            if exp != cin:
                layers += [nn.Conv2d(cin, exp, 1, bias=False), nn.BatchNorm2d(exp), act(inplace=True)]
            layers += [nn.Conv2d(exp, exp, k, stride, k // 2, groups=exp, bias=False), nn.BatchNorm2d(exp),
                       act(inplace=True)]
            if se:
                layers.append(SE(exp))
            layers += [nn.Conv2d(exp, cout, 1, bias=False), nn.BatchNorm2d(cout)]
            self.block = nn.Sequential(*layers)
            self.res = stride == 1 and cin == cout

        def forward(self, x):
            y = self.block(x)
            return x + y if self.res else y

    table = ((3, 16, 16, 1, 0, 2), (3, 72, 24, 0, 0, 2), (3, 88, 24, 0, 0, 1), (5, 96, 40, 1, 1, 2),
             (5, 240, 40, 1, 1, 1), (5, 240, 40, 1, 1, 1), (5, 120, 48, 1, 1, 1), (5, 144, 48, 1, 1, 1),
             (5, 288, 96, 1, 1, 2), (5, 576, 96, 1, 1, 1), (5, 576, 96, 1, 1, 1))
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish(inplace=True)]
    cin = 16
    for k, exp, cout, se, hs, s in table:
        layers.append(Bneck(cin, k, exp, cout, se, hs, s))
        cin = cout
    layers += [nn.Conv2d(cin, 576, 1, bias=False), nn.BatchNorm2d(576), nn.Hardswish(inplace=True),
               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(576, 1024), nn.Hardswish(inplace=True),
               nn.Linear(1024, 10)]
    torch.manual_seed(0)
    return _image_train(nn.Sequential(*layers), 2 if quick else 4, 32 if quick else 64, 10)


def mamba(quick: bool):
    """Hugging Face MambaForCausalLM (its PyTorch path: no CUDA kernels), language-model loss."""
    import torch
    import transformers

    cfg = transformers.MambaConfig(vocab_size=256, hidden_size=32 if quick else 64, state_size=16,
                                   num_hidden_layers=2, expand=2, conv_kernel=4, use_cache=False)
    torch.manual_seed(0)
    x = _tokens(256, 2, 16 if quick else 32)
    return _train(transformers.MambaForCausalLM(cfg), (x,), lambda m, x: m(input_ids=x, labels=x).loss)


def mixtral(quick: bool):
    """Hugging Face MixtralForCausalLM, tiny (4 experts, top-2), language-model loss."""
    import torch
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=128, use_cache=False)
    torch.manual_seed(0)
    x = _tokens(256, 2, 16 if quick else 32)
    return _train(transformers.MixtralForCausalLM(cfg), (x,), lambda m, x: m(input_ids=x, labels=x).loss)


def lstm(quick: bool):
    """A two-layer nn.LSTM sequence classifier (the last step's hidden state), Adam."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(32, 64 if quick else 128, num_layers=2, batch_first=True)
            self.head = nn.Linear(64 if quick else 128, 10)

        def forward(self, x):
            out, _ = self.rnn(x)
            return self.head(out[:, -1])

    torch.manual_seed(0)
    batch, seq = (4, 8) if quick else (8, 32)
    x = torch.randn(batch, seq, 32, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(3))
    return _train(Net(), (x, y), lambda m, x, y: nn.functional.cross_entropy(m(x), y))


def _llama_generate(quick: bool, cache: str | None, dtype: Any = None, new: int | None = None):
    import torch
    import transformers

    new = new or (8 if quick else 16)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=max(128, 8 + new),
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    if dtype is not None:
        model = model.to(dtype)
    prompt = _tokens(256, 1, 8)
    kwargs: dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
    if cache:
        kwargs["cache_implementation"] = cache

    def make_step(m: Any, device: str):
        m = m.to(device)
        p = prompt.to(device)

        def step() -> list[int]:
            with torch.no_grad():
                return m.generate(p, attention_mask=torch.ones_like(p), **kwargs)[0].tolist()
        return step
    return model, make_step


def llama_generate_dynamic(quick: bool):
    """Hugging Face LlamaForCausalLM.generate(), greedy, its default dynamic cache."""
    return _llama_generate(quick, None)


def llama_generate_static(quick: bool):
    """The same with cache_implementation="static" (a preallocated cache updated in place)."""
    return _llama_generate(quick, "static")


def llama_generate_bf16(quick: bool):
    """The dynamic-cache generate() with the model in bfloat16, as LLMs are served."""
    import torch

    return _llama_generate(quick, None, torch.bfloat16)


def llama_generate_long(quick: bool):
    """The dynamic-cache generate() of 128 new tokens: each token's attention meets a key count
    no earlier token had, so the first step is a long generation's first run (a new shape for
    every op whose size follows the cache); later steps repeat it."""
    return _llama_generate(quick, None, new=32 if quick else 128)


def bert_infer(quick: bool):
    """Hugging Face BertForSequenceClassification, inference (no_grad), a batch of sequences."""
    import torch
    import transformers

    cfg = transformers.BertConfig(vocab_size=512, hidden_size=64 if quick else 128, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=256, max_position_embeddings=128,
                                  num_labels=3)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).eval()
    x = _tokens(512, 4 if quick else 8, 32 if quick else 64)

    def make_step(m: Any, device: str):
        m = m.to(device)
        xd = x.to(device)

        def step() -> list[float]:
            with torch.no_grad():
                return m(input_ids=xd).logits.cpu().flatten().tolist()
        return step
    return model, make_step


def vit_train(quick: bool):
    """Hugging Face ViTForImageClassification, cross-entropy, AdamW."""
    import torch
    import transformers

    cfg = transformers.ViTConfig(image_size=32, patch_size=4, hidden_size=64 if quick else 128, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=256, num_labels=10)
    torch.manual_seed(0)
    batch = 2 if quick else 8
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(3))
    return _train(transformers.ViTForImageClassification(cfg), (x, y),
                  lambda m, x, y: m(pixel_values=x, labels=y).loss)


PROGRAMS: dict[str, Callable[[bool], Any]] = {
    "nanogpt": nanogpt, "gpt2_train": gpt2_train, "resnet18": resnet18, "efficientnet_b0": efficientnet_b0,
    "mobilenetv3": mobilenetv3, "mamba": mamba, "mixtral": mixtral, "lstm": lstm,
    "llama_gen_dynamic": llama_generate_dynamic, "llama_gen_static": llama_generate_static,
    "llama_gen_bf16": llama_generate_bf16, "llama_gen_long": llama_generate_long,
    "bert_infer": bert_infer, "vit_train": vit_train,
}
QUICK = ("nanogpt", "lstm", "llama_gen_dynamic")


# ---- one program, in this process ---------------------------------------------------------------
def _same(a: Any, b: Any) -> float:
    """The largest relative difference between two step values (0.0: equal)."""
    if isinstance(a, list):
        if len(a) != len(b):
            return float("inf")
        return max([_same(x, y) for x, y in zip(a, b)] or [0.0])
    return abs(a - b) / max(abs(b), 1e-30)


def run_one(name: str, quick: bool, rounds: int, steps: int, split: bool) -> dict[str, Any]:
    import torch
    import torch_bridge

    torch.set_num_threads(1)
    torch.manual_seed(0)  # (the builders seed again where their model's order of draws needs it)
    model, make_step = PROGRAMS[name](quick)
    dev_model = copy.deepcopy(model)
    device = torch_bridge.runtime.runtime().device
    out: dict[str, Any] = {"name": name}
    cpu_step = make_step(model, "cpu")
    c0, t0 = time.process_time(), time.perf_counter()
    cpu_first_value = cpu_step()
    out["cpu_first"] = time.perf_counter() - t0
    out["cpu_first_cpu"] = time.process_time() - c0
    neu_step = make_step(dev_model, "neuron")
    values: list[Any] = []
    ticks: list[int] = []
    sim0 = device.simulated

    neu_cpu: list[float] = []

    def neuron_step() -> float:
        before = device.now()
        c, t = time.process_time(), time.perf_counter()
        values.append(neu_step())
        dt = time.perf_counter() - t
        neu_cpu.append(time.process_time() - c)
        ticks.append(device.now() - before)
        return dt

    prof = None
    if split:
        from torch_bridge.neuron import hostprof

        with hostprof.profile() as prof:
            out["neuron_first"] = neuron_step()
        out["split_first"] = prof.table(1, cpu_wall=out["cpu_first"])
    else:
        out["neuron_first"] = neuron_step()
    out["neuron_first_cpu"] = neu_cpu[0]
    out["kernels_first"] = device.simulated - sim0
    out["first_diff"] = _same(values[0], cpu_first_value)
    ratios, cpu_med, neu_med, cpu_ratios = [], [], [], []
    for _ in range(rounds):
        cpu_times, cpu_cpu = [], []
        for _ in range(steps):
            c, t = time.process_time(), time.perf_counter()
            cpu_step()
            cpu_times.append(time.perf_counter() - t)
            cpu_cpu.append(time.process_time() - c)
        del neu_cpu[:]
        if split:
            from torch_bridge.neuron import hostprof

            with hostprof.profile() as prof:
                neu_times = [neuron_step() for _ in range(steps)]
        else:
            neu_times = [neuron_step() for _ in range(steps)]
        c, n = statistics.median(cpu_times), statistics.median(neu_times)
        cpu_med.append(c)
        neu_med.append(n)
        ratios.append(n / c)
        cpu_ratios.append(statistics.median(neu_cpu) / max(statistics.median(cpu_cpu), 1e-9))
    out["cpu_time_ratio"] = statistics.median(cpu_ratios)  # process CPU time: steadier on a loaded machine
    out["cpu_step"] = statistics.median(cpu_med)
    out["neuron_step"] = statistics.median(neu_med)
    out["ratio"] = statistics.median(ratios)
    out["ratios"] = ratios
    out["kernels_steady"] = device.simulated - sim0 - out["kernels_first"]
    out["sim_us"] = statistics.median(ticks[1:]) * 1e6 / device.config.tick_hz if len(ticks) > 1 else 0.0
    out["values"] = values
    out["ticks"] = ticks
    if split and prof is not None:
        out["split_steady"] = prof.table(steps, cpu_wall=cpu_med[-1])
    return out


def _child(name: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--rounds", str(args.rounds),
           "--steps", str(args.steps)] + (["--quick"] if args.quick else []) + (["--split"] if args.split else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"name": name, "error": err}


def _first_ok(r: dict[str, Any], cpu_time: bool) -> bool:
    """The first-step goal: neuron's first step <= 3x CPU's + 2 s (wall, or process CPU time)."""
    if cpu_time:
        return r["neuron_first_cpu"] <= 3 * r["cpu_first_cpu"] + 2
    return r["neuron_first"] <= 3 * r["cpu_first"] + 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--programs", default=None, help=f"comma-separated, of: {', '.join(PROGRAMS)} (default: all)")
    p.add_argument("--quick", action="store_true", help=f"smaller configs, {', '.join(QUICK)}, one round of 2 steps")
    p.add_argument("--rounds", type=whole(1, 100), default=None, help="rounds of steps on CPU then neuron (default 3)")
    p.add_argument("--steps", type=whole(1, 1000), default=None, help="steps per round and device (default 5)")
    p.add_argument("--split", action="store_true", help="where the neuron wall time goes (torch_bridge.hostprof)")
    p.add_argument("--check-slow", action="store_true",
                   help="run each program again with TRNSIM_FASTPATH=0: values and ticks must be identical")
    p.add_argument("--warm", action="store_true",
                   help="run each program twice more with one on-disk cost cache: cold, then warm first steps")
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.steps = args.steps or (2 if args.quick else 5)
    if args.one:
        print(TAG + json.dumps(run_one(args.one, args.quick, args.rounds, args.steps, args.split)))
        return 0
    names = args.programs.split(",") if args.programs else (list(QUICK) if args.quick else list(PROGRAMS))
    bad = [n for n in names if n not in PROGRAMS]
    if bad:
        print(f"bench_zoo: error: unknown program {bad[0]!r}; expected one of {', '.join(PROGRAMS)}", file=sys.stderr)
        return 2
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("TRNSIM_COST_CACHE", None)  # (cold first steps; --warm names its own cache)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [q for q in env.get("PYTHONPATH", "").split(os.pathsep) if q])
    print(f"zoo: {len(names)} programs, each in a fresh process; {args.rounds} round(s) of {args.steps} steps "
          f"per device; ratios are neuron / CPU wall in the same process")
    print(f"  {'program':18s} {'CPU ms':>8s} {'neuron ms':>10s} {'ratio':>6s} {'rounds':>16s} "
          f"{'cpu-t x':>7s} {'CPU 1st s':>9s} {'neu 1st s':>9s} {'1st goal':>8s} {'1st cpu-t s':>13s} {'kernels':>7s} "
          f"{'sim us':>9s} "
          f"{'value diff':>10s}")
    results = []
    for name in names:
        r = _child(name, args, env)
        results.append(r)
        if "error" in r:
            print(f"  {name:18s} error: {r['error']}")
            continue
        goal = 3 * r["cpu_first"] + 2
        rs = ",".join(f"{x:.2f}" for x in r["ratios"])
        print(f"  {name:18s} {r['cpu_step'] * 1e3:8.1f} {r['neuron_step'] * 1e3:10.1f} {r['ratio']:5.2f}x {rs:>16s} "
              f"{r['cpu_time_ratio']:6.2f}x {r['cpu_first']:9.2f} {r['neuron_first']:9.2f} {'ok' if r['neuron_first'] <= goal else 'over':>8s} "
              f"{r['cpu_first_cpu']:5.2f}/{r['neuron_first_cpu']:5.2f}{'' if _first_ok(r, True) else '!':1s} "
              f"{r['kernels_first']:7d} {r['sim_us']:9.1f} {r['first_diff']:10.1e}", flush=True)
        if args.split:
            print(f"    -- first step --\n{r['split_first']}\n    -- steady steps --\n{r['split_steady']}", flush=True)
        if args.check_slow:
            slow = _child(name, args, dict(env, TRNSIM_FASTPATH="0"))
            same = "error" not in slow and slow["values"] == r["values"] and slow["ticks"] == r["ticks"]
            r["slow_same"] = same
            print(f"    fast path off: values and ticks {'identical' if same else 'DIFFER'}"
                  f" (neuron step {slow.get('neuron_step', float('nan')) * 1e3:.1f} ms)", flush=True)
        if args.warm:
            with tempfile.TemporaryDirectory(prefix="zoo-costs-") as d:
                runs = [_child(name, args, dict(env, TRNSIM_COST_CACHE=d)) for _ in range(2)]
            bad = next((x["error"] for x in runs if "error" in x), None)
            if bad is not None:
                r["warm_same"] = False
                print(f"    cost cache: error: {bad}", flush=True)
                continue
            same = all(x["values"] == r["values"] and x["ticks"] == r["ticks"] for x in runs)
            r["warm_same"], r["neuron_first_warm"], r["kernels_first_warm"] = same, runs[1]["neuron_first"], \
                runs[1]["kernels_first"]
            print(f"    cost cache: neuron first step {runs[0]['neuron_first']:.2f} s storing "
                  f"({runs[0]['kernels_first']} kernels simulated), {runs[1]['neuron_first']:.2f} s reading "
                  f"({runs[1]['kernels_first']} simulated); CPU's {r['cpu_first']:.2f} s; values and ticks "
                  f"{'identical' if same else 'DIFFER'}", flush=True)
    ok = [r for r in results if "error" not in r]
    if ok:
        ratios = [r["ratio"] for r in ok]
        firsts = sum(_first_ok(r, False) for r in ok)
        firsts_cpu = sum(_first_ok(r, True) for r in ok)
        print(f"median ratio {statistics.median(ratios):.2f}x (goal <= 1.3x; in process CPU time "
              f"{statistics.median(r['cpu_time_ratio'] for r in ok):.2f}x), worst {max(ratios):.2f}x "
              f"({max(ok, key=lambda r: r['ratio'])['name']}; goal <= 2x); "
              f"first step within 3x CPU + 2 s: {firsts}/{len(ok)} (in process CPU time: {firsts_cpu}/{len(ok)})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    failed = len(ok) < len(results) or any(r.get("slow_same") is False or r.get("warm_same") is False for r in ok)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
