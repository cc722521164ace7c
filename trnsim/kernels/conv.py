"""(being written) conv kernels."""
