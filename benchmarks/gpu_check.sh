#!/usr/bin/env bash
# The prepared GPU check: the CUDA tests, the GPU bench, then the FSDP2 offload step, in under 9 minutes on one GPU.
#   pip install -e ".[test]"        # pytest; torch with CUDA and the triton package must be installed
#   bash benchmarks/gpu_check.sh    # from anywhere; it runs in the repository root
# Prints the GPU, the test summary (every failure listed, not only the first) and the
# `halfadam bench --device cuda` tables: "x torch fused" is the ratio to torch.optim.AdamW(fused=True)
# on fp32 parameters in the same run; "torch fused bf16" is torch's fused step on bf16 parameters
# (bf16 state, no master); the overhead lines give the host time per step. Ends with each stage's
# exit status (124: it ran out of its time) and exits non-zero if a stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
# first: versions, devices, and every kernel against the reference bit for bit (halfadam.selfcheck)
timeout 120 python -m halfadam doctor
doctor=$?
# the Triton kernel against the reference on CUDA tensors, the CUDA tests of the other paths
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_executions.py -k "triton or cuda" \
  > /tmp/halfadam_gpu_tests.log 2>&1
tests=$?
grep -E "^(FAILED|ERROR)|passed|failed" /tmp/halfadam_gpu_tests.log | tail -25
# 20M/50 and 100M/50 params, every state mode, triton and fused; 2,000 small tensors; the overhead case
timeout 150 python -m halfadam bench --device cuda --sizes 2e7 --large --dtypes bf16,fp16 --impls triton,fused \
  --state-modes all --warmup 3 --repeat 10
bench=$?
# the parameter list of a 1.3B GPT (292 tensors of its real shapes), bf16: triton in fp32 and compact state
timeout 100 python -m halfadam bench --device cuda --sizes 1e6 --no-small --gpt --dtypes bf16 --impls triton \
  --state-modes fp32,compact --warmup 2 --repeat 5
gpt=$?
# FSDP2 on one rank, CPUOffloadPolicy(pin_memory=True) against no offload: step time, device peak and
# host RSS per parameter (134M bf16 parameters in 8 units; fp32 and tiny state); only where CUDA runs
offload=0
if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  timeout 120 python benchmarks/offload_step.py --device cuda --width 4096 --layers 8 --modes fp32,tiny
  offload=$?
else
  echo "offload step: skipped (no CUDA)"
fi
echo "gpu_check: doctor exit $doctor, tests exit $tests (log /tmp/halfadam_gpu_tests.log), bench exit $bench, gpt bench exit $gpt," \
  "offload step exit $offload"
[ "$doctor" -eq 0 ] && [ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$gpt" -eq 0 ] && [ "$offload" -eq 0 ]
