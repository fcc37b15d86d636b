#!/bin/bash
# A DiT experiment on the GPU machine over several `run` calls (docs/dit.md, "Running it"): the
# attentions train at once as background processes, and each call watches them. Each call must
# follow the last within the machine's idle window, or the runs go with the machine; every call
# copies what exists (logs, tables, sample grids) to $OUT, so a lost machine costs only the
# unfinished runs.
#
#   gpu-run.sh start SECONDS   build the extension (CUDA on), start every attention of CONFIG
#                              (compiled; EXTRA: more flags), then watch
#   gpu-run.sh watch SECONDS   show the runs' last lines until SECONDS have passed or all ended;
#                              once all ended, the table of the finished runs (--table-only)
#
# Environment: CONFIG (default medium_long), ATTENTION (default full,llsa), D (the output
# directory; default build-gpu/dit/CONFIG), EXTRA, DEVICE (default cuda), BUILD (default 1; 0:
# use the sparsa package PYTHONPATH names, as when trying this script on a machine without a GPU).
set -u
export PYTHONUNBUFFERED=1
[ "${BUILD:-1}" = 1 ] && export PYTHONPATH=build-gpu/python
CONFIG=${CONFIG:-medium_long}
ATTENTION=${ATTENTION:-full,llsa}
D=${D:-build-gpu/dit/$CONFIG}
T0=$(date +%s)

running() {  # the recorded process ids that are alive (no pattern match: it would match this script)
  local n=0
  for f in "$D"/*.pid; do [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && n=$((n + 1)); done
  echo $n
}

collect() {
  cp "$D"/*.log "$OUT/" 2>/dev/null
  for r in "$D"/*-seed*; do
    [ -d "$r" ] || continue
    for f in log.csv summary.json samples.png; do
      [ -f "$r/$f" ] && cp "$r/$f" "$OUT/$(basename "$r")-$f"
    done
  done
  for f in results.md results.json compare.png compare.txt; do [ -f "$D/$f" ] && cp "$D/$f" "$OUT/"; done
}

watch() {
  while [ $(( $(date +%s) - T0 )) -lt "$1" ] && [ "$(running)" -gt 0 ]; do
    sleep 20
    echo "== $(( $(date +%s) - T0 )) s"
    for f in "$D"/*.log; do grep "step\|Error" "$f" | tail -1; done
  done
  if [ "$(running)" -eq 0 ]; then
    echo "all runs ended"
    python3 -m engines.dit.train --config "engines/dit/configs/$CONFIG.json" --attention "$ATTENTION" \
      --table-only --out "$D" 2>&1 | tail -12
  fi
  collect
}

case "${1:-}" in
  start)
    mkdir -p "$D"
    [ "${BUILD:-1}" = 1 ] && { { cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSA_CUDA=ON && \
      cmake --build build-gpu --parallel "$(nproc)" --target _sparsa; } > "$D/cmake.log" 2>&1 \
      || { tail -30 "$D/cmake.log"; exit 1; }; echo "built in $(( $(date +%s) - T0 )) s"; }
    for a in ${ATTENTION//,/ }; do
      setsid nohup python3 -m engines.dit.train --config "engines/dit/configs/$CONFIG.json" --device "${DEVICE:-cuda}" \
        --attention "$a" --compile --out "$D" ${EXTRA:-} > "$D/$a.log" 2>&1 < /dev/null &
      echo $! > "$D/$a.pid"
    done
    echo "started $ATTENTION at $(( $(date +%s) - T0 )) s"
    watch "${2:-560}" ;;
  watch) watch "${2:-570}" ;;
  *) echo "usage: engines/dit/gpu-run.sh start|watch SECONDS" >&2; exit 2 ;;
esac
