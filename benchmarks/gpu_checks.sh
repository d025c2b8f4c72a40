#!/bin/bash
# What a lent GPU runs (issue 48 "Speed 3"; H100 or H200), in two device calls. The first (about 6 minutes): the fused
# V1 model's and convert --device's CUDA tests, one FSDP2 training step of 1B-shaped Llama, V1 and V2 (fsdp_step.log),
# bench_gpu.py's eager training, prefill and decoding for Llama, DiffLlama, V1 (sdpa and diff_triton) and V2, and the
# census's predictions (benchmarks/results/census.json, counted on any machine) beside the measured ratios. The second,
# PART=compiled (about 8 minutes): bench_gpu.py's compiled training and decoding (decode_static: generate --compile's
# static cache + fullgraph compile, CUDA graphs), which one call cannot also hold. Each step has its own time limit,
# so a slow one cannot eat the next, and bench_gpu.py's --time-budget records what did not fit as "skipped: time
# budget" (it assumes 90 s per compile until one is timed). Everything goes under $OUT, at most 8 files (what one
# device call brings back): summary.txt, the steps' logs, census_vs_measured.txt and bench/results_gpu.{json,md}.
# Run from the repository root:
#     OUT=/tmp/gpu bash benchmarks/gpu_checks.sh
#     OUT=/tmp/gpu PART=compiled bash benchmarks/gpu_checks.sh
# Environment: PART, TESTS_S, FSDP_S, BENCH_S, COMPILE_S (step limits, seconds), REPS, MODELS; SWEEP=1 adds the
# kernel's launch sweep at head_dim 64 and 128 (4 more files and ~3 minutes: leave other steps out then).
# Wheels the GPU image lacks (this package pins transformers, peft and tokenizers; the image's huggingface_hub 1.x
# suffices) travel in .whl/ (see docs/development.md).
set -u
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT/bench"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src:. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    date -u
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
step() {  # step NAME SECONDS COMMAND...: one log per step, its exit status in summary.txt
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? ${limit}s-limit took=$((SECONDS - start))s" | tee -a "$OUT/summary.txt"
    tail -5 "$OUT/$name.log"
}
BENCH=(python3 benchmarks/bench_gpu.py --models "${MODELS:-llama,diffllama,v1,v2}" --backends sdpa,diff_triton
    --reps "${REPS:-3}" --out-dir "$OUT/bench")
if [ "${PART:-eager}" = compiled ]; then
    # The second call: training under torch.compile and decoding as generate --compile runs it (static cache,
    # fullgraph, CUDA graphs), each configuration compiled once or twice (~40-70 s each on an H200).
    COMPILE_S=${COMPILE_S:-480}
    step bench_compile "$COMPILE_S" "${BENCH[@]}" --sections train_compile,decode_static --overwrite \
        --compile-configs llama/sdpa,v2/sdpa,v1/sdpa,v1/diff_triton --time-budget $((COMPILE_S - 30))
else
    # and convert --device cuda: V1's calibration and --verify on the GPU (tests/conversion/test_device.py); the
    # fused V1's compiled training step and generate --compile (two inductor compiles and a CUDA-graph capture)
    step tests "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -k cuda tests/kernels/test_fused_model.py \
        tests/conversion/test_device.py
    # One FSDP2 training step (fully_shard per layer + root, bf16 MixedPrecisionPolicy, AdamW) of 1B-shaped Llama, V1
    # and V2, tokens/s and the ratio to Llama in the same run (issue 54); its JSON is printed into fsdp_step.log.
    step fsdp_step "${FSDP_S:-120}" python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
        benchmarks/bench_fsdp_step.py --out /tmp/fsdp_step.json --print-json
    # Eager training, prefill and decoding.
    BENCH_S=${BENCH_S:-210}
    step bench "$BENCH_S" "${BENCH[@]}" --sections train,prefill,decode --overwrite --time-budget $((BENCH_S - 30))
fi
if [ "${SWEEP:-0}" = 1 ]; then
    step sweep64 100 python3 benchmarks/bench_kernel.py --sweep --head-dim 64 --out "$OUT/kernel64.json"
    step sweep128 100 python3 benchmarks/bench_kernel.py --sweep --head-dim 128 --out "$OUT/kernel128.json"
fi
# The census (ops per decoder layer on the GPU's code path) predicts launch-bound ratios: tokens/s x Llama of an eager
# batch-1 decode step ~ Llama's ops / the model's. Beside it, what was measured (ratio to Llama's best backend, SDPA,
# in the same run, as on docs/performance.md).
python3 - "$OUT/bench/results_gpu.json" benchmarks/results/census.json > "$OUT/census_vs_measured.txt" 2>&1 <<'EOF'
import json, os, sys

measured = json.load(open(sys.argv[1]))["summary"] if os.path.exists(sys.argv[1]) else {}
census = json.load(open(sys.argv[2]))["results"]
llama = census["llama/sdpa"]
rows = [("decode", "decode_b1_dynamic", "launch-bound: the census's prediction"),
        ("decode", "decode_b1_static", "CUDA graphs replay the launches: not launch-bound"),
        ("train", "train", "compute-bound: ops are launches, not time"),
        ("train", "train_compile", "compiled: inductor fuses ops"),
        ("prefill", "prefill_4096", "latency ratio; compute-bound")]
print("| config | census phase | ops/layer | predicted x Llama | measured metric | measured x Llama | note |")
print("|---|---|---|---|---|---|---|")
for config, counts in census.items():
    if config == "llama/sdpa" or "error" in counts:
        continue
    for phase, metric, note in rows:
        ops, ref = counts[phase]["ops"], llama[phase]["ops"]
        predicted = ops / ref if phase == "prefill" else ref / ops
        row = measured.get(metric, {}).get(config)
        got = f"{row['ratio_llama_best']:.2f}" if row and row.get("ratio_llama_best") is not None else "not measured"
        print(f"| {config} | {phase} | {ops} (Llama {ref}) | {predicted:.2f} | {metric} | {got} | {note} |")
EOF
echo "census rc=$?" | tee -a "$OUT/summary.txt"
cat "$OUT/census_vs_measured.txt"
