"""What an estimate runs, as data (torch-free): model configs (:mod:`.models`), parallelism
plans, the pipeline schedule and the estimate results (:mod:`.plan`). Below ``torch_bridge``,
which runs them; the ``trnsim estimate`` command (:mod:`trnsim.cli.estimate`) is above it."""
