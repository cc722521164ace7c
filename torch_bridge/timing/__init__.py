"""Timing-only runs: fake-tensor execution (:mod:`.fake`), parallel plans on one process
(:mod:`.parallel`), whole-system estimates (:mod:`.estimate`) and weightless models (:mod:`.models`)."""
