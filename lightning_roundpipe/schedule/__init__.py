"""The plan: pure data and pure functions (no torch device code, no Lightning)."""

from lightning_roundpipe.schedule.dispatch import DISPATCH_RULES, DispatchPolicy
from lightning_roundpipe.schedule.ir import Action, ActionKind
from lightning_roundpipe.schedule.plan import ExecutionPlan, PlanValidationError, StageSpec, walk_in_order
from lightning_roundpipe.schedule.roundpipe import (
    OPTIMIZER_MODES,
    SteadyState,
    build_roundpipe_plan,
    build_stages,
    build_steady_state_plan,
    default_stage_ranges,
    plan_next_cursor,
)
from lightning_roundpipe.schedule.steady import OptimizerOp, SteadyStateProgram, lower_steady_state

__all__ = [
    "Action", "ActionKind", "ExecutionPlan", "PlanValidationError", "StageSpec", "walk_in_order",
    "build_roundpipe_plan", "build_stages", "default_stage_ranges", "plan_next_cursor",
    "OPTIMIZER_MODES", "OptimizerOp", "SteadyState", "SteadyStateProgram", "build_steady_state_plan", "lower_steady_state",
    "DISPATCH_RULES", "DispatchPolicy",
]
