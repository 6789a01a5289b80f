#!/bin/bash
# Warm start ("LLM() to ready") before vs after, interleaved, in fresh processes (docs/performance.md, #18).
#   scripts/warm_start/run.sh BEFORE_WORKTREE AFTER_WORKTREE OUT_DIR [all]
# Each worktree needs its own .venv (`make setup`). Each side gets its own cache, filled by one cold
# process ("all": every bucket, as `compiled-engine warmup` leaves it; else what one 1-token request
# builds); then before / after (blocking) / after (background) alternate, 6 rounds each. One JSON
# line per process, prefixed by its side; medians: scripts/warm_start/medians.py OUT_DIR/rounds.txt
set -e
BEFORE=$1; AFTER=$2; W=$3; FILL=${4:-}
HERE=$(cd "$(dirname "$0")" && pwd)
MODEL=$("$AFTER/.venv/bin/python" -c "from bench.models import tiny_test_model_dir; print(tiny_test_model_dir())" 2>/dev/null)
LIMITS='"max_model_len": 512, "max_num_seqs": 256, "max_num_batched_tokens": 4096, "num_kv_blocks": 8192, "block_size": 16'
unset TORCHINDUCTOR_CACHE_DIR COMPILED_ENGINE_COMPILE_POLICY
export TQDM_DISABLE=1
mkdir -p "$W"; rm -rf "$W/cache-before" "$W/cache-after" "$W/cache-after-bg"
run() { # side worktree cache kwargs [all]
  (cd "$2" && COMPILED_ENGINE_CACHE_DIR=$3 .venv/bin/python "$HERE/start.py" "$MODEL" "$4" $5 2>/dev/null | tail -1 | sed "s/^/$1 /")
}
{
  run fill-before "$BEFORE" "$W/cache-before" "{$LIMITS}" $FILL
  run fill-after "$AFTER" "$W/cache-after" "{$LIMITS, \"compile_policy\": \"blocking\"}" $FILL
  cp -r "$W/cache-after" "$W/cache-after-bg"
  for _ in 1 2 3 4 5 6; do
    run before "$BEFORE" "$W/cache-before" "{$LIMITS}"
    run after-blocking "$AFTER" "$W/cache-after" "{$LIMITS, \"compile_policy\": \"blocking\"}"
    run after-background "$AFTER" "$W/cache-after-bg" "{$LIMITS, \"compile_policy\": \"background\"}"
  done
} | tee "$W/rounds.txt"
