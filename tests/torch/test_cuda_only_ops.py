"""Ops PyTorch implements only for CUDA that the neuron device provides (torch_bridge/cells.py)."""

import copy

import pytest
import torch
from torch import nn


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("bias", [True, False])
def test_recurrent_layers_match_cpu_forward_and_backward(cls, bias):
    torch.manual_seed(0)
    cpu = cls(4, 6, num_layers=2, bias=bias, batch_first=True, bidirectional=True)
    dev = copy.deepcopy(cpu).to("neuron")
    x = torch.randn(3, 5, 4)
    out_c, _ = cpu(x)
    out_n, _ = dev(x.to("neuron"))
    torch.testing.assert_close(out_n.cpu(), out_c, rtol=1e-5, atol=1e-6)
    out_c.square().sum().backward()
    out_n.square().sum().backward()
    for (name, a), b in zip(dev.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_lstm_cell_and_gru_cell_modules():
    torch.manual_seed(1)
    for cell in (nn.LSTMCell(3, 5), nn.GRUCell(3, 5)):
        dev = copy.deepcopy(cell).to("neuron")
        x = torch.randn(2, 3)
        want = cell(x)
        got = dev(x.to("neuron"))
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-6)


def test_lstm_bf16_runs_in_fp32_inside():
    torch.manual_seed(2)
    cpu = nn.LSTM(8, 8)
    dev = copy.deepcopy(cpu).to("neuron", torch.bfloat16)
    x = torch.randn(4, 2, 8)
    out = dev(x.to("neuron", torch.bfloat16))[0]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), cpu(x)[0], rtol=0.05, atol=0.02)


def test_integer_histc_counts_like_cuda():
    x = torch.tensor([0, 1, 1, 3, 7, -1], device="neuron")
    h = torch.histc(x, bins=4, min=0, max=3)
    assert h.dtype == torch.int64 and h.device.type == "neuron" and h.cpu().tolist() == [1, 2, 0, 1]
    # min == max: the data's range; the top edge falls in the last bin
    assert torch.histc(torch.tensor([2, 2, 5], dtype=torch.int32, device="neuron"), bins=3).cpu().tolist() == [2, 0, 1]
    # float histc is CPU's
    assert torch.histc(torch.tensor([0.5, 2.5], device="neuron"), 3, 0, 3).cpu().tolist() == [1.0, 0.0, 1.0]


def test_integer_histc_near_int64s_limits_bins_exactly():
    """CUDA's integer arithmetic without its wrap-around (found by difftest): int64's max alone
    widens its range past int64 (it was counted nowhere); 2**62 alone sits in the middle bin
    (a float64 histogram puts it one bin lower); a range of int64's width times the bins would
    wrap (it put every value in the last bin but one)."""
    def hist(values, bins, lo=0, hi=0):
        return torch.histc(torch.tensor(values, device="neuron"), bins, lo, hi).cpu().tolist()
    assert hist([2 ** 63 - 1], 3) == [0, 1, 0]
    assert hist([-2 ** 63], 6) == [0, 0, 0, 1, 0, 0]
    assert hist([2 ** 62], 6) == [0, 0, 0, 1, 0, 0]
    assert hist([-2 ** 63, 0, 2 ** 63 - 1], 4) == [1, 0, 1, 1]


def test_mixtral_style_expert_counts():
    # transformers' Mixtral routing: torch.histc(selected_experts, bins=num_experts, min=0, max=num_experts - 1)
    experts = torch.tensor([[0, 3], [3, 1], [2, 3]], device="neuron")
    assert torch.histc(experts, bins=4, min=0, max=3).cpu().tolist() == [1, 1, 1, 3]
