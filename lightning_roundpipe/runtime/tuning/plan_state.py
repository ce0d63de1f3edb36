"""What a checkpoint keeps of an engine's automatic choice, so a resumed run goes on with the plan
the straight run would have (no Lightning here; the strategy stores it under the checkpoint key
:data:`CHECKPOINT_KEY`).

The automatic choice is made after the profiled steps (DESIGN.md section 6). A run resumed from a
checkpoint would otherwise profile again from its first step, run its first steps on the simple
partition and choose later than the straight run, and, where the choice cuts the batch into more
microbatches (``balance_microbatches``), sum its gradients in another order: the resumed parameters
would differ from the straight run's in the last bits. The state is plain Python values (ints,
floats, lists, dicts, strings), so the checkpoint still loads without this package and under
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_roundpipe.partition.profile import LayerProfile
from lightning_roundpipe.partition.types import PartitionPlan
from lightning_roundpipe.runtime.tuning.autopartition import PlanChoice, describe_rounds
from lightning_roundpipe.runtime.tuning.mixed import set_dispatch_rule

CHECKPOINT_KEY = "roundpipe_plan"
"""The checkpoint's key for :func:`plan_state`."""

_VERSION = 1


def _ranges(stages) -> list[list[int]]:
    return [[r.start, r.stop] for r in stages]


def _settings(engine: Any) -> dict[str, Any]:
    """What the choice was made for: a resumed run with other settings makes its own."""
    from lightning_roundpipe.runtime.replay.rng import rng_layers

    return {"num_layers": len(engine.seq), "num_devices": len(engine.backends),
            "num_microbatches": engine.num_microbatches, "balance_microbatches": engine.balance_microbatches,
            "microbatches_per_round": engine.microbatches_per_round if engine.rounds_pinned else None,
            "fused_loss": engine.fused_loss, "random_layers": sorted(rng_layers(engine.seq)),
            "stage_memory_bytes": engine.stage_memory_bytes, "cpu_link_bytes_per_s": engine.cpu_link_bytes_per_s}


_SETTING_NAMES = {"num_layers": "the model's layers", "num_devices": "`devices`", "random_layers": "the random (dropout) layers",
                  "fused_loss": "`fused_loss`", "stage_memory_bytes": "the stage memory budget (`device_memory_bytes`)"}
"""How the restore line names a changed setting (the others are the strategy's own keywords)."""


def plan_state(engine: Any) -> dict[str, Any] | None:
    """The engine's profiling progress and automatic choice, as plain values; ``None`` when it
    neither profiles nor chooses (nothing to keep)."""
    profiler = engine.executor.profiler
    if profiler is None and engine.plan_choice is None:
        return None
    state: dict[str, Any] = {
        "version": _VERSION, "settings": _settings(engine),
        "last_call": list(engine._last_call) if engine._last_call is not None else None,
        "last_sizes": list(engine._last_sizes), "profiled_rows": engine._profiled_rows,
        "measured_profiles": (None if engine.measured_profiles is None
                              else [dataclasses.asdict(p) for p in engine.measured_profiles]),
        # devices of unequal speed (mixed.py): the measured relative speeds, measured once per run
        "device_speeds": None if getattr(engine, "device_speeds", None) is None else list(engine.device_speeds),
        "device_speeds_source": getattr(engine, "device_speeds_source", None),
    }
    if profiler is not None:
        state["profiler"] = {"steps_seen": profiler.steps_seen, "enabled": profiler.enabled,
                             "avg": {k: None if v is None else list(v) for k, v in profiler.avg.items()},
                             "activation_bytes": {str(i): n for i, n in profiler._activation_bytes.items()}}
    choice = engine.plan_choice
    if choice is not None:
        state["choice"] = {"forward_stages": _ranges(choice.partition.forward_stages),
                           "backward_stages": _ranges(choice.partition.backward_stages),
                           "objective_s": choice.partition.objective_s,
                           "microbatches_per_round": choice.microbatches_per_round,
                           "simulated_s": choice.simulated_s, "num_microbatches": choice.num_microbatches,
                           "dispatch_rule": choice.dispatch_rule}
    return state


