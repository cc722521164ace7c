"""Attention in compiled graphs (placeholder until the attention op lands)."""

from __future__ import annotations

import torch.fx as fx


def use_attention_op(gm: fx.GraphModule) -> None:
    return None
