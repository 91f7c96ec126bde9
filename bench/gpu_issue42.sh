#!/usr/bin/env bash
# Issue 42's GPU work, in device calls of under 10 minutes each (carry .whl: the gguf and mobilesam-mirror wheels).
#   tests: tests/test_gpu.py (every pipeline on the GPU, Qwen2.5-VL's graphs against transformers included)
#   mobile_sam: bench/mobile_sam_speed.py on the GPU (ours against the official code)
#   qwen_vl: bench/qwen_vl_gpu.py (Qwen2.5-VL-7B shapes: encode and decode against transformers, and our text chat)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
step() {  # step SECONDS NAME COMMAND...: run with a time limit, log to $OUT/NAME.log
  local limit=$1 name=$2
  shift 2
  echo "=== $name"
  timeout "$limit" "$@" 2>&1 | grep -v "it/s\]\|layer/s\]\|shard/s\]\|shape/s\]" | tee "$OUT/$name.log" | tail -40
}
for part in "$@"; do
  case "$part" in
    tests) step 400 test_gpu python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -o faulthandler_timeout=120 ;;
    qwen_tests) step 200 test_gpu_qwen python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -k qwen_vl ;;
    mobile_sam) step 150 mobile_sam_gpu python3 bench/mobile_sam_speed.py --device cuda --repeats 20 ;;
    qwen_vl) step 420 qwen_vl_gpu python3 bench/qwen_vl_gpu.py ;;
  esac
done
