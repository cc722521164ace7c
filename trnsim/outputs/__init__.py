"""What a run leaves for a user: Perfetto traces (:mod:`.trace`, :mod:`.run_trace`), metrics
tables (:mod:`.metrics`), plots (:mod:`.plot`), and the careful file writing they all use
(:mod:`.files`). Reads reports; simulates nothing."""
