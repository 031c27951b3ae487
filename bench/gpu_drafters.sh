#!/usr/bin/env bash
# bench/drafters.py on a GPU (the built-in pair in bfloat16), one call of under 10 minutes;
# results land in $OUT (or bench/results without it). The EAGLE head is trained on first use
# (about a minute): point RLSCHED_CACHE at a carried cache that holds it to skip that.
# Uses the machine's own python3 with torch (CUDA); rlsched runs from the checkout, uninstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 500 python3 bench/drafters.py --device cuda --rounds 2 "$@"
