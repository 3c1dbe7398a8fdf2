"""A discrete-event simulator of rollouts: engines (a cost model) x rollout modes x response lengths, e.g.
`simulate(SimConfig(...), cost, LogNormalLengths(4096, 0.8, 16384))`. `tools/simulate_rollout.py` is its command
line; `planner.py` uses it for `--over-sampling-batch-size auto`."""

from slime.rollout.simulator.cost_model import EngineCostModel
from slime.rollout.simulator.lengths import (EmpiricalLengths, LogNormalLengths, ParetoLengths, ReplayLengths,
                                             kaplan_meier, lengths_from_run)
from slime.rollout.simulator.simulate import SimConfig, SimResult, simulate

__all__ = ["EngineCostModel", "SimConfig", "SimResult", "simulate", "EmpiricalLengths", "LogNormalLengths",
           "ParetoLengths", "ReplayLengths", "kaplan_meier", "lengths_from_run"]
