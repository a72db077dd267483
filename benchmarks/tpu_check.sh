#!/usr/bin/env bash
# Every measurement on an accelerator in one go (written for one TPU v5e chip; any JAX device works), one JSON
# line per measurement in $OUT/results.jsonl (what, device, date, command, and the figures under the names
# throughput.py and decode.py print: mfu, tokens_per_sec, ms_per_step), a log beside it, traces in $OUT.
#   bash benchmarks/tpu_check.sh                      # on the chip (PARTS picks parts: see below)
#   SMOKE=1 bash benchmarks/tpu_check.sh              # the same commands on CPU at `tiny` shape, in minutes
# Parts (PARTS="..."; default all but flags and profile; ROWS="regex" keeps the matching measurements):
#   matmul      the bf16 matmul peak through JAX (8192^3): the ceiling MFU is read against
#   scripts     every script end to end on `tiny` as the README's pipeline runs them (+ evaluate.py and
#               --export-hf), a few steps each, in the host's own environment (its TPU_* variables as they are)
#   flags       the same commands' flags parsed by each script (no run): what SMOKE checks in the suite
#   throughput  benchmarks/throughput.py at Gemma-2B shape: full fine-tuning at width (4 blocks, vocabulary
#               32k, 8 x 1024; also with --adam-mu-dtype bfloat16), LoRA r16 at full depth (4 and 8 x 1024, --remat auto), a LoRA DPO step, a
#               LoRA GRPO update and iteration (32 x 512)
#   decode      benchmarks/decode.py at Gemma-2B shape (prompt 64 + 128 new tokens), batch 16, 64, 256, 512
#               (beside each, the same sampler with XLA's draw in place of tpu_kernels.py's fused one),
#               batch 256 as 32 prompts of 8 rows (a GRPO rollout: a prompt prefilled once), and greedy at
#               batch $GREEDY_B (default the first): what drawing the token costs
#   first       --remat auto's start: the DPO LoRA step and the GRPO update at Gemma-2B shape from a fresh
#               compilation cache, then both again (the decision remembered, the programs cached)
#   phases      benchmarks/first_step.py: the DPO LoRA step's make, trace, lowering and compile timed apart
#   scan        benchmarks/scan_compile.py: 18 Gemma-2B blocks unrolled against one scanned block, compile and load
#   packing     benchmarks/longtail.py: sft.py --packing beside length buckets on long-tailed lengths, real tokens/s
#   qlora       LoRA r16 on a frozen int8 base (--quantize int8), 4 x 1024: an SFT step at Llama 3 8B shape, Gemma-2B's
#               beside its bf16 base, a DPO step at Llama 3 8B and an SFT step at Gemma 7B (8B rows: --remat $REMAT_8B)
#   memory      benchmarks/memory.py's step (Gemma-2B, 2 blocks, LoRA r16, 8 and 32 x 1024) compiled for and
#               run on the chip: the compiled peak, the compiler's own, and the measured one
#   profile     jax.profiler traces of the LoRA step, the GRPO update and a decode step (into $OUT)
# The packages the chip's image lacks travel as wheels in .whl-tpu/ (benchmarks/tpu_wheels.sh fills it here;
# the device call carries it); they are installed under /tmp/site. Stops starting new runs at $BUDGET_S s.
set -uo pipefail
OUT=${OUT:-/tmp/tpu_check}
BUDGET_S=${BUDGET_S:-560}
PY=${PY:-python3}
PARTS=${PARTS:-matmul scripts throughput decode}
ROWS=${ROWS:-.}  # a regular expression: only the measurements whose `what` matches it
REMAT_8B=${REMAT_8B:-full}  # the 8B-shape rows': only the block inputs fit beside the 9 GiB of int8 weights
REMAT=${REMAT:-auto}  # the LoRA rows' --remat (auto: the scripts' default; it compiles each policy it tries)
BEFORE=${BEFORE:-}  # decode rows: a git revision whose sampler runs beside the working tree's (decode.py --before)
THROUGHPUT=${THROUGHPUT:-}  # more flags for every throughput row (e.g. --logits-chunk 256)
want() { [[ " $PARTS " == *" $1 "* ]]; }
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
start=$(date +%s)
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3 KERAS_BACKEND=jax

if [ -n "${SMOKE:-}" ]; then  # CPU: tiny shapes, a decoder block or two, short sequences
  export JAX_PLATFORMS=cpu
  MODEL="--model tiny --random-init --num-layers 1"; WIDTH=""; DECODE="--model tiny --num-layers 1"
  MATMUL_N=256; SCALE=16; BATCHES="4"; GROUPED="4"; G=2; STEPS="--steps 1 --warmup 1"; ROUNDS=1
  MEMORY="--model tiny"; MEMORY_B="4"
  SHAPE="--num-layers 1 --arch hidden_dim=256,intermediate_dim=512,vocabulary_size=1000,num_query_heads=4,num_key_value_heads=2"
