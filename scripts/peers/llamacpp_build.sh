#!/bin/bash
# Builds llama.cpp's llama-batched-bench and llama-bench, as a benchmark peer (#19), from the source
# vendored in the llama-cpp-python 0.3.36 sdist (PyPI is the one registry reached here).
#   scripts/peers/llamacpp_build.sh [DIR]       (default /work/peers/llamacpp; ~5-10 min at -j2)
# Leaves DIR/bin/{llama-batched-bench,llama-bench,llama-bench-mixed}, DIR/src (the vendored tree) and DIR/gguf-venv, a
# small venv with that tree's gguf-py and what its convert_hf_to_gguf.py imports (torch 2.13.0 from
# this machine's disk): bench/peers/gguf_convert.py runs there, converting a bench model folder to
# GGUF the first time a suite asks for it (cached under DIR/gguf/).
# Then: pytest bench/test_throughput.py --peer llamacpp=DIR
#
# CPU features: not GGML_NATIVE by default. A native build on this machine's CPU (it lists amx_int8)
# compiles ggml's AMX kernels in, and its Q8_0 / Q4_0 runs died with SIGILL here; the portable
# default names the x86 features explicitly instead: AVX2, AVX-512 (F, VNNI, BF16), F16C, FMA on,
# AMX off. LLAMACPP_NATIVE=1 gives the old native build (-march=native, AMX where the CPU lists it);
# a CPU without AVX-512 (an AMD Zen 3 here) gets it by default, as the portable flags would not run there.
set -euo pipefail
if ! grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  LLAMACPP_NATIVE=${LLAMACPP_NATIVE:-1}
fi
DIR=${1:-/work/peers/llamacpp}
JOBS=${JOBS:-2}
PY=${PYTHON:-python3}
mkdir -p "$DIR/dl" "$DIR/bin"
if [ ! -d "$DIR/src" ]; then
  "$PY" -m pip download --no-input --progress-bar off 'llama-cpp-python==0.3.36' \
    --no-binary llama-cpp-python --no-deps -d "$DIR/dl"
  tar -xzf "$DIR"/dl/llama_cpp_python-0.3.36.tar.gz -C "$DIR/dl"
  mv "$DIR/dl/llama_cpp_python-0.3.36/vendor/llama.cpp" "$DIR/src"
fi
if [ "${LLAMACPP_NATIVE:-0}" = 1 ]; then
  CPU_FLAGS=(-DGGML_NATIVE=ON)
  DRIVER_ARCH=(-march=native)
else
  CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
    -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_F16C=ON -DGGML_FMA=ON
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  DRIVER_ARCH=(-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq)
fi
cmake -S "$DIR/src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release "${CPU_FLAGS[@]}" -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 19 cmake --build "$DIR/build" -j "$JOBS" --target llama-batched-bench llama-bench llama-quantize
cp "$DIR/build/bin/llama-batched-bench" "$DIR/build/bin/llama-bench" "$DIR/build/bin/llama-quantize" "$DIR/bin/"
# The mixed-length throughput driver (bench/peers/llamacpp_mixed.cpp), against the same static libs.
B="$DIR/build"
nice -n 19 g++ -O3 "${DRIVER_ARCH[@]}" -std=c++17 -I "$DIR/src/include" -I "$DIR/src/ggml/include" \
  "$(dirname "$0")/../../bench/peers/llamacpp_mixed.cpp" -o "$DIR/bin/llama-bench-mixed" \
  -Wl,--start-group "$B/src/libllama.a" "$B"/ggml/src/libggml*.a -Wl,--end-group -fopenmp -lpthread -lm
"$DIR/bin/llama-bench" --help > /dev/null
GPY="$DIR/gguf-venv/bin/python"
[ -x "$GPY" ] || "$PY" -m venv "$DIR/gguf-venv"
"$GPY" -m pip install --no-input --progress-bar off 'torch==2.13.0'
"$GPY" -m pip install --no-input --progress-bar off 'torch==2.13.0' "$DIR/src/gguf-py" \
  numpy safetensors sentencepiece protobuf transformers
"$GPY" -c 'import gguf, torch, transformers; print("gguf-venv ok")'
echo "built: $DIR/bin"
