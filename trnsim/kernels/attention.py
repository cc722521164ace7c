"""(being written) attention kernels."""