else
  if compgen -G ".whl-tpu/*.whl" > /dev/null; then  # the lock's packages the image lacks, under /tmp/site
    I="env PIP_CONFIG_FILE=/dev/null $PY -m pip install --isolated -q --no-deps --no-compile --no-cache-dir --target /tmp/site"
    $I --index-url file:///opt/pypi/simple --only-binary=:all: tensorstore h5py && $I --no-index .whl-tpu/*.whl \
      || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site  # after the image's own JAX
  fi
  MODEL="--model gemma_2b --random-init"; WIDTH="--num-layers 4 --arch vocabulary_size=32000"
  MEMORY="--model gemma_2b --num-layers 2"; MEMORY_B="8 32"; SHAPE=""
  DECODE="--model gemma_2b --arch="; MATMUL_N=8192; SCALE=1; BATCHES="16 64 256 512"; GROUPED="256"; G=8; STEPS="--steps 5 --warmup 2"; ROUNDS=3
fi
env | grep -E "^TPU_|^JAX_|^XLA_" | sort
$PY -c "import jax, keras, keras_hub, optax, tyro; print('jax', jax.__version__, jax.devices(), 'keras', keras.__version__, 'keras_hub', keras_hub.__version__)" \
  || { echo "imports failed"; exit 1; }
DEVICE=$($PY -c "import jax; print(jax.devices()[0].device_kind)" 2>/dev/null)
DATE=$(date +%Y-%m-%d)

left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }

# record WHAT COMMAND...: run COMMAND; its last stdout line (a JSON object) goes to results.jsonl with what,
# device, date and the command added; a failure is a line too, with its return code and the error's last line.
record() {
  local what=$1; shift
  [[ $what =~ $ROWS ]] || return 0
  local budget; budget=$(left)
  if [ "$budget" -lt 20 ]; then echo "skip $what: ${budget}s left"; return; fi
  echo "== $what ($budget s left): $*"
  local t0; t0=$(date +%s)
  timeout "$budget" "$@" > "/tmp/$what.out" 2> "/tmp/$what.err"
  local rc=$?
  [ $rc -eq 0 ] || tail -n 15 "/tmp/$what.err"
  $PY - "$what" "$DEVICE" "$DATE" "$*" "$rc" "$(( $(date +%s) - t0 ))" "/tmp/$what.out" "/tmp/$what.err" <<'EOF' \
    | tee -a "$OUT/results.jsonl"
import json, sys
what, device, date, command, rc, seconds, out, err = sys.argv[1:]
row = {"what": what, "device": device, "date": date, "command": command, "rc": int(rc), "seconds": int(seconds)}
lines = open(out).read().strip().splitlines()
try:
    row.update(json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {})
except json.JSONDecodeError:
    pass
if int(rc):
    tail = [x for x in open(err).read().strip().splitlines() if x.strip()]
    row["error"] = tail[-1][:300] if tail else ""
print(json.dumps(row))
EOF
}

# Device-to-device bf16 matmul peak: the ceiling MFU is read against (v5e datasheet: 197 TFLOP/s).
want matmul && record matmul_bf16 $PY -c "
import json, time, jax, jax.numpy as jnp
n = $MATMUL_N
a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in (0, 1))
f = jax.jit(lambda x, y: x @ y)
for _ in range(3):
    f(a, b).block_until_ready()
t = time.perf_counter()
for _ in range(10):
    out = f(a, b)
out.block_until_ready()
dt = (time.perf_counter() - t) / 10
print(json.dumps({'tflops': 2 * n**3 / dt / 1e12, 'ms': dt * 1e3}))"

