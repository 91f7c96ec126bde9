#!/usr/bin/env bash
# Issue 17's GPU work in device calls of under 10 minutes each (the device tool's limit):
#   probe:  bench/quant_gemv.py (our kernel's config sweep against cuBLAS, gemlite, tinygemm), the decode step
#   decode: bench/decode_limit.py --parts gemv,decode ; launch: --parts launch ; tests: tests/test_gpu.py
#   structured: bench/grammar_libraries.py (the host side) and bench/structured_decode.py (issue 21)
# Carry gemlite as a wheel in .whl/ (see ../.library/device/README.md); logs and JSON land in $OUT.
source "$(dirname "$0")/device_steps.sh"
for part in "$@"; do
  case "$part" in
    probe) step 250 quant_gemv python3 bench/quant_gemv.py ;;
    decode) step 230 decode_limit python3 bench/decode_limit.py --parts gemv,decode ;;
    launch) step 200 launch python3 bench/decode_limit.py --parts real,launch --out decode_limit_launch ;;
    tests) step 150 test_gpu python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider ;;
    structured) step 150 grammar_libraries python3 bench/grammar_libraries.py --vocab .whl/qwen.tiktoken
                step 300 structured_decode python3 bench/structured_decode.py --vocab .whl/qwen.tiktoken ;;
  esac
done
