#!/bin/bash
# Warm start (LLM() to ready) with a full cache vs a cache missing every bucket but the dynamic
# graph and bucket 16, both under the background policy (the partial copy restored before each
# round), 6 interleaved rounds. Usage: scripts/warm_start/partial_cache.sh [WORK_DIR]
# (docs/performance.md, #18)
set -e
cd "$(dirname "$0")/../.."
HERE=$(pwd)/scripts/warm_start
MODEL=$(.venv/bin/python -c "from bench.models import tiny_test_model_dir; print(tiny_test_model_dir())" 2>/dev/null)
LIMITS='"max_model_len": 512, "max_num_seqs": 256, "max_num_batched_tokens": 4096, "num_kv_blocks": 8192, "block_size": 16'
unset TORCHINDUCTOR_CACHE_DIR COMPILED_ENGINE_COMPILE_POLICY
export TQDM_DISABLE=1
W=${1:-/tmp/partial-warm}; rm -rf $W; mkdir -p $W
COMPILED_ENGINE_CACHE_DIR=$W/full .venv/bin/python $HERE/start.py "$MODEL" "{$LIMITS, \"compile_policy\": \"blocking\"}" all 2>/dev/null | tail -1 | sed 's/^/fill /'
cp -r $W/full $W/partial-src
ENTRY=$(ls -d $W/partial-src/entries/*)
for f in $ENTRY/bucket-*.artifact; do case $f in *bucket-16.artifact) ;; *) rm $f;; esac; done
for i in 1 2 3 4 5 6; do
  COMPILED_ENGINE_CACHE_DIR=$W/full .venv/bin/python $HERE/start.py "$MODEL" "{$LIMITS, \"compile_policy\": \"background\"}" 2>/dev/null | tail -1 | sed 's/^/full /'
  rm -rf $W/partial; cp -r $W/partial-src $W/partial
  COMPILED_ENGINE_CACHE_DIR=$W/partial .venv/bin/python $HERE/start.py "$MODEL" "{$LIMITS, \"compile_policy\": \"background\"}" 2>/dev/null | tail -1 | sed 's/^/partial-with-dynamic /'
done
