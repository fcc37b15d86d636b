#!/usr/bin/env bash
# CTest `package`: install the build into a scratch prefix, build tests/package against it with
# find_package(sparsa), run it; then compile and link the same program through pkg-config.
set -euo pipefail
build=$1 src=$(cd "$(dirname "$0")" && pwd) work=$2
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/consumer" >/dev/null
"$work/consumer/consumer"
if command -v pkg-config >/dev/null; then
  pc=$(ls -d "$work"/prefix/lib*/pkgconfig | head -n 1)
  flags=$(PKG_CONFIG_PATH="$pc" pkg-config --cflags --libs sparsa)
  # shellcheck disable=SC2086
  c++ -std=c++20 "$src/consumer.cpp" -o "$work/consumer-pc" $flags
  "$work/consumer-pc"
fi
