#!/usr/bin/env bash
# Builds the library and the BA-Att evidence driver, then runs the named experiments
# (sort, bound, compare, beta, cost) and writes one markdown file per experiment.
#   bench/ba_att/run_evidence.sh OUT_DIR LENS SEEDS HEADS EXPERIMENT...
#   e.g. bench/ba_att/run_evidence.sh results 4096,16384 0,1,2 8/2 sort bound
set -euo pipefail
out=$1 lens=$2 seeds=$3 heads=$4
shift 4
mkdir -p "$out"
cmake -S . -B build-evidence -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSA_TESTS=OFF -DSPARSA_CLI=OFF \
      -DSPARSA_CUDA=OFF >/dev/null
ninja -C build-evidence ba_att_evidence >/dev/null
nproc > "$out/machine.txt"
grep -m1 'model name' /proc/cpuinfo >> "$out/machine.txt" || true
for experiment in "$@"; do
  start=$(date +%s)
  ./build-evidence/bench/ba_att/ba_att_evidence --experiment "$experiment" --lens "$lens" --seeds "$seeds" \
      --heads "$heads" > "$out/$experiment.md" 2> "$out/$experiment.log"
  echo "$experiment: $(( $(date +%s) - start )) s" >> "$out/machine.txt"
done