def restore_plan_state(engine: Any, state: dict[str, Any] | None) -> bool:
    """Go on from ``state`` (:func:`plan_state` of the run that saved the checkpoint): the profiling
    progress, the measured profiles and, with the automatic partition on, the choice (stages, rounds,
    the cut of the batch). Kept only when this engine profiles and for the same settings: layers,
    devices, ``num_microbatches``, ``balance_microbatches``, your ``microbatches_per_round``, the
    fused loss, the random layers, the memory budget and the modelled link; otherwise the engine
    reports which differ and profiles again.

    Returns:
        Whether the state was applied.
    """
    if not state or engine.executor.profiler is None:
        return False
    now, saved_settings = _settings(engine), state.get("settings") or {}
    changed = [k for k in now if saved_settings.get(k, object()) != now[k]]
    if state.get("version") != _VERSION or changed:
        names = [_SETTING_NAMES.get(k, f"`{k}`") for k in changed]
        engine.info(f"RoundPipe: the checkpoint's automatic plan was made for other settings"
                    f" ({', '.join(names) or 'another version'}); this run profiles again.")
        return False
    profiler = engine.executor.profiler
    saved = state.get("profiler") or {}
    profiler.steps_seen = int(saved.get("steps_seen", 0))
    profiler.enabled = bool(saved.get("enabled", True))
    profiler.avg = {k: None if v is None else [float(x) for x in v] for k, v in saved.get("avg", profiler.avg).items()}
    profiler._activation_bytes = {int(i): int(n) for i, n in saved.get("activation_bytes", {}).items()}
    engine._last_call = tuple(state["last_call"]) if state.get("last_call") else None
    engine._last_sizes = [int(n) for n in state.get("last_sizes", [])]
    engine._profiled_rows = state.get("profiled_rows")
    if state.get("measured_profiles") is not None:
        engine.measured_profiles = [LayerProfile(**p) for p in state["measured_profiles"]]
    if state.get("device_speeds_source") == "measured" and profiler.steps_seen >= profiler.skip_steps:
        speeds = state.get("device_speeds")  # the probe ran in the saved run; it runs once, after the warm-up step
        engine.device_speeds = None if speeds is None else tuple(float(s) for s in speeds)
        engine.device_speeds_source = "measured"
        profiler.device_speeds = None if speeds is None else list(engine.device_speeds)
    choice = state.get("choice")
    if choice is not None and engine.auto_partition_after_steps is not None:
        partition = PartitionPlan(tuple(range(*r) for r in choice["forward_stages"]),
                                  tuple(range(*r) for r in choice["backward_stages"]), choice.get("objective_s"))
        engine.plan_choice = PlanChoice(partition, choice["microbatches_per_round"], choice.get("simulated_s"),
                                        choice.get("num_microbatches"), choice.get("dispatch_rule", "round_robin"))
        if getattr(engine, "dispatch_mode", "auto") == "auto":  # a rule set by the user stays
            set_dispatch_rule(engine, engine.plan_choice.dispatch_rule)
        engine.set_partition(partition, choice["microbatches_per_round"])
        engine.split_num_microbatches = choice.get("num_microbatches")
        cut = (f", the batch cut into {engine.split_num_microbatches} microbatches instead of"
               f" {engine.num_microbatches}" if engine.split_num_microbatches else "")
        engine.info(f"RoundPipe: resumed with the checkpoint's automatic plan ({len(engine.fused_stages)} stage(s) as run,"
                    f" {describe_rounds(engine.microbatches_per_round, engine.split_num_microbatches or engine.num_microbatches)}"
                    f"{cut}); nothing is profiled again.")
    return True
