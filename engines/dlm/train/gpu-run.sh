#!/bin/bash
# The small DLM's training on the GPU machine, one `run` call at a time (docs/eval.md, "The GPU
# sequence"). Each call must follow the last within the machine's idle window, or the run
# directory under build/ goes with the machine; every call copies the latest export to $OUT,
# so a lost machine costs at most one stage (a new run continues from it with INIT).
#
#   gpu-run.sh start SECONDS    build the CLI, make the run (a new tokenizer, or INIT's), start
#                               PLAN in the background (EXTRA: more train flags), then watch
#   gpu-run.sh watch SECONDS    tail the log until SECONDS have passed or training ends
#   gpu-run.sh eval  ARGS...    sparsa eval-model on the run's export (ARGS: its flags); with
#                               BACKEND=cuda on the GPU (dense and BA-Att cells), through
#                               gpu-check's CUDA CLI (build-gpu) or one built in build-gpu-cli
#
# Environment: PLAN (e.g. 0:6,3:4,4:7), EXTRA, INIT (an export directory carried in the working
# tree, with run.json beside it), R (the run directory; default build/runs/sdar-ruler), BACKEND
# (eval: cpu, the default, cuda or cuda:N).
set -u
export PYTHONUNBUFFERED=1
R=${R:-build/runs/sdar-ruler}
HERE=engines/dlm/train

watch() {
  local end=$(( $(date +%s) + $1 ))
  while [ "$(date +%s)" -lt $end ]; do
    sleep 30
    echo "== $(date +%T)"
    grep "step\|warm-up\|stage\|Error" $R/train.log | grep -v Deprecation | tail -2
    if ! pgrep -f "train_sdar.py train --run $R" > /dev/null; then echo "training process ended"; break; fi
  done
  cp $R/train.log "$OUT/" 2>/dev/null
  if [ -d $R/export ]; then
    cp $R/export/*.safetensors "$OUT/"
    tar czf "$OUT/rest.tgz" -C $R export/config.json export/tokenizer.json export/training.json \
      $(cd $R && ls export/*.index.json log.jsonl run.json tokenizer.json 2>/dev/null)
  fi
  grep -E "warm-up|stage .* done|exported|initialised|Error" $R/train.log | tail -20
}

case "${1:-}" in
  start)
    t0=$(date +%s)
    mkdir -p $R
    { cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSA_CUDA=OFF -DSPARSA_TESTS=OFF \
        -DSPARSA_BENCH=OFF -DSPARSA_PYTHON=OFF && cmake --build build --parallel 16 --target sparsa_cli; } \
      > $R/cmake.log 2>&1 || { tail -30 $R/cmake.log; exit 1; }
    echo "CLI built in $(( $(date +%s) - t0 )) s"
    init=()
    if [ -n "${INIT:-}" ]; then
      cp "$INIT/../run.json" "$INIT/tokenizer.json" $R/ || exit 1
      init=(--init "$INIT")
    else
      python3 $HERE/train_sdar.py tokenizer --run $R || exit 1
    fi
    setsid nohup python3 $HERE/train_sdar.py train --run $R "${init[@]}" --plan "$PLAN" ${EXTRA:-} \
      --export $R/export --gen-threads 12 > $R/train.log 2>&1 < /dev/null &
    echo "started --plan $PLAN ${EXTRA:-} ${INIT:+from $INIT} at $(( $(date +%s) - t0 )) s"
    watch "$2" ;;
  watch) watch "$2" ;;
  eval)
    shift
    if [ "${BACKEND:-cpu}" = cpu ]; then
      build/tools/sparsa eval-model --model $R/export --threads 16 "$@"
    else
      # gpu-check's CLI when it has built one; else one of its own (a directory of its own, so
      # that its cache, without tests, never becomes gpu-check's)
      cli=build-gpu/tools/sparsa
      if [ ! -x $cli ]; then
        cli=build-gpu-cli/tools/sparsa
        { cmake -S . -B build-gpu-cli -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSA_CUDA=ON -DSPARSA_TESTS=OFF \
            -DSPARSA_BENCH=OFF -DSPARSA_PYTHON=OFF && cmake --build build-gpu-cli --parallel 16 --target sparsa_cli; } \
          > $R/cmake-gpu.log 2>&1 || { tail -30 $R/cmake-gpu.log; exit 1; }
      fi
      $cli eval-model --model $R/export --backend "$BACKEND" --threads 16 "$@"
    fi ;;
  *) echo "usage: gpu-run.sh start|watch SECONDS, or gpu-run.sh eval ARGS" >&2; exit 2 ;;
esac
