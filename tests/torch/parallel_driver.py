"""A torchrun script for tests/torch/test_parallel_training.py: one process group, several
parallelisms in turn (each builds the GPT-2 of examples/train_gpt2_parallel.py afresh), every
mode's losses written by rank 0 to OUT.json.

    trnsim run --nproc 2 tests/torch/parallel_driver.py OUT.json STEPS MODE [MODE ...]
"""

import json
import pathlib
import sys

import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
from train_gpt2_parallel import train  # noqa: E402

out, steps, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
dist.init_process_group("neuron")
losses = {}
for mode in modes:
    name, _, flag = mode.partition("+")
    losses[mode] = train(name, steps, 8, 32, "neuron", sequence_parallel=flag == "sp")
if dist.get_rank() == 0:
    pathlib.Path(out).write_text(json.dumps(losses))
dist.destroy_process_group()
