"""Eager mechanisms of the neuron device: values (:mod:`.values`), allocation (:mod:`.alloc`),
device memory (:mod:`.memory`), lowering to kernel specs (:mod:`.lowering`), TensorE values
(:mod:`.tensore`), the C++ fast path's Python side (:mod:`.fastpath`), autocast (:mod:`.autocast`)."""
