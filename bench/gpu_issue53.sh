#!/usr/bin/env bash
# Issue 53's GPU work in device calls of under 10 minutes each; logs and JSON land in $OUT.
#   launch:  bench/decode_limit.py --parts launch (a 7B int4 chat's first launch from float, from int4 on disk with
#            and without the release's tuned configs, second)
#   workers: the GPU test of kernels compiled in worker processes (plugins/compile_workers.py)
#   tests:   the engine's GPU tests that step plans, graph tables and speculation touch (the kernels' own and the
#            low-bit verify step's, whose compiles take minutes, left out)
#   chunked: bench/chunked_prefill.py (7 chats + a 4,000-token joiner; a 20-token prompt behind a 32k read)
#   tiles:   the GPU tests of prompt chunks' attention tiles (the graph table, batch-invariance, graphs = eager)
#   short:   the 32k read alone (part of `long`)
#   long:    a prompt chunk's attention per tile (bench/chunk_attention.py) and the 32k read in the long tile and
#            the short one (bench/chunked_prefill.py --short-only)
#   captures: the GPU tests of every CUDA graph capture (chat, the graph table and its retried captures, SAM,
#            MiniGPT-4, the split-K workspace never grown inside one; captures beside other threads' GPU work,
#            engines starting beside one replying) and of the weights read onto the GPU in pieces
#   decode:  bench/decode_limit.py --parts gemv,decode (the int4 decode step against its roofline)
#   spec7b:  bench/speculative.py --parts engine7b on the real replies' draft patterns (recorded on the CPU)
#   invariant: batch-invariant mode: its kernels (bench/invariant_kernels.py), its GPU test beside the engine tests
#            that share the attention's workspaces, and chunked prefill alone = together (--invariant-only)
source "$(dirname "$0")/device_steps.sh"
for part in "$@"; do
  case "$part" in
    launch) step 330 launch python3 bench/decode_limit.py --parts launch --out decode_limit_launch ;;
    workers) step 200 test_gpu_workers python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -k "worker_processes or compile_ahead_not_in" ;;
    tests) step 300 test_gpu python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider -o faulthandler_timeout=200 \
             -k "speculation_on_gpu or graph_table or two_engines or sampling_kernels or chat_on_gpu_graphs or quantized_chat_graphs or draft_model_on_the_gpu" ;;
    captures) step 300 test_gpu_captures python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider \
                -k "chat_on_gpu_graphs or graph_table or segment_on_gpu or minigpt4 or quantized_chat_graphs or capture_that_fails or in_pieces or split_k_workspace or capture_holds or tune_and_capture or two_engines" ;;
    decode) step 240 decode_limit python3 bench/decode_limit.py --parts gemv,decode ;;
    chunked) step 330 chunked_prefill python3 bench/chunked_prefill.py ;;
    long) step 150 chunk_attention python3 bench/chunk_attention.py
          step 200 chunked_short python3 bench/chunked_prefill.py --short-only ;;
    short) step 200 chunked_short python3 bench/chunked_prefill.py --short-only ;;
    tiles) step 150 test_gpu_tiles python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider \
             -k "batch_invariant or graph_table or chunk or chat_on_gpu_graphs" ;;
    invariant) step 100 invariant_kernels python3 bench/invariant_kernels.py
               step 200 test_gpu_invariant python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider \
                 -k "batch_invariant or graph_table or two_engines or speculation_on_gpu"
               step 250 chunked_invariant python3 bench/chunked_prefill.py --invariant-only --seed "${SEED:-0}" ;;
    spec7b) step 300 spec7b python3 bench/speculative.py --parts engine7b \
              --real-json bench/results/speculative_real_replies_cpu_2026-11-28.json --seed 0 --no-ceiling \
              --modes "${MODES:-none,int4,int4:fast}" --out "$OUT/speculative_engine7b.json" ;;
  esac
done
