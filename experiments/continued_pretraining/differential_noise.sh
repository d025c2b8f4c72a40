#!/usr/bin/env bash
# Issue "V1 conversion 2", item 3: the differential V1 default (`v1cal`) against the additive start it replaced
# (`v1add`) and the Llama trained alike, on the tiny Llama: 3 seeds x 800 steps, held-out perplexity at 0/200/.../800,
# λ per layer, and measure.py's attention noise and second-text perplexity at step 0 and the end; the page
# docs/experiments/continued_pretraining_noise.md.
#
#   bash experiments/continued_pretraining/differential_noise.sh [WORKDIR]   # ~9 runs of 10-30 min on one core
#
# Resumable: one results file per seed (skipped when present), each run checkpointed every 100 steps.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-$HERE/../../.cpt-tiny}"
PY="${PYTHON:-python}"
for seed in 0 1 2; do
  [ -f "$HERE/results/differential_noise_s$seed.json" ] && continue
  "$PY" "$HERE/continued_pretraining.py" --models llama v1cal v1add --seeds "$seed" --steps 800 --eval-every 200 \
    --threads "${THREADS:-1}" --stem "differential_noise_s$seed" --workdir "$WORK/s$seed" --resume --save-every 100 \
    --docs "$WORK/pages"
done
"$PY" "$HERE/continued_pretraining.py" --merge "$HERE"/results/differential_noise_s{0,1,2}.json \
  --stem continued_pretraining_noise --note "${NOTE:-runs of one torch thread}"
