"""Frozen weight formats in plans made without a run (issue 33 item 3): the packed bytes against the tensors
bitsandbytes and the fp8 store make, the cost model, the memory model, the simulator and `roundpipe plan`."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from lightning_roundpipe.cli import main, plan_cmd
from lightning_roundpipe.partition.costmodel import LoRASpec, model_profiles
from lightning_roundpipe.partition.fitting import modelled_peak
from lightning_roundpipe.partition.frozen import (
    FrozenFormat,
    check_frozen_format,
    dequant_seconds,
    packed_weight_bytes,
)
from lightning_roundpipe.partition.memory import planner_stage_bytes
from lightning_roundpipe.partition.presets import preset_config
from lightning_roundpipe.partition.profile import HardwareModel

# (rows, cols): a block-aligned weight, one whose numel is odd and not a multiple of 64, one with more
# than 256 absmax blocks (several second-level blocks), a single row
SHAPES = [(64, 64), (7, 13), (300, 257), (1, 1000)]
HW = HardwareModel(flops_per_s=165e12, h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9)


def _device_bytes(packed: torch.Tensor, state) -> int:
    """Bytes of every tensor bitsandbytes' 4-bit weight holds and a device needs (the packed codes and the
    quantisation state; the state's shape and dtype are Python values)."""
    tensors = [packed, state.absmax, state.code]
    if state.nested:
        tensors += [state.offset, state.state2.absmax, state.state2.code]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_4bit_bytes_equal_bitsandbytes_tensors(rows, cols, quant_type, double_quant):
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(rows, cols, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(rows * cols))
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, compress_statistics=double_quant,
                                                 quant_type=quant_type)
    assert packed_weight_bytes(quant_type, rows, cols, double_quant=double_quant) == _device_bytes(packed, state)


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_int8_bytes_equal_bitsandbytes_tensors(rows, cols):
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    codes, scales, _ = bnb_functional.int8_vectorwise_quant(torch.randn(rows, cols, dtype=torch.float16))
    assert packed_weight_bytes("int8", rows, cols) == codes.nbytes + scales.nbytes


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_fp8_bytes_equal_the_runtime_block(rows, cols):
    from lightning_roundpipe.runtime.host import fp8

    assert packed_weight_bytes("fp8", rows, cols) == fp8.block_layout((rows, cols), 0)[1]


def test_large_weights_per_parameter():
    """The asymptotes: nf4 with double quantisation 4.127 bits (QLoRA), without 4.5; fp8 and int8 1 byte."""
    n = 8192
    assert packed_weight_bytes("nf4", n, n) / n**2 == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256), rel=1e-4)
    assert packed_weight_bytes("nf4", n, n, double_quant=False) / n**2 == pytest.approx(0.5625, rel=1e-4)
    assert packed_weight_bytes("fp8", n, n) / n**2 == pytest.approx(1.0, rel=1e-3)
    assert packed_weight_bytes("bf16", n, n) == 2 * n * n


def test_bad_format_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"`--frozen-weights` must be one of \['bf16', 'fp8', 'nf4', 'int8'\].*HINT"):
        check_frozen_format("q4")
    with pytest.raises(ValueError, match="did you mean `--frozen-weights nf4`"):
        check_frozen_format("NF4")


@pytest.fixture(scope="module")
def llama_profiles() -> dict[str, object]:
    return {name: model_profiles(preset_config("llama3.1-8b"), HW, seq_len=512, microbatch_size=1, lora=LoRASpec(),
                                 frozen_weights=name) for name in ("bf16", "fp8", "nf4", "int8")}


