"""(being written) embedding kernels."""
