"""The plan: pure data and pure functions (no torch device code, no Lightning)."""

from lightning_roundpipe.schedule.ir import Action, ActionKind
from lightning_roundpipe.schedule.plan import ExecutionPlan, PlanValidationError, StageSpec, walk_in_order
from lightning_roundpipe.schedule.roundpipe import (
    build_roundpipe_plan,
    build_stages,
    default_stage_ranges,
    plan_next_cursor,
)

__all__ = [
    "Action", "ActionKind", "ExecutionPlan", "PlanValidationError", "StageSpec", "walk_in_order",
    "build_roundpipe_plan", "build_stages", "default_stage_ranges", "plan_next_cursor",
]
