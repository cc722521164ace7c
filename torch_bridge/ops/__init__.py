"""Whole-op kernels: attention, MoE, RNN cells, MX matmul and NKI kernels as torch ops."""
