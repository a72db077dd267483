#!/usr/bin/env bash
# Every GPU measurement in one go (one NVIDIA H200, ~139 GiB): a bf16 matmul peak via JAX, the
# long-tail benchmark (benchmarks/longtail.py: run-wide padding vs length buckets vs buckets +
# --group-by-length, sft at Gemma-2B shape), then benchmarks/throughput.py at Gemma-2B shape with
# random bf16 weights for each algorithm script present (grpo included). Writes JSON lines to $OUT
# (matmul.json, longtail.jsonl, throughput.jsonl, log). Runs in the repository root; needs well
# under 8 minutes (it stops starting new runs at $BUDGET_S seconds). Packages the device image
# lacks (keras, keras-hub, tyro, ...) travel as wheels in .whl/ (see benchmarks/RESULTS.md).
#   bash benchmarks/gpu_check.sh
# SMOKE=1: the same commands on CPU at `tiny` shape (one decoder block, float32, short sequences),
# to check the script itself in a few minutes; PY picks the interpreter (default python3);
# PARTS="longtail throughput" (any of matmul, longtail, throughput) runs only those.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
BUDGET_S=${BUDGET_S:-450}
PARTS=${PARTS:-matmul longtail throughput}
want() { [[ " $PARTS " == *" $1 "* ]]; }
PY=${PY:-python3}
if [ -n "${SMOKE:-}" ]; then  # CPU: tiny shapes, every length / size cut down
  MODEL="--model tiny --random-init --num-layers 1 --dtype float32"; MATMUL_N=256; SCALE=32
  LONGTAIL="--lengths lognormal:8,48 --max-length 48 --num-examples 64 --steps 2"
else
  MODEL="--model gemma_2b --random-init --dtype bfloat16"; MATMUL_N=8192; SCALE=1
  LONGTAIL="--lengths lognormal:128,1024 --max-length 1024 --steps 30 --num-layers 4"  # 4 of 18 blocks: compiles
fi
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
start=$(date +%s)

if [ -z "${SMOKE:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 TF_CPP_MIN_LOG_LEVEL=3 KERAS_BACKEND=jax  # keras: else TensorFlow
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import jax, keras, keras_hub, optax, tyro; print('jax', jax.__version__, jax.devices(), 'keras', keras.__version__, 'keras_hub', keras_hub.__version__)" \
  || { echo "imports failed"; exit 1; }

# Device-to-device bf16 matmul peak through JAX: the ceiling MFU is read against (989 TFLOP/s datasheet).
want matmul && $PY - "$OUT/matmul.json" "$MATMUL_N" <<'EOF'
import json, sys, time
import jax, jax.numpy as jnp
n = int(sys.argv[2])
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
row = {"what": f"bf16 matmul {n}^3", "device": jax.devices()[0].device_kind, "tflops": 2 * n**3 / dt / 1e12,
       "ms": dt * 1e3}
print(json.dumps(row))
json.dump(row, open(sys.argv[1], "w"))
EOF

# Long-tailed lengths (median 128, p99 1024 = 8x the median), batch 8, Gemma-2B shape: one process,
# three modes side by side; each mode compiles once per bucket it meets (timed apart).
if want longtail; then
  left=$(( BUDGET_S - ($(date +%s) - start) ))
  echo "== longtail sft (${left}s left)"
  timeout "$(( left < 240 ? left : 240 ))" $PY benchmarks/longtail.py --algo sft $MODEL $LONGTAIL --batch-size 8 \
    --remat off > /tmp/longtail.out 2> /tmp/longtail.err
  rc=$?
  if [ $rc -eq 0 ]; then tail -n 3 /tmp/longtail.out | tee -a "$OUT/longtail.jsonl"
  else tail -n 25 /tmp/longtail.err; echo "longtail failed (rc $rc)"; fi
fi

# algo  batch (examples; a pair counts once)  max-length. Sized for ~139 GiB without remat.
# grpo: 16 completions = 2 prompts x G 8, prompt 256 + response 256.
runs="sft 8 1024
grpo 16 512
dpo 4 1024
simpo 4 1024
orpo 4 1024
reward 4 1024
ppo 8 512"
while want throughput && read -r algo bs len; do
  [ -f "$algo.py" ] || { echo "skip $algo: $algo.py not in the repo"; continue; }
  left=$(( BUDGET_S - ($(date +%s) - start) ))
  if [ "$left" -lt 60 ]; then echo "skip $algo: ${left}s left of the ${BUDGET_S}s budget"; continue; fi
  len=$(( len / SCALE ))
  echo "== $algo batch $bs length $len (${left}s left)"
  timeout "$left" $PY benchmarks/throughput.py --algo "$algo" $MODEL \
    --batch-size "$bs" --max-length "$len" --steps 5 --warmup 2 --remat off > "/tmp/$algo.out" 2>&1
  rc=$?
  if [ $rc -ne 0 ] && grep -q "RESOURCE_EXHAUSTED\|Out of memory" "/tmp/$algo.out"; then
    left=$(( BUDGET_S - ($(date +%s) - start) ))
    echo "$algo: out of memory; again with --remat on (${left}s left)"
    [ "$left" -ge 60 ] && timeout "$left" $PY benchmarks/throughput.py --algo "$algo" $MODEL \
      --batch-size "$bs" --max-length "$len" --steps 5 --warmup 2 --remat on \
      > "/tmp/$algo.out" 2>&1
    rc=$?
  fi
  if [ $rc -eq 0 ]; then tail -n 1 "/tmp/$algo.out" | tee -a "$OUT/throughput.jsonl"
  else tail -n 25 "/tmp/$algo.out"; echo "$algo failed (rc $rc)"; fi
done <<< "$runs"
echo "total $(( $(date +%s) - start ))s"
