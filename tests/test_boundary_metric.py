"""The bytes one stage boundary moves per microbatch are logged as
``roundpipe/boundary_bytes_per_microbatch(bytes)``: for a Hugging Face decoder they are the hidden
states, the 2D attention mask, the position ids and the labels with their count, a formula of the
batch's shapes (no ``O(seq^2)`` mask, no rotary tables)."""

import pytest

import lightning_roundpipe
from _helpers import SEQ, CausalLMModule, TokenData, loader, tiny_hf, trainer

KEY = "roundpipe/boundary_bytes_per_microbatch(bytes)"
HIDDEN = 32  # tiny_hf's hidden size


def expected_bytes(rows: list[int]) -> float:
    """Mean over microbatches of one microbatch's boundary carry, from the shapes: fp32 hidden states
    (rows, SEQ, HIDDEN), the int64 2D mask (rows, SEQ), int64 positions (1, SEQ) made by the prefix,
    int64 labels (rows, SEQ) and their int64 count (0-dim)."""
    per_mb = [r * SEQ * HIDDEN * 4 + r * SEQ * 8 + SEQ * 8 + r * SEQ * 8 + 8 for r in rows]
    return sum(per_mb) / len(per_mb)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transparent"])
def test_boundary_bytes_are_logged(fused):
    module = CausalLMModule(tiny_hf("llama", layers=4))
    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, fused_loss=fused, partition="default")
    t = trainer(strategy, devices=2, max_steps=2)
    t.fit(module, loader(TokenData(n=14), batch_size=7))
    logged = float(t.strategy.step_metrics[KEY])
    want = expected_bytes([3, 2, 2])  # 7 rows cut into 3 microbatches
    print(f"fused={fused}: {logged:.1f} bytes per microbatch per boundary (formula {want:.1f})")
    assert logged == pytest.approx(want, rel=0, abs=1e-6)
