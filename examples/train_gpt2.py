"""Train a small GPT-2 on the virtual Trainium, then see where the chip's time went.

An ordinary PyTorch + Hugging Face training loop; the one line that makes it run on the virtual
chip is ``model.to("neuron")`` (and the batches' ``.to(device)``). The model is built from a
small config (no download), the text is a fixed corpus repeated, read as bytes (vocabulary 256),
so the loss visibly falls within a few dozen AdamW steps. Every op runs on the `neuron` device:
matmul values come from the TensorE datapath, every op's time from the simulator; the run report
at the end lists per op the simulated time, engine use, HBM traffic and MFU.

    python examples/train_gpt2.py [--steps 40] [--config trn2] [--batch 8] [--seq 64]
    trnsim run examples/train_gpt2.py --no-report --config trn3   # trnsim prints the report
"""

from __future__ import annotations

import argparse
from typing import Callable, Iterator, Sequence

import torch
import transformers

CORPUS = (
    "The tensor engine multiplies, the vector engine reduces, the scalar engine applies "
    "activations, and the DMA queues move tiles between HBM and SBUF. Partial sums stay in "
    "PSUM until the last matmul of the group. "
)
VOCAB = 256  # bytes


def make_model(seq: int, layers: int = 2, embd: int = 64, heads: int = 4) -> transformers.GPT2LMHeadModel:
    """A GPT-2 with ``layers`` blocks of width ``embd`` over byte tokens; dropout off so the
    loss curve depends on the data order only."""
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=seq, n_embd=embd, n_layer=layers, n_head=heads,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # next-token cross-entropy (named, so transformers need not guess and warn)
    return model


def batches(batch: int, seq: int, steps: int, seed: int = 0) -> Iterator[torch.Tensor]:
    """``steps`` batches of ``seq``-byte windows at random offsets into the repeated corpus."""
    text = (CORPUS * (2 + (seq * 4) // len(CORPUS))).encode()
    data = torch.tensor(list(text), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq, (batch,), generator=gen)
        yield torch.stack([data[s:s + seq] for s in starts.tolist()])


def train(steps: int = 40, batch: int = 8, seq: int = 64, device: str = "neuron", log_every: int = 5,
          log: Callable[[str], None] = print) -> list[float]:
    """Train from a fixed seed for ``steps`` AdamW steps on ``device``; returns the losses."""
    torch.manual_seed(0)
    model = make_model(seq).to(device)  # the one-line change: everything after runs on the chip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step, x in enumerate(batches(batch, seq, steps), start=1):
        x = x.to(device)
        loss = model(x, labels=x).loss  # GPT-2 shifts the labels itself: next-byte prediction
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % log_every == 0 or step in (1, steps):
            log(f"step {step:>4}  loss {losses[-1]:.4f}")
    return losses


def use_config(name: str | None) -> str:
    """Choose the chip before the first neuron tensor; under ``trnsim run`` it is already chosen
    (by its ``--config``), and asking for a different one here is an error."""
    if name is not None:
        if not torch.neuron.is_initialized():
            torch.neuron.set_config(name)
        elif torch.neuron.config().name != name:
            raise SystemExit(f"train_gpt2.py: --config {name}: the neuron device already runs "
                             f"{torch.neuron.config().name} (choose the chip with trnsim run's --config)")
    return torch.neuron.config().name


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="AdamW steps (default 40)")
    p.add_argument("--config", default=None, help="chip config name or YAML path (default: TRNSIM_CONFIG or trn2)")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch (default 8)")
    p.add_argument("--seq", type=int, default=64, help="bytes per sequence (default 64)")
    p.add_argument("--no-report", action="store_true", help="skip the run report (trnsim run prints its own)")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    scores = args.batch * 4 * args.seq * args.seq * 4  # each block's attention scores, fp32, 4 heads
    if scores > 1 << 30:
        p.error(f"--batch {args.batch} --seq {args.seq}: the attention scores take {scores / 2**30:.1f} GiB a block; "
                f"expected at most 1 GiB (batch x seq^2 up to {(1 << 30) // 16:,})")
    config = use_config(args.config)
    torch.neuron.reset_report()
    print(f"GPT-2 (2 layers, width 64, 4 heads, byte vocabulary) on neuron ({config}): "
          f"{args.steps} AdamW steps, batch {args.batch} x {args.seq} bytes")
    train(args.steps, args.batch, args.seq)
    if not args.no_report:
        from trnsim.cli import print_run_report

        print_run_report(torch.neuron.report(), f"train_gpt2.py on {config}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
