"""The cost model a config runs on."""

from __future__ import annotations

from rlsched.config import SimConfig
from rlsched.costs.roofline import RooflineCostModel


def cost_model_for(cfg: SimConfig):
    """The cost model a config runs on: the analytic roofline of its hardware and model, or,
    with `cost_file`, the fitted file's step costs (verify, draft, prefill) with KV capacity
    and KV transfer still from the roofline (a profile does not measure them)."""
    roofline = RooflineCostModel.from_config(cfg)
    if cfg.cost_file is None:
        return roofline
    from rlsched.costs.costfile import load_cost_model  # scipy and pandas only when a file is given

    return load_cost_model(cfg.cost_file, base=roofline, drafters=[d.name for d in cfg.drafters])
