"""The same ExecutionPlan driven by a cost model instead of devices (pure: no torch, no Lightning).

- :func:`simulate`: lower a plan to its stream program and time one iteration (or the steady
  state) from per-layer profiles; returns a :class:`SimulationResult` holding a
  :class:`~lightning_roundpipe.metrics.Timeline`.
- :func:`simulate_program`: time a :class:`~lightning_roundpipe.schedule.program.StreamProgram`
  (the lists the runtime executes) directly.
- :func:`simulate_training` (:mod:`lightning_roundpipe.simulate.steady`): the run's own optimizer
  mode, K iterations plus the host's ``OPT`` op per optimizer step (DESIGN.md section 11);
  :func:`choose_for_mode` picks the fastest candidate partition in a mode.
- Baseline plans with weight binding (GPipe, 1F1B, interleaved 1F1B, looped BFS, ZB-H1), re-exported
  from :mod:`lightning_roundpipe.schedule.baselines`.
- :mod:`lightning_roundpipe.simulate.table`: the paper's bubble table from a layer-timings CSV
  (``roundpipe simulate``).
- :func:`paper_data_path`: the paper's reference tables shipped with the package
  (``lightning_roundpipe/simulate/data/``; ``roundpipe simulate --layer-timings paper``).
"""

from lightning_roundpipe.schedule.baselines import (
    BASELINE_BUILDERS,
    balanced_stage_layers,
    bound_stages,
    build_1f1b_plan,
    build_baseline_plan,
    build_gpipe_plan,
    build_interleaved_1f1b_plan,
    build_looped_bfs_plan,
    build_zb_h1_plan,
    megatron_stage_layers,
)
from lightning_roundpipe.simulate.engine import SimulationResult, simulate, simulate_program
from lightning_roundpipe.simulate.paper_data import PAPER_DATA_DIR, PAPER_DATA_FILES, paper_data_path
from lightning_roundpipe.simulate.steady import (
    ModeChoice,
    TrainingPrediction,
    choose_for_mode,
    optimizer_step_s,
    simulate_steady_program,
    simulate_training,
)
from lightning_roundpipe.simulate.table import (
    SCHEDULES,
    ModelTimings,
    bubble_table,
    build_schedule_plan,
    format_table,
    layer_profiles,
    read_layer_timings,
    simulate_schedule,
)

__all__ = [
    "BASELINE_BUILDERS", "ModelTimings", "PAPER_DATA_DIR", "PAPER_DATA_FILES", "SCHEDULES", "SimulationResult", "balanced_stage_layers", "bound_stages",
    "bubble_table", "build_1f1b_plan", "build_baseline_plan", "build_gpipe_plan", "build_interleaved_1f1b_plan",
    "build_looped_bfs_plan", "build_schedule_plan", "build_zb_h1_plan", "format_table", "layer_profiles",
    "megatron_stage_layers", "paper_data_path", "read_layer_timings", "simulate", "simulate_program", "simulate_schedule",
    "ModeChoice", "TrainingPrediction", "choose_for_mode", "optimizer_step_s", "simulate_steady_program", "simulate_training",
]
