#!/usr/bin/env bash
# GPU checks (needs a CUDA machine; about 5 minutes): the `gpu`-marked tests (fp32 and bf16-mixed
# parity with plain single-GPU training, prefetch overlapping compute from CUDA events), then the GPU
# benchmark: tokens/s, MFU against the measured bf16 matmul peak, predicted vs measured step time.
set -euo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE=disabled
python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(" ", i, torch.cuda.get_device_name(i))
PY
timeout 300 python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider
timeout 240 python benchmarks/gpu_check.py --layers 12 --hidden 1024 --vocab 32000 --seq-len 1024 --batch-size 8
