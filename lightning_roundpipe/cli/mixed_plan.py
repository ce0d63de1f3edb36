"""`roundpipe plan --devices 4090,4090,3090,3060`: a plan for mixed devices, both dispatch rules.

RoundPipe's devices are stateless, so devices of unequal speed and memory can share one pipeline
(DESIGN.md section 12). Given a device list (known GPUs by name, :data:`~lightning_roundpipe.partition.devices.KNOWN_GPUS`,
or ``TFLOP/s:GiB`` pairs), this plans the model twice and prints both predictions side by side:

- **round robin** (the paper's dispatch): stage ``k`` on device ``k mod D``; every stage must fit
  the smallest device's per-stage budget (half its memory), and the slowest device sets the pace;
- **weighted**: each stage to the device that would finish it first given its speed and load
  (:mod:`~lightning_roundpipe.schedule.dispatch`), only on devices whose budget holds it, so
  faster devices take more stages and larger ones may take larger stages.

Layer costs come from the cost model on the fastest device (``--tflops`` of the list's fastest
entry); a device of relative speed ``s`` runs a stage in its cost over ``s``. For each rule the
candidate partitions (with one round or rounds of D microbatches) are timed by the simulator in
the run's optimizer mode (``--optimizer``) and the fastest is shown. Pure: no torch, no weights.
"""

from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass

from lightning_roundpipe.cli.plan_args import (MAX_TFLOPS, _truncated_grid, model_param_counts,  # noqa: F401
                                               parse_devices, plan_inputs)
from lightning_roundpipe.partition.candidates import candidate_partitions
from lightning_roundpipe.partition.costmodel import ModelledProfiles
from lightning_roundpipe.partition.devices import GpuSpec, MixedDevices, relative_speeds
from lightning_roundpipe.partition.profile import HardwareModel, optimizer_step_bytes
from lightning_roundpipe.schedule import ExecutionPlan, build_roundpipe_plan
from lightning_roundpipe.schedule.dispatch import DISPATCH_RULES

__all__ = ["MixedPlanReport", "RulePlan", "format_mixed_report", "make_mixed_report", "parse_devices"]

GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class RulePlan:
    """One dispatch rule's plan and prediction.

    Attributes:
        rule: ``"round_robin"`` or ``"weighted"``.
        choice: the simulator's pick among the candidates
            (:class:`~lightning_roundpipe.simulate.steady.ModeChoice`); ``None`` when no candidate fits.
        execution_plan: the plan of ``choice`` (``None`` likewise).
        stage_counts: stages per device in one step.
        note: why there is no plan, else ``""``.
    """

    rule: str
    choice: object | None
    execution_plan: ExecutionPlan | None
    stage_counts: tuple[int, ...] = ()
    note: str = ""

    @property
    def step_s(self) -> float:
        return math.inf if self.choice is None else self.choice.prediction.step_s


@dataclass(frozen=True, kw_only=True)
class MixedPlanReport:
    """Everything the mixed-device plan prints, as data (tests read this)."""

    modelled: ModelledProfiles
    hardware: HardwareModel
    """The fastest device's model (layer costs are its)."""
    devices: tuple[GpuSpec, ...]
    mixed: MixedDevices
    num_microbatches: int
    optimizer: str
    optimizer_bytes: int
    rules: dict
    """``rule -> RulePlan`` for both rules, round robin first."""

    @property
    def tokens_per_step(self) -> int:
        return self.num_microbatches * self.modelled.tokens_per_microbatch

    def tokens_per_s(self, rule: str) -> float:
        return self.tokens_per_step / self.rules[rule].step_s

    @property
    def faster(self) -> str:
        """The rule with the shorter predicted step (ties: the round robin)."""
        plain, weighted = self.rules["round_robin"], self.rules["weighted"]
        return "weighted" if weighted.step_s < plain.step_s else "round_robin"


