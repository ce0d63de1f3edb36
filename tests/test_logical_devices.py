"""Several logical workers on one device: ``RoundPipeStrategy(parallel_devices=[device] * N)``.

On a GPU this is how one GPU runs the round-robin dispatch and the cross-stream event waits of N
workers (each worker has its own streams); the GPU's memory budget is then shared by its workers.
"""

from types import SimpleNamespace

import torch

import lightning_roundpipe
from lightning_roundpipe.runtime.backends import stage_memory_bytes
from _helpers import CausalLMModule, TokenData, loader, tiny_hf, trainer


def test_parallel_devices_may_name_one_device_several_times():
    seen = []

    class Workers(lightning_roundpipe.RoundPipeMetricsCallback):
        def on_train_batch_end(self, trainer, *args, **kwargs):
            seen.append([(b.device_index, str(b.device)) for b in trainer.strategy.engine.backends])
            super().on_train_batch_end(trainer, *args, **kwargs)

    strategy = lightning_roundpipe.RoundPipeStrategy(num_microbatches=3, partition="default",
                                                     parallel_devices=[torch.device("cpu")] * 3)
    t = trainer(strategy, devices=1, max_steps=1, callbacks=[Workers()])  # the strategy's devices win
    assert t.num_devices == 3
    t.fit(CausalLMModule(tiny_hf("llama")), loader(TokenData()))
    assert seen == [[(0, "cpu"), (1, "cpu"), (2, "cpu")]]


def test_stage_memory_is_shared_by_the_logical_workers_of_one_gpu(monkeypatch):
    """The default budget is measured free memory (plus what torch reserves) less max(512 MiB, 5 %), not
    ``total_memory`` (issue 30): another process's 6 GiB and the margin are left out."""
    card, free, reserved = 80 * 2**30, 74 * 2**30, 2 * 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=card))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (free, card))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: reserved)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    total = free + reserved - card // 20  # 5 % of the card is more than 512 MiB
    cuda = torch.device
    assert stage_memory_bytes([cuda("cuda:0")], None) == total // 2  # double buffering
    assert stage_memory_bytes([cuda("cuda:0"), cuda("cuda:1")], None) == total // 2
    assert stage_memory_bytes([cuda("cuda:0")] * 4, None) == total // 8
    assert stage_memory_bytes([cuda("cuda:0"), cuda("cuda:1"), cuda("cuda:1")], None) == total // 4  # most crowded
    assert stage_memory_bytes([cuda("cuda"), cuda("cuda:0")], None) == total // 4  # "cuda" is the current GPU
    assert stage_memory_bytes([cuda("cuda:0")] * 4, 2**30) == 2**29  # a budget is one worker's memory
    assert stage_memory_bytes([cuda("cpu")] * 2, None) is None
