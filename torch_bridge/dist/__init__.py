"""The distributed backend: the c10d process group, its simulated-clock exchange, P2P and the
FSDP patch (:mod:`.process_group`), and the ``trnsim run --nproc`` launcher (:mod:`.launch`)."""
