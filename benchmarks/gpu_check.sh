#!/usr/bin/env bash
# Every GPU measurement in one go (one NVIDIA H200, ~139 GiB): a bf16 matmul peak via JAX,
# then benchmarks/throughput.py at Gemma-2B shape with random bf16 weights for each
# algorithm script present. Writes JSON lines to $OUT (matmul.json, throughput.jsonl, log).
# Runs in the repository root; needs well under 8 minutes (it stops starting new runs at
# $BUDGET_S seconds). Packages the device image lacks (keras, keras-hub, tyro, ...) travel
# as wheels in .whl/ (see benchmarks/RESULTS.md for the download command).
#   bash benchmarks/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
BUDGET_S=${BUDGET_S:-390}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
start=$(date +%s)

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 TF_CPP_MIN_LOG_LEVEL=3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, keras, keras_hub, optax, tyro; print('jax', jax.__version__, jax.devices(), 'keras', keras.__version__, 'keras_hub', keras_hub.__version__)" \
  || { echo "imports failed"; exit 1; }

# Device-to-device bf16 matmul peak through JAX: the ceiling MFU is read against (989 TFLOP/s datasheet).
python3 - "$OUT/matmul.json" <<'EOF'
import json, sys, time
import jax, jax.numpy as jnp
n = 8192
a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
f = jax.jit(lambda x, y: x @ y)
for _ in range(3):
    f(a, b).block_until_ready()
reps = 20
t = time.perf_counter()
for _ in range(reps):
    out = f(a, b)
out.block_until_ready()
dt = (time.perf_counter() - t) / reps
row = {"what": "bf16 matmul 8192^3", "device": jax.devices()[0].device_kind, "tflops": 2 * n**3 / dt / 1e12,
       "ms": dt * 1e3}
print(json.dumps(row))
json.dump(row, open(sys.argv[1], "w"))
EOF

# algo  batch (examples; a pair counts once)  max-length. Sized for ~139 GiB without remat.
runs="sft 8 1024
dpo 4 1024
simpo 4 1024
orpo 4 1024
reward 4 1024
ppo 8 512"
while read -r algo bs len; do
  [ -f "$algo.py" ] || { echo "skip $algo: $algo.py not in the repo"; continue; }
  left=$(( BUDGET_S - ($(date +%s) - start) ))
  if [ "$left" -lt 60 ]; then echo "skip $algo: ${left}s left of the ${BUDGET_S}s budget"; continue; fi
  echo "== $algo batch $bs length $len (${left}s left)"
  timeout "$left" python3 benchmarks/throughput.py --algo "$algo" --model gemma_2b --random-init \
    --dtype bfloat16 --batch-size "$bs" --max-length "$len" --steps 5 --warmup 2 --remat off > "/tmp/$algo.out" 2>&1
  rc=$?
  if [ $rc -ne 0 ] && grep -q "RESOURCE_EXHAUSTED\|Out of memory" "/tmp/$algo.out"; then
    left=$(( BUDGET_S - ($(date +%s) - start) ))
    echo "$algo: out of memory; again with --remat on (${left}s left)"
    [ "$left" -ge 60 ] && timeout "$left" python3 benchmarks/throughput.py --algo "$algo" --model gemma_2b \
      --random-init --dtype bfloat16 --batch-size "$bs" --max-length "$len" --steps 5 --warmup 2 --remat on \
      > "/tmp/$algo.out" 2>&1
    rc=$?
  fi
  if [ $rc -eq 0 ]; then tail -n 1 "/tmp/$algo.out" | tee -a "$OUT/throughput.jsonl"
  else tail -n 25 "/tmp/$algo.out"; echo "$algo failed (rc $rc)"; fi
done <<< "$runs"
echo "total $(( $(date +%s) - start ))s"
