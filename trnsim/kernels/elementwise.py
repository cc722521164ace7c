"""(being written) elementwise kernels."""
