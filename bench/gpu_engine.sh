#!/usr/bin/env bash
# The engine on a GPU, as one prepared script (for the device tool's H200, about 5 minutes):
#   run: bash bench/gpu_engine.sh      (results land in $OUT, or bench/results without it)
# Uses the machine's own python3 with torch (CUDA); rlsched runs from the checkout, uninstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
PYTHONPATH=. timeout 540 python3 bench/gpu_engine.py "$@"
