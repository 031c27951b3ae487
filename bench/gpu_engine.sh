#!/usr/bin/env bash
# The engine on a GPU, as prepared scripts for an H200 (one call each, under 10 minutes;
# results land in $OUT, or bench/results without it):
#   bash bench/gpu_engine.sh          verify cost over B x k, plain and compiled decoding at the
#                                     Qwen2.5-1.5B size (bench/gpu_engine.py, about 5 minutes)
#   bash bench/gpu_engine.sh drain    the engine benchmark's drain (64 -> 1 rows, long-tail
#                                     lengths) on the built-in pair in bf16: static k against the adaptive
#                                     policies (bench/engine.py --device cuda, 20 rounds)
#   bash bench/gpu_engine.sh planted  the same drain at the Qwen2.5-1.5B size with planted
#                                     acceptance (bench/gpu_drain.py, estimated 3-6 minutes): the
#                                     regime adaptive drafting is for, which neither the CPU nor
#                                     the built-in pair on a GPU has
# The drain reads the built-in pair shipped in the checkout (rlsched/executor/model/builtin_pair): nothing
# to build or carry.
# Uses the machine's own python3 with torch (CUDA); rlsched runs from the checkout, uninstalled.
# Its image has no pydantic or simpy, which these scripts do not import (tests/test_gpu_bench_script.py).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if [ "${1:-}" = "drain" ]; then
    shift
    export PYTHONUNBUFFERED=1
    PYTHONPATH=. timeout 560 python3 bench/engine.py --device cuda --sections drain --drain-rounds 20 "$@"
    if [ -n "${OUT:-}" ]; then cp bench/results/engine_drain_cuda.json bench/results/engine_drain_cuda.txt "$OUT"/; fi
elif [ "${1:-}" = "planted" ]; then
    shift
    PYTHONUNBUFFERED=1 PYTHONPATH=. timeout 560 python3 bench/gpu_drain.py "$@"
else
    PYTHONPATH=. timeout 540 python3 bench/gpu_engine.py "$@"
fi
