#!/bin/bash
# What a lent GPU runs in one device call ("GPU checks" issues): the CUDA tests, the fused kernel's launch sweep at
# head_dim 64 and 128, and the ~1B-shape benchmark. Everything goes under $OUT (logs, JSON); each step has its own
# time limit so that a slow one cannot eat the next. Run from the repository root:
#     OUT=/tmp/gpu bash benchmarks/gpu_checks.sh
# Wheels the GPU image lacks (this package pins transformers and peft) travel in .whl/ (see DEVELOPERS.md).
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
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
step() {  # step NAME SECONDS COMMAND...: one log per step, its exit status in status.txt
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? ${limit}s-limit took=$((SECONDS - start))s" | tee -a "$OUT/status.txt"
    tail -5 "$OUT/$name.log"
}
step tests "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -n 4 -k cuda \
    tests/kernels tests/training/test_peft.py tests/training/test_train.py
step sweep64 "${SWEEP_S:-100}" python3 benchmarks/bench_kernel.py --sweep --head-dim 64 --out "$OUT/kernel64.json"
step sweep128 "${SWEEP_S:-100}" python3 benchmarks/bench_kernel.py --sweep --head-dim 128 --out "$OUT/kernel128.json"
step bench "${BENCH_S:-230}" python3 benchmarks/bench_gpu.py --sections "${SECTIONS:-attention,train,prefill,decode}" \
    --models llama,diffllama,v1,v2 --backends sdpa,diff_triton --reps 3 --time-budget "${BENCH_BUDGET:-170}" \
    --out-dir "$OUT/bench"