def test_cost_model_counts_the_packed_base(llama_profiles):
    """Per layer, the param bytes differ from bf16's by exactly the converted weights' packed bytes; nf4's
    converted matmul weights take 0.516 host bytes per parameter, and the base 0.3x of bf16's host memory."""
    bf16 = llama_profiles["bf16"]
    matmul = sum(n * r * c for cost in bf16.costs for n, r, c in cost.frozen_matmul_shapes)
    for name in ("fp8", "nf4", "int8"):
        mp = llama_profiles[name]
        numel, packed = mp.converted_bytes()
        assert numel == matmul  # attention + MLP projections and the untied LM head
        assert sum(p.param_bytes for p in mp.profiles) == sum(p.param_bytes for p in bf16.profiles) - 2 * numel + packed
    nf4_numel, nf4_packed = llama_profiles["nf4"].converted_bytes()
    assert 0.515 < nf4_packed / nf4_numel < 0.517
    frozen_bf16, trainable = bf16.host_weight_bytes()
    frozen_nf4, trainable_nf4 = llama_profiles["nf4"].host_weight_bytes()
    assert trainable_nf4 == trainable and frozen_bf16 - frozen_nf4 == 2 * nf4_numel - nf4_packed


def _once(fmt: str, cost, memory_bytes_per_s: float) -> float:
    """Seconds of dequantising every converted weight of ``cost``'s layer once (the formula's oracle)."""
    return sum(n * dequant_seconds(packed_weight_bytes(fmt, r, c), r * c, 2, memory_bytes_per_s)
               for n, r, c in cost.frozen_matmul_shapes)


def test_dequant_time_where_the_runtime_dequantises(llama_profiles):
    """fp8 and ``frozen_weights="nf4"``: once per residency (``bind_s``); a model loaded in 4 bits: in every
    forward and backward of a microbatch (bitsandbytes' Linear4bit), in 8 bits in the backward; bf16: never."""
    bf16 = llama_profiles["bf16"].profiles[1]
    cost = llama_profiles["bf16"].costs[1]
    bandwidth = llama_profiles["bf16"].cost_model.device_memory_bytes_per_s
    for fmt in ("fp8", "nf4"):
        layer = llama_profiles[fmt].profiles[1]
        assert layer.bind_s == pytest.approx(_once(fmt, cost, bandwidth), rel=1e-9) and layer.bind_s > 0
        assert (layer.forward_s, layer.backward_s) == (bf16.forward_s, bf16.backward_s)
    loaded = model_profiles(preset_config("llama3.1-8b"), HW, seq_len=512, microbatch_size=1, lora=LoRASpec(),
                            frozen_weights=FrozenFormat(name="nf4", loaded=True)).profiles[1]
    once = _once("nf4", cost, bandwidth)
    assert loaded.bind_s == 0
    assert loaded.forward_s - bf16.forward_s == pytest.approx(once, rel=1e-9)
    assert loaded.backward_s - bf16.backward_s == pytest.approx(once, rel=1e-9)
    int8 = llama_profiles["int8"].profiles[1]
    assert int8.forward_s == bf16.forward_s and int8.backward_s - bf16.backward_s == pytest.approx(
        _once("int8", cost, bandwidth), rel=1e-9)
    assert bf16.bind_s == 0


def _two_device_plan(num_layers: int, microbatches: int):
    from lightning_roundpipe.schedule import build_roundpipe_plan, build_stages

    stages = build_stages([range(0, 17), range(17, num_layers - 1)], [range(num_layers - 1, num_layers),
                                                                      range(17, num_layers - 1), range(0, 17)],
                          fused_tail=True)
    return build_roundpipe_plan(stages, 2, microbatches)


