#!/usr/bin/env bash
# One device session, as `run` launches it from the repo root (see docs/gpu.md):
#   bash bench/gpu_session.sh [gpu_check arguments...]
# Installs carried wheels (.whl/, e.g. the transformers version CI tests with) and this checkout
# without touching the network, then runs bench/gpu_check.py with its report under $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.txt"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site
    # A carried transformers may want newer helpers than the image has: then use the image's own.
    if ! python3 -c "import transformers, transformers.models.llama"; then
        echo "carried wheels do not import here: using the image's packages"
        unset PYTHONPATH
    fi
fi
# The image has setuptools; build isolation would try to download it. Should the offline
# editable install still fail (an old setuptools), lay the package out by links instead:
# graphs/ and kernels/ are compiled_engine.graphs and compiled_engine.kernels.
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
    echo "editable install failed: using links and PYTHONPATH"
    ln -sfn ../graphs compiled_engine/graphs
    ln -sfn ../kernels compiled_engine/kernels
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import compiled_engine.graphs, compiled_engine.kernels" || exit 3
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache COMPILED_ENGINE_CACHE_DIR=/tmp/compiled-engine-cache
timeout "${GPU_CHECK_TIMEOUT:-470}" python3 -m bench.gpu_check --device cuda --out "$OUT/gpu_report.md" "$@"
echo "gpu_check exit status $?"
