"""Built-in kernels written with the public builder API."""
