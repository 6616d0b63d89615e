#!/usr/bin/env bash
# The standing GPU figures and the ragged-batch benchmarks in one lent-device call, most wanted
# first, each part under its own time limit so one slow part cannot take the others' time.
# Writes each part's output to $OUT/<part>.log (or ./gpu-session/ without $OUT).
#
#   bash benchmarks/gpu_session.sh [seconds for the whole run, default 560]
#
# On the device image (jax 0.11.x, no tyro/grain/pebble/tensorboardX), carry wheels of those in
# .whl/ (see the device notes); they are installed to /tmp/site first when .whl/ exists.
set -u
TOTAL=${1:-560}
OUT=${OUT:-gpu-session}
mkdir -p "$OUT"
START=$(date +%s)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
  python3 -c "import jax; print(jax.__version__, jax.devices())"; git log -1 --format=%h 2>/dev/null
} > "$OUT/env.log" 2>&1

part() {  # part NAME SECONDS COMMAND...: run under the smaller of SECONDS and the time left
  local name=$1 limit=$2; shift 2
  local left=$((TOTAL - ($(date +%s) - START) - 5))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then echo "$name: skipped, ${left}s left" | tee -a "$OUT/env.log"; return; fi
  echo "== $name (limit ${limit}s)"
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -h '^{' "$OUT/$name.log" | cut -c1-400
  echo "$name: rc $rc, $(($(date +%s) - t0)) s" | tee -a "$OUT/env.log"
}

part decode 150 python3 benchmarks/gpu.py --only decode,long_prompt
part packed 130 python3 benchmarks/packed_update.py --model-shape smollm-135m --dtype bfloat16 --runs 3
part stream 60 python3 benchmarks/stream_attention.py --dtype bfloat16 --blocks 64,128,256
part levers 130 python3 benchmarks/gpu_levers.py --variants pallas
part ragged 80 python3 benchmarks/ragged_rollout.py --runs 2 --compactions 0 3 6 --partial
part profile 80 python3 benchmarks/gpu_profile.py decode
