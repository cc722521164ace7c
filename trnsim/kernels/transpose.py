"""(being written) transpose kernels."""
