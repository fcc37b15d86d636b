#!/usr/bin/env bash
# Builds and runs the DLM engine's libFuzzer harnesses (config.json, tokenizer.json,
# model.safetensors.index.json) with clang++-14 -fsanitize=fuzzer,address, each for
# $DLM_FUZZ_SECONDS seconds (default 20) from its committed seed corpus in dlm_corpus/.
# Usage: tests/fuzz/dlm_fuzz.sh [build-dir]   (exit 0: no crash found)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$root/build-fuzz-dlm}
seconds=${DLM_FUZZ_SECONDS:-20}
CXX=${CXX_FUZZ:-clang++-14}
mkdir -p "$out"
flags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -I"$root/include" -I"$root/engines/dlm" -I"$root/src")
declare -A sources=(
  [config]="$root/engines/dlm/config.cpp"
  [tokenizer]="$root/engines/dlm/tokenizer.cpp"
  [index]="$root/engines/dlm/safetensors_index.cpp"
)
for name in config tokenizer index; do
  bin="$out/dlm_${name}_fuzz"
  "$CXX" "${flags[@]}" "$here/dlm_${name}_fuzz.cpp" ${sources[$name]} "$root/src/core/status.cpp" -o "$bin"
  work="$out/corpus_$name"
  mkdir -p "$work"
  echo "dlm_fuzz: $name for ${seconds}s"
  "$bin" -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 -print_final_stats=0 \
         "$work" "$here/dlm_corpus/$name" 2>&1 | tail -n 3
done
echo "dlm_fuzz: no crash"
