#!/usr/bin/env bash
# rlsched's policies inside vLLM on a GPU: bench/vllm_adaptive.py at a real size (one call,
# under 10 minutes; results land in $OUT, or bench/results without it):
#   bash bench/gpu_vllm.sh            the planted pair (Qwen2.5-1.5B target, 4 layers of the 0.5B
#                                     as drafter, random weights built on the spot, acceptance
#                                     planted per request): off, static k, vLLM's batch-size
#                                     table and goodput / seqgoodput / bandit through the hook
#   bash bench/gpu_vllm.sh --reps 5   more rounds (extra arguments go to bench/vllm_adaptive.py)
# Needs vLLM's GPU build (pip install vllm==0.32.0, the version .venv-vllm pins for the CPU
# build) beside a CUDA torch; rlsched runs from the checkout, uninstalled. The smoke run of
# the same path on vLLM's CPU build: .venv-vllm/bin/python bench/vllm_adaptive.py --models planted --smoke
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))"
python3 -c "import vllm; print('vllm', vllm.__version__)" || {
    echo "gpu_vllm: vLLM is not importable; install its GPU build first (pip install vllm==0.32.0)" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONUNBUFFERED=1
PYTHONPATH=. timeout 560 python3 bench/vllm_adaptive.py --models planted --reps 3 --max-batch 64 "$@"
