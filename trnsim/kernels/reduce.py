"""(being written) reduce kernels."""