def test_simulated_compute_holds_the_dequantisations(llama_profiles):
    """The simulator times what the runtime does: fp8 and ``frozen_weights="nf4"`` dequantise a stage's
    weights once per residency (every stage once in a one-round step: a layer in a forward and a backward
    stage twice, the tail once), a loaded Linear4bit in every compute op of every microbatch (forward stage
    1 pass, recompute 1, backward 1, the fused tail 2); bf16 never."""
    from lightning_roundpipe.simulate.engine import simulate

    num_layers = len(llama_profiles["bf16"].profiles)
    plan = _two_device_plan(num_layers, 3)
    loaded = model_profiles(preset_config("llama3.1-8b"), HW, seq_len=512, microbatch_size=1, lora=LoRASpec(),
                            frozen_weights=FrozenFormat(name="nf4", loaded=True))
    profiles = {**{name: llama_profiles[name].profiles for name in ("bf16", "fp8", "nf4")}, "loaded": loaded.profiles}
    compute = {name: sum(simulate(plan, p, HW).compute_s) for name, p in profiles.items()}
    tail = num_layers - 1
    for name in ("fp8", "nf4"):
        once = llama_profiles[name].dequant_s
        assert compute[name] - compute["bf16"] == pytest.approx(2 * sum(once[:tail]) + once[tail], rel=1e-6)
    once = loaded.dequant_s
    assert compute["loaded"] - compute["bf16"] == pytest.approx(3 * (3 * sum(once[:tail]) + 2 * once[tail]), rel=1e-6)
    assert all(compute[name] > compute["bf16"] for name in ("fp8", "nf4", "loaded"))


def test_binds_once_per_residency_also_over_rounds(llama_profiles):
    """With rounds of microbatches a stage has a residency per round: its weights are dequantised per round."""
    from lightning_roundpipe.schedule import build_roundpipe_plan
    from lightning_roundpipe.simulate.engine import simulate

    num_layers = len(llama_profiles["bf16"].profiles)
    one = _two_device_plan(num_layers, 4)
    rounds = build_roundpipe_plan(list(one.stages), 2, 4, microbatches_per_round=2)
    nf4, bf16 = llama_profiles["nf4"].profiles, llama_profiles["bf16"].profiles
    extra = {name: sum(simulate(plan, nf4, HW).compute_s) - sum(simulate(plan, bf16, HW).compute_s)
             for name, plan in (("one", one), ("rounds", rounds))}
    assert extra["rounds"] == pytest.approx(2 * extra["one"], rel=1e-6)


def test_memory_model_counts_the_device_copies(llama_profiles):
    """fp8 and ``frozen_weights="nf4"``: a stage holds its weights' compute-dtype copies (fp8 through one fp32
    transient); a loaded Linear4bit only the copy of its largest weight a matmul makes (the LM head's, in
    the tail)."""
    stages = [("forward", range(0, 3)), ("fused", range(32, 34))]
    loaded = model_profiles(preset_config("llama3.1-8b"), HW, seq_len=512, microbatch_size=1, lora=LoRASpec(),
                            frozen_weights=FrozenFormat(name="nf4", loaded=True))
    fp8, nf4, in_4bit = (planner_stage_bytes(mp.profiles, stages, 2, mp.frozen_layer_bytes)
                         for mp in (llama_profiles["fp8"], llama_profiles["nf4"], loaded))
    layer = sum(n * r * c for n, r, c in llama_profiles["bf16"].costs[1].frozen_matmul_shapes)
    assert fp8[0].dequantised_bytes == nf4[0].dequantised_bytes == 2 * 2 * layer  # layers 1, 2 (0: the embedding)
    assert fp8[0].dequant_transient_bytes == 4 * 14336 * 4096  # the MLP projections are the largest
    assert nf4[0].dequant_transient_bytes == 0
    assert in_4bit[0].dequantised_bytes == 0 and in_4bit[0].dequant_transient_bytes == 2 * 14336 * 4096
    assert in_4bit[1].dequant_transient_bytes == 2 * 128256 * 4096  # the untied LM head


PLAN = ["plan", "--preset", "qwen3-1.7b", "--devices", "2", "--device-memory-gib", "24", "--tflops", "165",
        "--seq-len", "1024", "--microbatch-size", "1", "--microbatches", "3", "--lora", "--grid-rows", "2"]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan_cmd.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv[:])


@pytest.fixture(scope="module")
def link_bound_report() -> plan_cmd.PlanReport:
    """A plan whose step is bound by the link (1 GB/s per device), with the formats side by side."""
    return plan_cmd.make_report(_parse([*PLAN, "--h2d-gbps", "1", "--frozen-weights", "nf4"]))


