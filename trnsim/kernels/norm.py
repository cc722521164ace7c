"""(being written) norm kernels."""
