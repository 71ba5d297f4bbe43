#!/usr/bin/env bash
# The prepared GPU check: the CUDA tests, then the GPU bench, in under 5 minutes on one GPU.
#   bash benchmarks/gpu_check.sh            (from the repository root, torch with CUDA and triton installed)
# Prints the test summary and `halfadam bench --device cuda` tables: x torch fused is the ratio to
# torch.optim.AdamW(fused=True) on fp32 parameters in the same run; "torch fused bf16" is torch's fused
# step on bf16 parameters (bf16 state, no master). The per-step host time is in the overhead lines.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
# the Triton kernel against the reference on CUDA tensors, the CUDA tests of the other paths
timeout 150 python -m pytest -q -x -p no:cacheprovider tests/test_triton.py tests/test_executions.py -k "triton or cuda" 2>&1 | tail -15
# 20M/50 and 100M/50 params, every state mode, triton and fused, torch fused fp32 and bf16; 2,000 small tensors
timeout 150 python -m halfadam bench --device cuda --sizes 2e7 --large --dtypes bf16,fp16 --impls triton,fused \
  --state-modes all --warmup 3 --repeat 10