def test_plan_compares_the_formats_where_the_link_is_the_bound(link_bound_report):
    rows = {row.name: row for row in link_bound_report.formats}
    assert list(rows) == ["bf16", "fp8", "nf4"]
    assert rows["nf4"].step_s == link_bound_report.step_s  # the report's own plan is its row
    assert rows["bf16"].host_bytes > rows["fp8"].host_bytes > rows["nf4"].host_bytes
    assert rows["bf16"].weight_h2d_bytes > rows["fp8"].weight_h2d_bytes > rows["nf4"].weight_h2d_bytes
    assert rows["nf4"].tokens_per_s > rows["fp8"].tokens_per_s > rows["bf16"].tokens_per_s
    assert rows["nf4"].max_seq_len >= rows["bf16"].max_seq_len
    assert rows["bf16"].converted_bytes_per_param == 2.0
    assert 0.515 < rows["nf4"].converted_bytes_per_param < 0.517
    # the frozen base's host bytes: bf16's less the converted weights' savings
    saved = rows["nf4"].converted_params * (2 - rows["nf4"].converted_bytes_per_param)
    assert rows["bf16"].frozen_bytes - rows["nf4"].frozen_bytes == pytest.approx(saved, rel=1e-9)


def test_plan_peak_counts_the_format(link_bound_report):
    """The report's peak is the memory model's for nf4's profiles (packed slots, one dequantised copy)."""
    r = link_bound_report
    assert r.peak_device_memory_bytes == modelled_peak(r.modelled, r.stages, r.num_devices, r.num_microbatches, 1, 2)
    bf16 = dataclasses.replace(r.modelled, frozen_layer_bytes=())
    assert modelled_peak(bf16, r.stages, r.num_devices, r.num_microbatches, 1, 2) < r.peak_device_memory_bytes


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nf4", "int8"])
def test_plan_prints_each_format(fmt, capsys):
    assert main([*PLAN, "--frozen-weights", fmt]) == 0
    out = capsys.readouterr().out
    assert "host memory for weights and training state" in out and "weights uploaded per step" in out
    assert "frozen weights side by side" in out
    assert f"\n{fmt}*" in out
    assert ("dequantisation on the devices" in out) == (fmt != "bf16")


def test_plan_without_the_flag_prints_no_comparison(capsys):
    assert main(PLAN) == 0
    out = capsys.readouterr().out
    assert "host memory for weights and training state" in out and "side by side (each re-planned" not in out


