#!/usr/bin/env bash
# GPU checks (needs a CUDA machine; about 5 minutes): the `gpu`-marked tests and a short throughput
# measurement of RoundPipe on all GPUs vs plain single-GPU training of the same Llama-shaped model.
set -euo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE=disabled
python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(" ", i, torch.cuda.get_device_name(i))
PY
timeout 240 python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider
timeout 240 python benchmarks/throughput.py --accelerator cuda --layers 12 --hidden 1024 --vocab 32000 \
  --seq-len 1024 --batch-size 8 --warmup 2 --steps 5