# The README's pipeline on `tiny`, a few steps each (the values of compare.py's recipe otherwise).
R=/tmp/tpu_check_runs
TINY="--batch-size 32 --max-length 512 --overwrite"
RL="--max-prompt-length 64 --response-length 16 --overwrite"
pipeline=(
  "sft.py --model tiny --max-steps 20 --learning-rate 1e-3 --warmup-steps 5 $TINY --export-hf --output-dir $R/sft"
  "dpo.py --model $R/sft/model --max-steps 3 --learning-rate 5e-5 $TINY --output-dir $R/dpo"
  "simpo.py --model $R/sft/model --max-steps 3 --learning-rate 5e-5 $TINY --output-dir $R/simpo"
  "orpo.py --model $R/sft/model --max-steps 3 --learning-rate 5e-5 $TINY --output-dir $R/orpo"
  "kto.py --model $R/sft/model --max-steps 3 --learning-rate 5e-5 $TINY --output-dir $R/kto"
  "reward.py --model $R/sft/model --max-steps 3 --normalize --learning-rate 1e-3 $TINY --output-dir $R/rm"
  "ppo.py --model $R/sft/model --reward-model $R/rm/model --max-steps 2 --batch-size 32 --num-mini-batches 2 $RL --output-dir $R/ppo"
  "grpo.py --model $R/sft/model --max-steps 2 --batch-size 64 --beta 0.04 $RL --output-dir $R/grpo"
  "rloo.py --model $R/sft/model --max-steps 2 --batch-size 64 $RL --output-dir $R/rloo"
  "distill.py --model $R/sft/model --teacher-model $R/grpo/model --max-steps 2 --batch-size 32 $RL --output-dir $R/distill"
  "evaluate.py --model $R/grpo/model --baseline $R/sft/model --num-prompts 64 --max-new-tokens 16 --overwrite --output-dir $R/eval"
)
if want scripts; then
  for command in "${pipeline[@]}"; do
    name=${command%%.py*}
    record "script_$name" $PY $command
  done
  ls "$R/sft/model_hf" > /dev/null 2>&1 && echo "model_hf: $(ls "$R/sft/model_hf" | tr '\n' ' ')"
fi
if want flags; then  # every pipeline command's flags, as its script parses them (no model, no run)
  for run in sft grpo; do  # stand-ins for the models the pipeline makes: a `tiny`-trained model's tokenizer
    mkdir -p "$R/$run/model" && cp data/tiny_tokenizer.model "$R/$run/model/tokenizer.model"
  done
  record script_flags $PY - "${pipeline[@]}" <<'EOF'
import importlib, json, shlex, sys
import plumbing
for command in sys.argv[1:]:
    script, *argv = shlex.split(command)
    module = importlib.import_module(script[:-3])
    plumbing.cli(module.Args, argv)
print(json.dumps({"commands": len(sys.argv) - 1}))
EOF
fi

# Gemma-2B shape, random weights, bf16 compute, float32 master weights and Adam.
if want throughput; then
  T="$PY benchmarks/throughput.py $MODEL $STEPS $THROUGHPUT"
  record full_ft_2b_width $T --algo sft $WIDTH --batch-size 8 --max-length $(( 1024 / SCALE )) --remat off
  record full_ft_2b_width_mu_bf16 $T --algo sft $WIDTH --batch-size 8 --max-length $(( 1024 / SCALE )) --remat off \
    --adam-mu-dtype bfloat16  # AdamW's first moment in bf16: 2 bytes a weight fewer through each update
  record lora_2b $T --algo sft --lora-rank 16 --batch-size 4 --max-length $(( 1024 / SCALE )) --remat $REMAT
  record lora_2b_b8 $T --algo sft --lora-rank 16 --batch-size 8 --max-length $(( 1024 / SCALE )) --remat $REMAT
  record lora_2b_b8_accum2 $T --algo sft --lora-rank 16 --batch-size 8 --grad-accum-steps 2 \
    --max-length $(( 1024 / SCALE )) --remat off  # the same batch as 2 micro-batches of 4, nothing recomputed
  record dpo_lora_2b $T --algo dpo --lora-rank 16 --batch-size 4 --max-length $(( 1024 / SCALE )) --remat $REMAT
  record grpo_update_2b $T --algo grpo --lora-rank 16 --batch-size 32 --max-length $(( 512 / SCALE )) --remat $REMAT
fi

# --remat auto's time to the first step: a fresh compilation cache (cold), then the same commands again on it
if want first; then
  export JAX_COMPILATION_CACHE_DIR=/tmp/first_step_cache_$start
  T="$PY benchmarks/throughput.py $MODEL $STEPS $THROUGHPUT"
  for run in cold again; do
    record first_dpo_lora_2b_$run $T --algo dpo --lora-rank 16 --batch-size 4 --max-length $(( 1024 / SCALE )) --remat auto
    record first_grpo_update_2b_$run $T --algo grpo --lora-rank 16 --batch-size 32 --max-length $(( 512 / SCALE )) \
      --remat auto
  done
  unset JAX_COMPILATION_CACHE_DIR
fi

# the time before a first step, phase by phase: the model's making, then the step's trace, lowering and compile,
# from a fresh compilation cache (cold), then again on it (the compile: a cache hit, the executable's load)
if want phases; then
  export JAX_COMPILATION_CACHE_DIR=/tmp/phases_cache_$start
  for run in cold again; do
    record phases_dpo_lora_2b_$run $PY benchmarks/first_step.py $MODEL --algo dpo --lora-rank 16 --batch-size 4 \
      --max-length $(( 1024 / SCALE )) --policies off/2
  done
  unset JAX_COMPILATION_CACHE_DIR
fi

