#!/usr/bin/env bash
# Issue 42's GPU work, in device calls of under 10 minutes each (carry .whl: the gguf and mobilesam-mirror wheels).
#   tests: tests/test_gpu.py (every pipeline on the GPU, Qwen2.5-VL's graphs against transformers included)
#   mobile_sam: bench/mobile_sam_speed.py on the GPU (ours against the official code)
#   qwen_vl: bench/qwen_vl_gpu.py (Qwen2.5-VL-7B shapes: encode and decode against transformers, and our text chat)
source "$(dirname "$0")/device_steps.sh"
for part in "$@"; do
  case "$part" in
    tests) step 560 test_gpu python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -o faulthandler_timeout=120 ;;
    qwen_tests) step 200 test_gpu_qwen python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -k qwen_vl ;;
    mobile_sam) step 150 mobile_sam_gpu python3 bench/mobile_sam_speed.py --device cuda --repeats 20 ;;
    qwen_vl) step 420 qwen_vl_gpu python3 bench/qwen_vl_gpu.py ;;
  esac
done
