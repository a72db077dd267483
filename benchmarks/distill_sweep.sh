#!/usr/bin/env bash
# distill.py's toy recipe, chosen on the eval split: the teacher (150 SFT steps) and the student (40), then
# on-policy distillation at each β × steps × learning rate of the grid, each scored greedily and sampled on
# data/prompts_eval.jsonl, beside the control: the student after as many more SFT steps on the demonstrations, at
# the same learning rate (is the gain the teacher's, or more training's?); with CHOSEN="beta steps lr" set, that
# recipe and its control at seeds $SEEDS, scored on the test split.
#   bash benchmarks/distill_sweep.sh runs/distill_sweep                        # the grid, eval split
#   CHOSEN="0 240 1e-3" SEEDS="0 1 2" bash benchmarks/distill_sweep.sh runs/distill_sweep     # test split
set -euo pipefail
OUT=${1:-runs/distill_sweep}
GRID_BETA=${GRID_BETA:-"0 0.5 1"}
GRID_STEPS=${GRID_STEPS:-"40 120 240"}
GRID_LR=${GRID_LR:-"1e-3"}
SEEDS=${SEEDS:-"0 1 2"}
export XLA_FLAGS=--xla_force_host_platform_device_count=1
mkdir -p "$OUT"
sft() {  # name steps
  [ -f "$OUT/$1/model/config.json" ] || python sft.py --model tiny --max-steps "$2" --batch-size 32 \
    --learning-rate 2e-3 --warmup-steps 10 --lr-scheduler-type cosine_with_min_lr --output-dir "$OUT/$1" \
    > "$OUT/$1.log" 2>&1
}
score() {  # model split name
  [ -f "$OUT/eval_$3/eval.json" ] || python evaluate.py --model "$1" --prompts "data/prompts_$2.jsonl" \
    --max-new-tokens 16 --num-prompts 0 --output-dir "$OUT/eval_$3" > "$OUT/eval_$3.log" 2>&1
}
distill() {  # name beta steps lr seed
  [ -f "$OUT/$1/model/config.json" ] || python distill.py --model "$OUT/student/model" \
    --teacher-model "$OUT/teacher/model" --max-steps "$3" --beta "$2" --learning-rate "$4" --seed "$5" \
    --batch-size 32 --response-length 16 --max-prompt-length 64 --output-dir "$OUT/$1" > "$OUT/$1.log" 2>&1
}
control() {  # name steps lr seed: the student, more SFT steps on the demonstrations (distill's other defaults)
  [ -f "$OUT/$1/model/config.json" ] || python sft.py --model "$OUT/student/model" --max-steps "$2" \
    --batch-size 32 --learning-rate "$3" --seed "$4" --output-dir "$OUT/$1" > "$OUT/$1.log" 2>&1
}
sft teacher 150
sft student 40
if [ -z "${CHOSEN:-}" ]; then
  score "$OUT/teacher/model" eval teacher_eval
  score "$OUT/student/model" eval student_eval
  for lr in $GRID_LR; do for steps in $GRID_STEPS; do for beta in $GRID_BETA; do
    name=b${beta}_s${steps}_lr${lr}
    distill "$name" "$beta" "$steps" "$lr" 0
    score "$OUT/$name/model" eval "${name}_eval"
  done
  control "sft_s${steps}_lr${lr}" "$steps" "$lr" 0
  score "$OUT/sft_s${steps}_lr${lr}/model" eval "sft_s${steps}_lr${lr}_eval"
  done; done
else
  read -r beta steps lr <<< "$CHOSEN"
  score "$OUT/teacher/model" test teacher_test
  score "$OUT/student/model" test student_test
  for seed in $SEEDS; do
    name=chosen_b${beta}_s${steps}_lr${lr}_seed$seed
    distill "$name" "$beta" "$steps" "$lr" "$seed"
    score "$OUT/$name/model" test "${name}_test"
    control "control_s${steps}_lr${lr}_seed$seed" "$steps" "$lr" "$seed"
    score "$OUT/control_s${steps}_lr${lr}_seed$seed/model" test "control_s${steps}_lr${lr}_seed${seed}_test"
  done
fi