# a scanned stack of decoder blocks against the unrolled one (plain JAX, Gemma-2B's block, 18 blocks, LoRA on q):
# trace and lowering, compile, the executable's size and load (a cache hit's cost), the step
if want scan; then
  record scan_compile_2b_blocks $PY benchmarks/scan_compile.py \
    $( [ -n "${SMOKE:-}" ] && echo --layers 2 --hidden 64 --ffn 128 --heads 2 --head-dim 16 --seq 32 )
fi

# sft.py --packing against length buckets on long-tailed lengths (median 128, p99 1024), real tokens/s: Gemma-2B
# width at 4 blocks (the compiles of every bucket a mode meets fit the call), LoRA r16, 8 rows of 1024
if want packing; then
  for mode in buckets packed; do  # a process each: record keeps a command's last line
    record packing_2b_4blocks_$mode $PY benchmarks/longtail.py $MODEL --num-layers $(( SCALE > 1 ? 1 : 4 )) \
      --lora-rank 16 --algo sft --lengths lognormal:$(( 128 / SCALE )),$(( 1024 / SCALE )) \
      --max-length $(( 1024 / SCALE )) --batch-size 8 --steps 12 --modes $mode --remat off
  done
fi

if want qlora; then  # an 8B model on one chip: its int8 weights (~9 GiB with the embeddings) made on the host
  T="$PY benchmarks/throughput.py --random-init $SHAPE $STEPS --lora-rank 16 --max-length $(( 1024 / SCALE ))"
  record qlora_llama3_8b_sft_int8 $T --model llama3_8b --algo sft --batch-size 4 --quantize int8 --remat $REMAT_8B
  record qlora_2b_sft_bf16 $T --model gemma_2b --algo sft --batch-size 4 --remat $REMAT
  record qlora_2b_sft_int8 $T --model gemma_2b --algo sft --batch-size 4 --quantize int8 --remat $REMAT
  record qlora_llama3_8b_dpo_int8 $T --model llama3_8b --algo dpo --batch-size 4 --quantize int8 --remat $REMAT_8B
  record qlora_gemma_7b_sft_int8 $T --model gemma_7b --algo sft --batch-size 4 --quantize int8 --remat $REMAT_8B
fi

if want decode; then
  PLAIN=$([ -z "$BEFORE" ] && echo --plain-draw)  # no revision: XLA's draw beside the fused one (tpu_kernels.py)
  for b in $BATCHES; do
    record "decode_2b_b$b" $PY benchmarks/decode.py $DECODE --before "$BEFORE" $PLAIN --batch-size "$b" --rounds $ROUNDS
  done
  for b in $GROUPED; do  # a GRPO rollout: B/G prompts of G rows, each prompt prefilled once, beside every row
    record "decode_2b_b${b}_g$G" $PY benchmarks/decode.py $DECODE --before "" --batch-size "$b" --num-generations $G \
      --rounds $ROUNDS  # beside it every row prefilled (group 1): the share of equal tokens
  done
  b=${BATCHES%% *}; b=${GREEDY_B:-$b}  # greedy: the step without its draw (a Gumbel variate a vocabulary entry)
  record "greedy_2b_b$b" $PY benchmarks/decode.py $DECODE --before "" --batch-size "$b" --rounds $ROUNDS --temperature 0
fi

if want memory; then  # the compiled step's memory against the chip's measured peak, for the same program
  M="$PY benchmarks/memory.py $MEMORY --algo sft --lora-rank 16 --max-length $(( 1024 / SCALE )) --remat off"
  for b in $MEMORY_B; do
    record "memory_2b_2layers_b$b" $M --mesh data=1 --batch-size "$b" --target cpu --device-memory-gib 16 --run
  done
fi

if want profile; then  # traces for where each step's time goes (RESULTS.md): the newest .trace.json.gz each
  T="$PY benchmarks/throughput.py $MODEL --steps 2 --warmup 1"
  record profile_lora_2b $T --algo sft --lora-rank 16 --batch-size 4 --max-length $(( 1024 / SCALE )) --remat $REMAT --profile /tmp/prof_lora
  record profile_grpo_update_2b $T --algo grpo --lora-rank 16 --batch-size 32 --max-length $(( 512 / SCALE )) --remat $REMAT --profile /tmp/prof_grpo
  record profile_decode_2b_b256 $PY benchmarks/decode.py $DECODE --before "" --batch-size 256 --rounds 1 \
    --response-length 32 --profile /tmp/prof_decode
  for p in lora grpo decode; do  # up out of the profiler's nested folders: $OUT comes back 2 folders deep
    f=$(find "/tmp/prof_$p" -name "*.trace.json.gz" 2>/dev/null | head -n 1)
    [ -n "$f" ] && cp "$f" "$OUT/trace_$p.json.gz"
  done
fi
echo "total $(( $(date +%s) - start ))s"
