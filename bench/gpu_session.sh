#!/usr/bin/env bash
# Issue 10's GPU checks in two device calls of under 10 minutes each (the device tool's limit):
#   part 1: tests/test_gpu.py, bench/resident_memory.py, bench/sam_big_photo.py
#   part 2: bench/llm_quant.py, bench/quant_gemv.py
# Carry gemlite as a wheel in .whl/ (see ../.library/device/README.md); logs and JSON land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
step() {  # step SECONDS NAME COMMAND...: run with a time limit, log to $OUT/NAME.log
  local limit=$1 name=$2
  shift 2
  echo "=== $name"
  timeout "$limit" "$@" 2>&1 | grep -v "it/s\]\|layer/s\]\|shard/s\]" | tee "$OUT/$name.log" | tail -40
}
case "${1:-1}" in
  1)
    step 150 test_gpu python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider
    step 260 resident_memory python3 bench/resident_memory.py
    step 90 sam_big_photo python3 bench/sam_big_photo.py
    ;;
  2)
    step 330 llm_quant python3 bench/llm_quant.py
    step 180 quant_gemv python3 bench/quant_gemv.py
    ;;
esac
