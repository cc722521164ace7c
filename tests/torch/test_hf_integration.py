"""Hugging Face Trainer and accelerate on the neuron device, through the hooks they offer.

Both detect a ``neuron`` device only through AWS's ``torch_neuronx`` package; otherwise they use
the device named by ``ACCELERATE_TORCH_DEVICE`` (``trnsim run`` sets it to ``neuron`` for the
script). ``device_map="neuron"`` loads a model straight onto the device (``"auto"`` knows only
the accelerators accelerate lists, and picks CPU).
"""

import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


def _tiny() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                      bos_token_id=0, eos_token_id=0))


def test_trainer_trains_on_neuron(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "neuron")
    model = _tiny()
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to=[],
                             save_strategy="no", disable_tqdm=True)  # dataloader_pin_memory is on by default
    assert args.device == torch.device("neuron")
    with torch.neuron.report_scope() as scope:
        result = Trainer(model=model, args=args, train_dataset=_Tokens()).train()
    assert result.training_loss > 0 and next(model.parameters()).device.type == "neuron"
    assert model.lm_head.weight is model.transformer.wte.weight  # tied weights stay tied
    assert scope.report.matmul_flops > 0


def test_device_map_loads_onto_neuron(tmp_path):
    _tiny().save_pretrained(tmp_path)
    model = GPT2LMHeadModel.from_pretrained(tmp_path, device_map="neuron:1")
    assert next(model.parameters()).device == torch.device("neuron", 1)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_trnsim_run_picks_neuron_for_the_trainer(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        from transformers import TrainingArguments
        print("device", TrainingArguments("out", report_to=[]).device)
    """))
    out = subprocess.run([sys.executable, "-m", "trnsim.cli", "run", str(script)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "device neuron" in out.stdout
