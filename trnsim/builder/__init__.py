"""The kernel builder: :class:`~trnsim.builder.kernel.Kernel` (allocation, the op builders and
their rule checks, the dependency trackers, replay templates, tile pools). Below the simulator:
it makes an instruction stream and runs nothing."""
