"""Cost models: what a step costs, priced alike by the simulator and the executor (the
`CostModel` protocol of `rlsched.policies.types`). Never imports sim/, analysis/, the executor
or torch.

- `roofline`: the analytic roofline of a model on a hardware type (`RooflineCostModel`)
- `measured`: interpolation over a profile's measured grid (`MeasuredCostModel`)
- `costfile`: the fitted forms, the versioned cost-model file and its model (`FittedCostModel`)
- `fit`: fitting those forms to profiles and run traces (`rlsched fit`)
- `choose`: the cost model a config runs on (`cost_model_for`)

The names below load their module on first use, so that importing the package (or the
roofline alone, as the simulator does) does not load scipy's optimizers.
"""

from __future__ import annotations

import importlib

_HOME = {
    "RooflineCostModel": "roofline",
    "MeasuredCostModel": "measured",
    "FittedCostModel": "costfile",
    "load_cost_model": "costfile",
    "read_cost_file": "costfile",
    "FitResult": "fit",
    "OpFit": "fit",
    "fit_path": "fit",
    "fit_records": "fit",
    "cost_model_for": "choose",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__():
    return sorted(set(globals()) | set(_HOME))
