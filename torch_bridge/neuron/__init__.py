"""The ``torch.neuron`` module (:mod:`.module`), its profiler hooks (:mod:`.profiler`) and
random generators (:mod:`.generators`), as PyTorch's OpenReg backend keeps its ``openreg/``."""
