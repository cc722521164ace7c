"""What a run leaves for a user: Perfetto traces (:mod:`.trace`, :mod:`.run_trace`) and plots
(:mod:`.plot`). Reads reports; simulates nothing. The metrics tables a report writes itself
(:mod:`trnsim.sim.metrics`, ``to_parquet``) sit beside the reports, and the careful file writing
every output uses (:mod:`trnsim.config.files`) beside the careful file reading of the configs."""
