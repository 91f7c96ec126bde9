#!/usr/bin/env bash
# Issue 53's GPU work in device calls of under 10 minutes each; logs and JSON land in $OUT.
#   launch:  bench/decode_limit.py --parts launch (a 7B int4 chat's first launch from float, from int4 on disk, second)
#   tests:   the engine's GPU tests (tests/test_gpu.py, SAM's, MiniGPT-4's and the kernels' own left out)
#   chunked: bench/chunked_prefill.py (7 chats + a 4,000-token joiner; a 20-token prompt behind a 32k read)
#   spec7b:  bench/speculative.py --parts engine7b on the real replies' draft patterns (recorded on the CPU)
source "$(dirname "$0")/device_steps.sh"
for part in "$@"; do
  case "$part" in
    launch) step 420 launch python3 bench/decode_limit.py --parts launch --out decode_limit_launch ;;
    tests) step 420 test_gpu python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -o faulthandler_timeout=120 \
             -k "not segment and not minigpt4 and not overlay and not lowbit_kernels and not fused_kernels and not rope_and_kv and not streams_of" ;;
    chunked) step 330 chunked_prefill python3 bench/chunked_prefill.py ;;
    spec7b) step 300 spec7b python3 bench/speculative.py --parts engine7b \
              --real-json bench/results/speculative_real_replies_cpu_2026-11-28.json --seed 0 --no-ceiling \
              --modes "${MODES:-none,int4,int4:fast}" --out "$OUT/speculative_engine7b.json" ;;
  esac
done