@pytest.mark.parametrize("argv,message", [
    ([*PLAN, "--frozen-weights", "q4"], "`--frozen-weights` must be one of ['bf16', 'fp8', 'nf4', 'int8'], got 'q4'"),
    ([a for a in PLAN if a != "--lora"] + ["--frozen-weights", "nf4"], "`--frozen-weights nf4` needs `--lora`"),
    # the strategy refuses a correction without optimizer="async"; so does the planner (it took it silently)
    ([*PLAN, "--staleness-correction", "weight_prediction"], "`--staleness-correction weight_prediction` needs `--optimizer async`"),
    ([*PLAN, "--optimizer", "sync", "--staleness-correction", "gradient_extrapolation"], "needs `--optimizer async`"),
    # a rank without `--lora` was ignored: a full fine-tuning plan came out
    ([a for a in PLAN if a != "--lora"] + ["--lora-rank", "8"], "`--lora-rank 8` needs `--lora`"),
])
def test_bad_frozen_weights_exit_2_with_a_hint(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "HINT:" in err


def test_moe_experts_are_named_as_not_converted(capsys):
    """A MoE model's fused 3-D expert weights stay in the compute dtype (the runtime converts nn.Linear
    weights only); the plan says so, and counts them so."""
    mp = model_profiles(preset_config("qwen3-235b-a22b"), HW, seq_len=128, microbatch_size=1, lora=LoRASpec(),
                        frozen_weights="nf4")
    experts = mp.frozen_expert_param_count
    assert experts > 0.9 * sum(c.param_count for c in mp.costs)
    everything = model_profiles(preset_config("qwen3-235b-a22b"), HW, seq_len=128, microbatch_size=1,
                                lora=LoRASpec(), frozen_weights=FrozenFormat(name="nf4", experts=True))
    assert everything.converted_param_count == mp.converted_param_count + experts


def _wide_config(path) -> str:
    """A model whose decoder weights, not its activations or vocabulary, take most of a small device."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1 << 16, tie_word_embeddings=True).save_pretrained(path)
    return str(path)


def test_planned_max_seq_len_counts_the_format():
    """Packed stage slots leave room for longer sequences; the dequantised copies of the computing stage take
    some back (fp8: two fp8 slots and one stage's bf16 copies weigh about two bf16 slots, plus the fp32
    transient; nf4: two slots of a quarter of bf16's and the copies)."""
    from lightning_roundpipe.partition.seqlen import planned_max_seq_len

    config = preset_config("llama3.1-8b")
    stages = [("forward", range(0, 17)), ("forward", range(17, 33)), ("fused", range(33, 34)),
              ("backward", range(17, 33)), ("backward", range(0, 17))]

    def longest(fmt: str, frozen: bool = True) -> int:
        return planned_max_seq_len(lambda s: model_profiles(config, HW, seq_len=s, microbatch_size=1, lora=LoRASpec(),
                                                            frozen_weights=fmt),
                                   stages, 2, 24 * 2**30, num_microbatches=3, frozen=frozen)

    bf16, fp8, nf4 = longest("bf16"), longest("fp8"), longest("nf4")
    assert nf4 > bf16 > fp8 > 0  # two slots of 16 decoder layers: 2 x 7.0 GiB in bf16
    assert longest("fp8", frozen=False) > bf16  # without the stage's dequantised copies
    assert longest("nf4", frozen=False) > nf4


@pytest.mark.parametrize("argv,message", [
    (["--frozen-weights", "nf4"], "`--frozen-weights nf4` needs `--lora`"),
    (["--lora", "--frozen-weights", "int8"], "`--frozen-weights int8` is a model loaded in 8 bits"),
    (["--lora", "--frozen-weights", "4bit"], "`--frozen-weights` must be one of"),
    (["--microbatches", "0"], "`--microbatches` must be >= 1, got 0"),  # 0 ran the search with devices + 1
    (["--devices", "0"], "`--devices` must be >= 1, got 0"),
    (["--start", "100", "--limit", "10"], "`--limit` (10) must be >= `--start` (100)"),
    (["--device-memory-mib", "-1"], "`--device-memory-mib` must be > 0, got -1"),
])
def test_max_seq_bad_frozen_weights_exit_2(argv, message, capsys):
    assert main(["max-seq", "--tiny", "--device-memory-mib", "64", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "HINT:" in err


@pytest.mark.slow  # two bisections of real steps: about 2 minutes on a loaded 2-core machine
def test_max_seq_fp8_base_trains_longer_sequences_as_planned(tmp_path):
    """LoRA on a model whose frozen decoder weights fill the device: the fp8 base (a quarter of the fp32
    bytes in the slots) leaves room for longer sequences, measured on the ledger, and the planner, counting the fp8
    slots and the stage's dequantised copies, agrees within 20 % in both formats."""
    from lightning_roundpipe.cli.max_seq_cmd import make_report

    path = _wide_config(tmp_path)
    reports = {}
    for fmt in ("bf16", "fp8"):
        args = argparse.Namespace(tiny=False, model=path, devices=2, accelerator="cpu", device_memory_mib=24.0,
                                  microbatches=None, microbatch_size=1, start=16, limit=8192, resolution=32,
                                  lora=True, frozen_weights=fmt)
        reports[fmt] = make_report(args)
    for r in reports.values():
        assert r.first_failing is not None and abs(r.planned - r.measured) <= 0.2 * r.measured, r
    assert reports["fp8"].measured > 1.5 * reports["bf16"].measured
