"""``trnsim validate``: the validation ledger run against the model (an app: it may import
torch_bridge, lazily, for the ``estimate`` rows).

The ledger's rows are data (:mod:`trnsim.ledger`, ``validation/*.yaml``); this package predicts
them (:mod:`.predictors`, :mod:`.probes`), summarises the error by category and role and guards
against drift (:mod:`.run`); the ``trnsim validate`` command is :mod:`trnsim.cli.validate`::

    from trnsim.validate import load_ledger, run_rows, summarize
    results = run_rows(load_ledger().select(["kernels"], quick=True))
"""

from ..config.ledger import Ledger, LedgerError, Row, load_ledger
from .predictors import PREDICTORS, PredictionError, predict
from .run import EXPECTED, Result, Summary, check_drift, expected_text, load_expected, run_rows, summarize

__all__ = ["Ledger", "LedgerError", "Row", "load_ledger", "PREDICTORS", "PredictionError", "predict", "EXPECTED",
           "Result", "Summary", "check_drift", "expected_text", "load_expected", "run_rows", "summarize"]