def make_mixed_report(args: argparse.Namespace, devices: tuple[GpuSpec, ...]) -> MixedPlanReport:
    """Plan ``devices`` with both dispatch rules from parsed `roundpipe plan` arguments (``--tflops``
    and ``--device-memory-gib`` come from the list).

    Raises:
        ValueError: a bad argument (as `roundpipe plan`); ``--tflops``, ``--device-memory-gib`` or
            ``--stage-memory-gib`` with a device list; or a layer that fits no device.
    """
    from lightning_roundpipe.simulate.steady import choose_for_mode, partition_stages

    for flag in ("--tflops", "--device-memory-gib", "--stage-memory-gib"):
        if getattr(args, flag[2:].replace("-", "_"), None) is not None:
            raise ValueError(f"`{flag}` sets one value for equal devices; with a device list each device's TFLOP/s and"
                             " memory come from the list (its per-stage budget: half its memory). HINT: drop"
                             f" `{flag}`, or give the device as `TFLOPS:GiB` in the list (e.g. `--devices"
                             " 330:24,142:24`).")
    fastest = max(devices, key=lambda d: d.bf16_flops_per_s)
    base = copy.copy(args)
    base.devices = len(devices)
    base.tflops = fastest.bf16_flops_per_s / 1e12
    base.device_memory_gib = max(d.memory_bytes for d in devices) / GiB
    base.stage_memory_gib = None
    given = plan_inputs(base)
    D, M = given.num_devices, given.num_microbatches
    mp = given.modelled(args.seq_len, args.microbatch_size, args.dtype_bytes)
    budgets = tuple(d.memory_bytes // 2 for d in devices)
    mixed = MixedDevices(relative_speeds([d.bf16_flops_per_s for d in devices]), budgets,
                         saved_activation_bytes=mp.saved_activation_bytes)
    optimizer_bytes = optimizer_step_bytes(model_param_counts(mp)[1])
    rounds = [None] + ([D] if M > D > 1 else [])
    rules = {}
    for rule in DISPATCH_RULES:
        budget = min(budgets) if rule == "round_robin" else max(budgets)
        try:
            candidates = candidate_partitions(mp.profiles, D, budget, saved_activation_bytes=mp.saved_activation_bytes)
            if rule == "weighted":  # also the round robin's partitions (each fits every device)
                keys = {(p.forward_stages, p.backward_stages) for _, p in candidates}
                candidates += [(label, p) for label, p in candidate_partitions(
                    mp.profiles, D, min(budgets), saved_activation_bytes=mp.saved_activation_bytes)
                    if (p.forward_stages, p.backward_stages) not in keys]
            choice = choose_for_mode(candidates, mp.profiles, given.hardware, D, M, optimizer=given.optimizer,
                                     optimizer_bytes=optimizer_bytes, round_options=rounds,
                                     accumulate_grad_batches=given.accumulate_grad_batches, devices=mixed,
                                     dispatch_rule=rule)
        except ValueError as error:  # a layer no device (round robin: the smallest) holds
            rules[rule] = RulePlan(rule=rule, choice=None, execution_plan=None, note=str(error).split(" HINT")[0])
            continue
        stages = partition_stages(choice.partition)
        plan = build_roundpipe_plan(stages, D, M, microbatches_per_round=choice.microbatches_per_round,
                                    dispatch=mixed.policy(rule, stages, mp.profiles))
        counts = tuple(sum(1 for a in actions if a.kind.value == "LOAD") for actions in plan.actions)
        rules[rule] = RulePlan(rule=rule, choice=choice, execution_plan=plan, stage_counts=counts)
    if all(r.choice is None for r in rules.values()):
        raise ValueError(rules["weighted"].note.rstrip(".") + ". HINT: a shorter sequence or microbatch, LoRA, or devices with more memory.")
    return MixedPlanReport(modelled=mp, hardware=given.hardware, devices=devices, mixed=mixed, num_microbatches=M,
                           optimizer=given.optimizer, optimizer_bytes=optimizer_bytes, rules=rules)


def format_mixed_report(r: MixedPlanReport, grid_rows: int = 40) -> str:
    """The text `roundpipe plan --devices <list>` prints."""
    mp, sh = r.modelled, r.modelled.shape
    total, trainable = model_param_counts(mp)
    kinds = len({(device.bf16_flops_per_s, device.memory_bytes) for device in r.devices})
    lines = [
        f"model: {sh.name} ({sh.model_type}, layer sequence L = {sh.num_layers}; {total / 1e9:.3g}B weights,"
        f" {trainable / 1e9:.3g}B trainable{', LoRA r=' + str(mp.lora.rank) if mp.lora else ''})",
        f"workload: microbatch {mp.microbatch_size} x {mp.seq_len} tokens, {r.num_microbatches} microbatches per step"
        f" ({r.tokens_per_step} tokens), {r.optimizer} optimizer",
        f"devices ({len(r.devices)}, {'mixed' if kinds > 1 else 'identical'}; layer costs on the fastest, GEMM efficiency {mp.cost_model.gemm_efficiency:.3g},"
        f" H2D {r.hardware.h2d_bytes_per_s / 1e9:.4g} GB/s each):",
        f"  {'dev':>3} {'name':<18} {'bf16 TFLOP/s':>12} {'memory GiB':>10} {'speed':>6} {'stage budget GiB':>16}",
    ]
    for index, (device, speed) in enumerate(zip(r.devices, r.mixed.speeds)):
        lines.append(f"  {index:>3} {device.name:<18} {device.bf16_flops_per_s / 1e12:>12.1f}"
                     f" {device.memory_bytes / GiB:>10.1f} {speed:>6.2f} {device.memory_bytes / 2 / GiB:>16.1f}")
    lines += ["", f"{'dispatch':<12} {'plan':<30} {'step s':>8} {'tokens/s':>10} {'mean idle %':>12}  idle per device %"]
    for rule, plan in r.rules.items():
        mark = "*" if rule == r.faster else " "
        if plan.choice is None:
            lines.append(f"{rule.replace('_', ' ') + mark:<12} no plan: {plan.note}")
            continue
        prediction = plan.choice.prediction
        rounds = "one round" if plan.choice.microbatches_per_round is None else f"rounds of {plan.choice.microbatches_per_round}"
        stages = len(plan.choice.partition.forward_stages) + len(plan.choice.partition.backward_stages) - 1
        lines.append(f"{rule.replace('_', ' ') + mark:<12} {f'{stages} stages, {rounds}':<30} {prediction.step_s:>8.3f}"
                     f" {r.tokens_per_s(rule):>10,.0f} {prediction.mean_idle_pct:>12.1f}  "
                     + " ".join(f"{x:.0f}" for x in prediction.idle_pct))
    plain, weighted = r.rules["round_robin"], r.rules["weighted"]
    if plain.choice is not None and weighted.choice is not None:
        lines.append(f"  (* faster; weighted / round robin tokens/s: {plain.step_s / weighted.step_s:.2f}x)")
    for rule, plan in r.rules.items():
        if plan.execution_plan is None:
            continue
        lines.append(f"stage dispatches per device, {rule.replace('_', ' ')}: "
                     + ", ".join(f"dev{d} {n}" for d, n in enumerate(plan.stage_counts)))
    chosen = r.rules[r.faster]
    lines += ["", f"{r.faster.replace('_', ' ')} plan (unit time per compute; a slower device takes longer per step):",
              _truncated_grid(chosen.execution_plan, grid_rows)]
    return "\n".join(lines)
