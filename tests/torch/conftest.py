"""Tests of the `neuron` PyTorch device. Skipped as a whole when torch is not installed
(trnsim itself needs no torch); `pip install -e '.[test]'` installs it."""

import importlib.util

HAVE_TORCH = importlib.util.find_spec("torch") is not None
collect_ignore_glob = [] if HAVE_TORCH else ["test_*.py"]

if HAVE_TORCH:
    import torch_bridge  # noqa: F401  (registers the device even where autoload is turned off)
