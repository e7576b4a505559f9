#!/usr/bin/env bash
# The GPU check: the paths no CPU run exercises (NCCL, CUDA placement, AMP on CUDA with its
# scaler, FSDP2 on CUDA, a CUDA worker's SIGKILL recovered, the async checkpoint's pinned copy,
# GPT-2-small bf16 throughput and MFU against a plain torch loop), one table of pass/fail lines
# with their figures, in about 3.5 minutes on one H100 (raytrainer/bench/gpu.py; --help lists them).
# JSON beside it: $OUT/gpu-checks.json where $OUT is set.
#
# Without an NVIDIA GPU it says that nothing was run and exits 0. With one it builds a venv
# (default .venv-gpu, gitignored; reused) with a CUDA build of torch (PyPI's Linux wheels are
# CUDA builds) and the project, unless PYTHON names an interpreter that has them, or python3
# already has a CUDA torch and Ray.
#   bash .ci/gpu.sh [CHECK ...]          e.g. bash .ci/gpu.sh nccl-1rank amp-fp16
#   PYTHON=.venv/bin/python bash .ci/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu.sh: no NVIDIA GPU on this machine (nvidia-smi finds none): nothing was run"
    exit 0
fi
nvidia-smi -L
ready() {  # an interpreter with a CUDA torch and Ray: the project runs from this checkout
    "$1" -c "import sys, torch, ray, yaml, cloudpickle; sys.exit(not torch.cuda.is_available())" 2>/dev/null
}
if [ -n "${PYTHON:-}" ]; then
    :
elif ready python3; then
    PYTHON=python3  # a GPU machine's own (one lent without network access has no index to install from)
else
    venv=${VENV:-.venv-gpu}
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    PYTHON=$venv/bin/python
    if ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
        "$PYTHON" -m pip install -q "torch>=2.9"
    fi
    "$PYTHON" -m pip install -q -e ".[examples]"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # raytrainer, examples/ and configs/ from here
"$PYTHON" -c "import torch; print('+ torch', torch.__version__, 'CUDA', torch.version.cuda)"
exec timeout 420 "$PYTHON" -m raytrainer.bench.gpu "$@"
