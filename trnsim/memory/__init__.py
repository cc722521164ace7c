"""On-chip and device memory: allocation, capacity, DMA and bandwidth."""
