#!/bin/bash
# A DiT experiment on the GPU machine over several `run` calls (docs/dit.md, "Running it"): the
# runs train at once as background processes, and each call watches them. Each call must follow
# the last within the machine's idle window, or the runs go with the machine; every call packs
# what exists (logs, tables, sample grids) into $OUT/dit.tar.gz, so a lost machine costs only the
# unfinished runs.
#
#   gpu-run.sh start SECONDS   build the extension (CUDA on; or take the carried .prebuilt of this
#                              tree, scripts/gpu-prebuild --dit), start every run (compiled; EXTRA:
#                              more flags), then watch
#   gpu-run.sh watch SECONDS   show the runs' last lines until SECONDS have passed or all ended;
#                              once all ended, each config's table of its finished runs (--table-only)
#
# Environment: RUNS, space-separated CONFIG:ATTENTION pairs (default: every attention of CONFIG,
# i.e. CONFIG:a for a in ATTENTION), so that runs of several configs share one machine; CONFIG
# (default medium_long), ATTENTION (default full,llsa), D (the root of the output directories, one
# per config; default build-gpu/dit), EXTRA, DEVICE (default cuda), BUILD (default 1; 0: use the
# sparsa package PYTHONPATH names, as when trying this script on a machine without a GPU).
set -u
export PYTHONUNBUFFERED=1
[ "${BUILD:-1}" = 1 ] && export PYTHONPATH=build-gpu/python
CONFIG=${CONFIG:-medium_long}
ATTENTION=${ATTENTION:-full,llsa}
D=${D:-build-gpu/dit}
if [ -z "${RUNS:-}" ]; then
  RUNS=""
  for a in ${ATTENTION//,/ }; do RUNS="$RUNS $CONFIG:$a"; done
fi
CONFIGS=$(for r in $RUNS; do echo "${r%%:*}"; done | sort -u)
for c in $CONFIGS; do
  [ -f "engines/dit/configs/$c.json" ] || { echo "RUNS: no config engines/dit/configs/$c.json" >&2; exit 2; }
done
T0=$(date +%s)

running() {  # the recorded process ids that are alive (no pattern match: it would match this script)
  local n=0
  for f in "$D"/*.pid; do [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && n=$((n + 1)); done
  echo $n
}

collect() {  # one archive: $OUT takes few files
  (cd "$D" && tar czf "$OUT/dit.tar.gz" --exclude='*.pt' --exclude='*.pid' $(ls -d *.log $CONFIGS 2>/dev/null))
}

watch() {
  while [ $(( $(date +%s) - T0 )) -lt "$1" ] && [ "$(running)" -gt 0 ]; do
    sleep 20
    echo "== $(( $(date +%s) - T0 )) s"
    for f in "$D"/*.log; do [ "$(basename "$f")" = cmake.log ] || echo "$(basename "$f" .log): $(grep "step\|Error" "$f" | tail -1)"; done
  done
  if [ "$(running)" -eq 0 ]; then
    echo "all runs ended"
    for c in $CONFIGS; do
      a=$(for r in $RUNS; do [ "${r%%:*}" = "$c" ] && echo "${r#*:}"; done | paste -sd,)
      python3 -m engines.dit.train --config "engines/dit/configs/$c.json" --attention "$a" \
        --table-only --out "$D/$c" 2>&1 | tail -12
    done
  fi
  collect
}

case "${1:-}" in
  start)
    mkdir -p "$D"
    # The extension: carried from this tree (scripts/gpu-prebuild --dit), else built here.
    [ "${BUILD:-1}" = 1 ] && { bash scripts/use-prebuilt _sparsa || { { cmake -S . -B build-gpu -G Ninja \
      -DCMAKE_BUILD_TYPE=Release -DSPARSA_CUDA=ON && cmake --build build-gpu --parallel "$(nproc)" --target _sparsa; } \
      > "$D/cmake.log" 2>&1 || { tail -30 "$D/cmake.log"; exit 1; }; }; echo "built in $(( $(date +%s) - T0 )) s"; }
    for r in $RUNS; do
      c=${r%%:*} a=${r#*:}
      mkdir -p "$D/$c"
      setsid nohup python3 -m engines.dit.train --config "engines/dit/configs/$c.json" --device "${DEVICE:-cuda}" \
        --attention "$a" --compile --out "$D/$c" ${EXTRA:-} > "$D/$c-$a.log" 2>&1 < /dev/null &
      echo $! > "$D/$c-$a.pid"
    done
    echo "started $RUNS at $(( $(date +%s) - T0 )) s"
    watch "${2:-560}" ;;
  watch) watch "${2:-570}" ;;
  *) echo "usage: engines/dit/gpu-run.sh start|watch SECONDS" >&2; exit 2 ;;
esac
