#!/usr/bin/env bash
# llama.cpp, the anchor desktop users compare us with: built from the source that the llama-cpp-python sdist
# vendors (a bench tool, never an app dependency; pip is never asked to build the sdist).
#   bench/llamacpp.sh fetch DIR            here: download the sdist from PyPI's index and keep its vendored llama.cpp,
#                                          without its vocabulary test files, as DIR/llama.cpp-src.tar.gz
#   bench/llamacpp.sh build TARBALL DIR cuda|cpu
#                                          build llama-bench and llama-quantize into DIR/bin (CUDA: sm_90)
set -euo pipefail
VERSION=0.3.9  # vendors llama.cpp build 8733e0c
case "${1:-}" in
  fetch)
    dir=$2; mkdir -p "$dir"; tmp=$(mktemp -d)
    url=$(curl -sSf https://pypi.org/simple/llama-cpp-python/ | grep -o "https://[^\"#]*llama_cpp_python-$VERSION\.tar\.gz" | head -1)
    curl -sSf -o "$tmp/sdist.tar.gz" "$url"
    tar xzf "$tmp/sdist.tar.gz" -C "$tmp" "llama_cpp_python-$VERSION/vendor/llama.cpp"
    rm -rf "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp/models/"*.gguf* "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp/docs"
    tar czf "$dir/llama.cpp-src.tar.gz" -C "$tmp/llama_cpp_python-$VERSION/vendor" llama.cpp
    rm -rf "$tmp"; ls -la "$dir/llama.cpp-src.tar.gz" ;;
  build)
    tarball=$2 dir=$3 kind=$4; mkdir -p "$dir"
    [ -d "$dir/llama.cpp" ] || tar xzf "$tarball" -C "$dir"
    flags=(-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON)
    [ "$kind" = cuda ] && flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
    cmake -S "$dir/llama.cpp" -B "$dir/build" -G Ninja "${flags[@]}" > "$dir/cmake.log"
    cmake --build "$dir/build" --target llama-bench llama-quantize -j "$(nproc)" > "$dir/build.log"
    ls "$dir/build/bin" ;;
  *) echo "usage: bench/llamacpp.sh fetch DIR | build TARBALL DIR cuda|cpu" >&2; exit 2 ;;
esac
