#!/usr/bin/env bash
# Runs curriculum stages of train_sdar.py one after another and exports the model after each,
# so a run stopped at any point leaves the last finished stage's model in RUN/export.
#
#   engines/dlm/train/stages.sh RUN "1:3 2:3 3:4 4:9" [train_sdar.py train flags...]
#
# Each "N:M" is stage N for M minutes (docs/eval.md, "The GPU sequence"). RUN must hold the
# tokenizer and config (`train_sdar.py tokenizer --run RUN`). Writes RUN/DONE at the end, or
# RUN/FAILED naming the stage whose call failed. Meant to run in the background on the GPU
# machine (setsid), its output in a log that later calls read.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
run=${1:?usage: stages.sh RUN "N:MINUTES ..." [train flags]}
plan=${2:?usage: stages.sh RUN "N:MINUTES ..." [train flags]}
shift 2
rm -f "$run/DONE" "$run/FAILED"
for item in $plan; do
  stage=${item%%:*}
  minutes=${item##*:}
  if ! python3 "$here/train_sdar.py" train --run "$run" --stage "$stage" --minutes "$minutes" "$@"; then
    echo "stage $stage" > "$run/FAILED"
    exit 1
  fi
  python3 "$here/train_sdar.py" export --run "$run" --out "$run/export.tmp" &&
    rm -rf "$run/export" && mv "$run/export.tmp" "$run/export"
done
date -u > "$run/DONE"
