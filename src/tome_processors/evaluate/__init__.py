"""`tome-processors eval`: quality against speed on real prompts (`engine`), written out by `report`;
`run` is one whole run (`run_evaluation(EvalRequest(...))`).

Nothing in the library imports this package.
"""

from .engine import EvalConfig, EvalRow, EvalSettings, run_eval

__all__ = ["EvalConfig", "EvalRow", "EvalSettings", "run_eval"]
