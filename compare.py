"""Compare post-training recipes on one base: SFT, then DPO, SimPO, ORPO, KTO, reward model + PPO, GRPO, RLOO.
Every script runs through its real CLI (a subprocess; a fork slots in by name, `--extra mydpo.py`); each model
is scored with evaluate.py's protocol against SFT and a compute-matched continued-SFT control (sft+, sft+rl),
over --seeds seeds, paired 95% intervals; --sweep picks settings on the eval split, the table reports the test
split. Writes comparison.md (summary, table, sweep, costs), comparison.png, curves.json (score against FLOPs).
    python compare.py --model gemma_2b --methods sft,dpo --test-prompts test.jsonl --reward-fn f.py:score \
        --sft-args="--dataset sft.jsonl --eval-dataset sft_eval.jsonl" \
        --dpo-args="--dataset prefs.jsonl --eval-dataset prefs_eval.jsonl"
Offline, a first look in minutes (`--quick`), and the bundled comparison task (data/compare/) at 3 seeds:
    python compare.py --model tiny --quick
    python compare.py --model tiny --seeds 3 --sweep kto.learning_rate=1e-5,5e-5 \\
        --sweep simpo.learning_rate=1e-5,5e-5   # docs/comparison.md
"""

import contextlib
import dataclasses
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Annotated, Literal, NamedTuple

import plumbing  # the run shell: the exit boundary, --help from this file's source (instant to import)

# `python compare.py --help`: before the imports below
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (data files, reward functions, mesh; JAX's devices start only to evaluate)
import numpy as np  # noqa: E402
import tyro  # noqa: E402

METHODS = ("sft", "sft+", "dpo", "simpo", "orpo", "kto", "ppo", "grpo", "rloo", "sft+rl", "distill")
PREFERENCE = ("dpo", "simpo", "orpo", "kto")  # started from the SFT model on the same preference data
RL = ("ppo", "ppo_fn", "grpo", "rloo")  # rows that sample; the rest read their controls' in CONTROL
CONTROL = {**{r: "sft+rl" for r in RL}, "sft+": "sft", "sft+rl": "sft"}  # a row's control; others: sft+
CONTROLS = ("sft+", "sft+rl")  # the control rows: SFT continued at SFT's final rate, not --learning-rate
RepeatedStr = Annotated[tuple[str, ...], tyro.conf.UseAppendAction]  # `--flag a --flag b` -> ("a", "b")
MAIN_METRIC = ("objective/scores", "reward", "train/loss")  # the curve plotted per run: the first one logged
FLOPS_LABEL = 'training FLOPs (SFT included; docs/design.md, "FLOPs")'  # the score-against-compute x axis


class RunsFailed(plumbing.RunFailed):
    """A script exited non-zero (or was skipped for one that did): exit 1, after the report of the rest."""


@dataclass
class Args:
    # what to run
    model: str = "tiny"
    """the base: any --model form (alias, preset, handle, local dir, `tiny`)"""
    chat_template: (
        Literal["gemma", "gemma4", "gemma4_large", "llama3", "mistral", "chatml", "qwen3.5"] | None
    ) = None
    """how chats are rendered; None: --model's family's (Gemma 1-3: gemma, Gemma 4: gemma4, or gemma4_large
    at 26B-A4B / 31B, Llama 3: llama3, Mistral: mistral, Qwen 2.5 / 3: chatml, Qwen 3.5: qwen3.5)"""
    task: Literal["compare", "toy"] = "compare"
    """every script's data on a `tiny`-based --model: `compare`, data/compare/ (docs/compare.md); `toy`"""
    methods: str = "sft,sft+,dpo,simpo,orpo,kto,ppo,grpo,rloo,sft+rl"
    """comma-separated subset of METHODS (ppo: --ppo-reward; grpo, rloo: --reward-fn); sft+: SFT continued for
    --steps updates of twice the preference batch (a preference row's tokens), sft+rl: the RL rows' FLOPs;
    distill (not by default): --steps of on-policy distillation from --teacher-model, read against sft+"""
    teacher_model: str | None = None
    """the distill row's frozen teacher (any --model form, the base's vocabulary), e.g. a larger sibling"""
    extra: tuple[str, ...] = ()
    """forked scripts (e.g. mydpo.py), each run like dpo from the SFT model; the row is the file's name"""
    quick: bool = False
    """a first look in minutes: QUICK's methods, budgets, 1 seed, 200 test prompts, no curves (a flag you
    give keeps its value: quick_argv); one seed measures no seed noise, so the report claims nothing"""
    seeds: int = 3
    """training seeds after SFT: --seed, --seed+1, …; SFT is trained once (--seed): the shared base"""
    sweep: RepeatedStr = ()
    """`method.flag=v1,v2,…` (repeatable; two flags of a method: their grid), e.g. dpo.learning_rate=1e-5,5e-5
    (appended last): every setting × seed; the best mean greedy score on --eval-prompts is tested"""
    # budgets
    sft_steps: int = 1000
    """SFT updates (the shared base): until more SFT stops paying (docs/comparison.md; the toy run: 150)"""
    steps: int = 100
    """updates of each preference method (dpo, simpo, orpo, kto, --extra) and sft+ (docs/comparison.md: 40)"""
    reward_steps: int = 40
    """reward model updates (before PPO)"""
    ppo_steps: int = 20
    """PPO iterations (one rollout batch + 4 epochs × 2 mini-batches of updates each)"""
    grpo_steps: int = 200
    """GRPO iterations (8 prompts × 8 completions + one update each)"""
    rloo_steps: int = 200
    """RLOO iterations (as GRPO's: 8 prompts × 8 completions + one update each)"""
    learning_rate: float = 5e-5
    """peak learning rate after SFT, but the controls' (SFT's final one); the recipe's other flags: RECIPE"""
    ppo_reward: Literal["model", "fn", "both"] = "both"
    """`model`: PPO optimises a reward model trained on the preference pairs; `fn`: --reward-fn; `both`"""
    # pass-through flags, appended last (they override compare's choices); write them with `=`
    sft_args: str = ""
    """extra flags for sft.py, e.g. --sft-args="--learning-rate 5e-4" (the base and both controls)"""
    dpo_args: str = "--sft-weight 1.0"
    """extra flags for dpo.py; default: RPO's NLL term on the chosen (α 1; pure DPO lowers the chosen too)"""
    simpo_args: str = "--sft-weight 1.0"
    """extra flags for simpo.py; default: CPO-SimPO's `cpo_alpha=1` (pure SimPO lowers the chosen too)"""
    orpo_args: str = "--no-prompt-nll"
    """extra flags for orpo.py; default: the NLL on the chosen response only (on toy prompts it swamps it)"""
    kto_args: str = ""
    """extra flags for kto.py (its default data: the same pairs, unpaired)"""
    reward_args: str = ""
    """extra flags for reward.py"""
    ppo_args: str = ""
    """extra flags for ppo.py"""
    grpo_args: str = "--learning-rate 2e-4"
    """extra flags for grpo.py; default: the rate docs/comparison.md's pilot chose (5e-4 diverged)"""
    rloo_args: str = "--learning-rate 2e-4"
    """extra flags for rloo.py; default: grpo's rate"""
    distill_args: str = ""
    """extra flags for distill.py"""
    extra_args: str = ""
    """extra flags for every --extra script"""
    # evaluation (evaluate.py's protocol)
    eval_prompts: str | None = None
    """held-out prompts choosing among --sweep settings (the eval split); None: --task's prompts_eval.jsonl"""
    test_prompts: str | None = None
    """held-out prompts of the reported numbers (the test split, never chooses); None: prompts_test.jsonl"""
    num_prompts: int = 0
    """the first N prompts of each split (0: all: 200 eval, 500 test)"""
    reward_fn: str = os.path.join(common.HERE, "data", "toy.py") + ":batch_score"
    """the task score, `path.py:function`"""
    max_new_tokens: int = 16
    """tokens generated per prompt"""
    temperature: float = 1.0
    """temperature of the sampled responses (KL is measured on them)"""
    curve_points: int = 3
    """checkpoints a run keeps and is scored at (greedy, test split) besides its end: the score-against-FLOPs
    curves; at real sizes each is weights + optimizer state on disk; 0: none"""
    seed: int = 0
    """SFT's seed and the first of --seeds; a model of seed s is evaluated with sampling seed s"""
    # outputs
    output_dir: str | None = None
    """None: runs/compare__{model}__{seed}__{time}; one sub-directory per run"""
    overwrite: bool = False
    """replace the runs already in --output-dir (otherwise refused)"""


# === The plan: which script runs, from which model, with which flags, for which seed and setting ===
# Each script's fixed flags (docs/comparison.md's, for `tiny`; the defaults are TRL's), then budgets, lr, args
COSINE_TO_10 = " --lr-scheduler-type cosine_with_min_lr --min-lr-rate 0.1"  # warmup, then to 10% of the peak
SAMPLER = "--num-generations 8 --max-prompt-length 64 --response-length 16"
RECIPE = {
    "sft": "--batch-size 32 --learning-rate 1e-3 --warmup-steps 20 --max-length 512" + COSINE_TO_10,
    # the controls: SFT at the rate it ended on, 64 demonstrations a step (a preference step's 32 pairs)
    "sft+": "--batch-size 64 --learning-rate 1e-4 --warmup-steps 0 --max-length 512 "
    "--lr-scheduler-type constant",
    "dpo": "--batch-size 32 --warmup-steps 5 --max-length 512 --beta 0.1" + COSINE_TO_10,
    "simpo": "--batch-size 32 --grad-accum-steps 1 --warmup-steps 5 --max-length 512 --beta 2.0 --gamma 0.5"
    + COSINE_TO_10,
    "orpo": "--batch-size 32 --warmup-steps 5 --max-length 512 --beta 0.1" + COSINE_TO_10,
    "kto": "--batch-size 64 --warmup-steps 5 --max-length 512 --beta 0.1" + COSINE_TO_10,  # dpo's 32 pairs
    "reward": "--batch-size 32 --learning-rate 1e-3 --warmup-steps 10 --max-length 512" + COSINE_TO_10,
    "ppo": "--batch-size 32 --num-mini-batches 2 --max-prompt-length 64 --response-length 16 "
    "--missing-eos-penalty 1.0 --kl-coef 0.05 --lr-scheduler-type linear",  # to 0 over every update
    "grpo": f"--batch-size 64 {SAMPLER} --beta 0.0 --lr-scheduler-type constant_with_warmup",  # TRL's β
    # β 0.01 as docs/rloo.md measured (TRL's 0.05 drowns the toy reward in the sequence KL's noise)
    "rloo": f"--batch-size 64 {SAMPLER} --beta 0.01 --lr-scheduler-type constant_with_warmup",
    # one completion per prompt, 64 a step (grpo's 8 x 8), reverse KL (TRL's β = 1)
    "distill": "--batch-size 64 --max-prompt-length 64 --response-length 16 --warmup-steps 5" + COSINE_TO_10,
}
# --task compare: data/compare/{kind}_train.jsonl (+ _eval but for prompts), before the recipe
TASK_DATA = {
    "sft": "sft",
    "sft+": "sft",
    "sft+rl": "sft",
    "dpo": "prefs",
    "simpo": "prefs",
    "orpo": "prefs",
    "reward": "prefs",
    "kto": "kto",
    "ppo": "prompts",
    "grpo": "prompts",
    "rloo": "prompts",
    "distill": "prompts",
}


DATA_KIND = {"sft": "demonstrations", "prefs": "preference pairs", "kto": "KTO rows", "prompts": "prompts"}


def task_flags(task, model, recipe):
    """The data flags of one script under --task (its recipe key names it; a fork reads dpo's)."""
    if task == "toy" or not plumbing.is_toy_model(model):
        return []
    kind = TASK_DATA[recipe]

    def path(split):
        return os.path.join(common.HERE, "data", "compare", f"{kind}_{split}.jsonl")

    return ["--dataset", path("train")] + (["--eval-dataset", path("eval")] if kind != "prompts" else [])


def task_prompts(args):
    """(eval prompts, test prompts): the flags', or --task's held-out splits."""
    folder = os.path.join(common.HERE, "data", "compare" if args.task == "compare" else "")
    return (
        args.eval_prompts or os.path.join(folder, "prompts_eval.jsonl"),
        args.test_prompts or os.path.join(folder, "prompts_test.jsonl"),
    )


# --quick: SFT's 150 updates; dpo against sft+, grpo (the checker) against sft+rl; 3.5 min (docs/compare.md)
QUICK = dict(
    methods="sft,sft+,dpo,grpo,sft+rl",
    seeds=1,
    sft_steps=150,
    steps=40,
    grpo_steps=30,
    num_prompts=200,
    curve_points=0,
)


def quick_argv(argv):
    """--quick: QUICK's flags put ahead of the command line, whose own flags come later and so win (tyro keeps
    a repeated flag's last value); a command line without --quick as it is."""
    if "--quick" not in argv:
        return argv
    return [f"--{k.replace('_', '-')}={v}" for k, v in QUICK.items()] + argv


def check_data(args, stages, grid):
    """compare.py never mixes tasks. Once a run trains on your data (--dataset in its --<row>-args), or
    --model is not `tiny`-based, every run does, each with its eval set named beside it where the task would
    pass its own, and every row is scored on your held-out prompts; else UsageError, one line naming what to
    pass."""
    yours = [s for s in stages if "--dataset" in s["own"]]
    if not yours and plumbing.is_toy_model(args.model):
        return  # the task's data throughout
    problems = {}  # one a pass-through flag (sft, sft+ and sft+rl share --sft-args), in run order
    for s in stages:
        fork = s["row"] not in METHODS + RL + ("reward",)
        via = "--extra-args" if fork else f"--{s['recipe'].rstrip('+')}-args"
        task = s["flags"][: len(s["flags"]) - len(s["own"])]  # compare's flags, before yours
        if "--dataset" not in s["own"]:
            problems[via] = f"{via}: add --dataset (your {DATA_KIND[TASK_DATA[s['recipe']]]})"
        elif "--eval-dataset" in task and not {"--eval-dataset", "--eval-split"} & set(s["own"]):
            held_out = os.path.relpath(task[task.index("--eval-dataset") + 1])
            problems[via] = (
                f"{via}: add --eval-dataset FILE or --eval-split SPLIT (--eval-dataset '' for none), else "
                f"{s['row']} is evaluated on the task's {held_out}"
            )
    if args.test_prompts is None:
        problems["test"] = "pass --test-prompts FILE (your held-out prompts, scored by --reward-fn)"
    if grid and args.eval_prompts is None:
        problems["eval"] = "pass --eval-prompts FILE (where --sweep chooses)"
    if problems:
        why = (
            f"{yours[0]['row']} trains on your --dataset" if yours else f"--model {args.model} is not `tiny`"
        )
        raise plumbing.UsageError(
            f"{why}, so every run trains and is scored on your data: " + "; ".join(problems.values())
        )


def parse_sweep(specs, rows):
    """['dpo.learning_rate=1e-6,5e-6', …] -> {row: [setting {flag: value}, …]} (the grid of a row's swept
    flags, in the order given); a row not in `rows` or a spec without values raises UsageError."""
    grid = {}
    for spec in specs:
        key, _, values = spec.partition("=")
        row, _, flag = key.partition(".")
        values = [v.strip() for v in values.split(",") if v.strip()]
        if row not in rows or not flag.isidentifier() or not values:
            raise plumbing.UsageError(
                f"--sweep {spec!r}: expected row.flag=v1,v2,… with row one of {','.join(rows)}"
            )
        grid[row] = [{**s, flag: v} for s in grid.get(row, [{}]) for v in values]
    return grid


def tag(setting):
    """A setting's directory name: {'learning_rate': '1e-6'} -> 'learning_rate_1e-6' ('' for no setting)."""
    return "__".join(f"{k}_{v}" for k, v in setting.items())


# A row of the table after SFT, run once per seed (and per --sweep setting): its name (a fork's: its file's), its
# script, its RECIPE key (a fork reads dpo's), its --max-steps (None: sft+rl's, known once its seed's RL rows
# ran: matched_steps), its own flags (a teacher, the task score as reward), its pass-through flags (appended
# last), and whether it is PPO on its seed's reward model (a reward stage first)
Row = NamedTuple(
    "Row",
    [
        ("name", str),
        ("script", str),
        ("recipe", str),
        ("steps", int | None),
        ("flags", list[str]),
        ("extra", str),
        ("on_rm", bool),
    ],
)


def plan(args, output_dir):
    """-> (stages {name: run dir under output_dir, row, setting, seed, script, flags, needs} in run order,
    the base model, the seeds, the sweep grid); bad choices raise UsageError."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if any(m not in METHODS for m in methods) or not (methods or args.extra) or args.seeds < 1:
        raise plumbing.UsageError(
            f"--methods {args.methods!r}: choose from {','.join(METHODS)}; --seeds >= 1"
        )
    base = os.path.join(output_dir, "sft", "model") if "sft" in methods else args.model
    sft = ["sft"] if "sft" in methods else []
    lr = ["--learning-rate", str(args.learning_rate)]
    fn = ["--reward-fn", args.reward_fn]

    def budget(steps):
        return ["--max-steps", str(steps)] + curve_flags(steps, args.curve_points)

    def script(name):
        return os.path.join(common.HERE, f"{name}.py")

    rows = [
        Row(
            name=m,
            script=script(m),
            recipe=m,
            steps=args.steps,
            flags=[],
            extra=getattr(args, f"{m}_args"),
            on_rm=False,
        )
        for m in PREFERENCE
        if m in methods
    ]
    for path in args.extra:
        name = os.path.splitext(os.path.basename(path))[0]
        if not path.endswith(".py") or not os.path.exists(path) or name in METHODS + ("reward",):
            raise plumbing.UsageError(
                f"--extra {path}: expected an existing script whose name is not a built-in"
            )
        rows.append(
            Row(
                name=name,
                script=os.path.abspath(path),
                recipe="dpo",
                steps=args.steps,
                flags=[],
                extra=args.extra_args,
                on_rm=False,
            )
        )
    if "distill" in methods:  # the preference rows' budget, graded token by token by the teacher
        if not args.teacher_model:
            raise plumbing.UsageError(
                "--methods distill needs --teacher-model (a model of the base's vocabulary)"
            )
        rows.append(
            Row(
                name="distill",
                script=script("distill"),
                recipe="distill",
                steps=args.steps,
                flags=["--teacher-model", args.teacher_model],
                extra=args.distill_args,
                on_rm=False,
            )
        )
    if "sft+" in methods:  # the preference rows' control: their steps, their tokens (RECIPE's sft+)
        rows.append(
            Row(
                name="sft+",
                script=script("sft"),
                recipe="sft+",
                steps=args.steps,
                flags=[],
                extra=args.sft_args,
                on_rm=False,
            )
        )
    for row, on_rm in (("ppo", True), ("ppo_fn" if args.ppo_reward == "both" else "ppo", False)):
        if "ppo" in methods and args.ppo_reward in ("both", "model" if on_rm else "fn"):
            rows.append(
                Row(
                    name=row,
                    script=script("ppo"),
                    recipe="ppo",
                    steps=args.ppo_steps,
                    flags=[] if on_rm else fn,
                    extra=args.ppo_args,
                    on_rm=on_rm,
                )
            )
    for m in ("grpo", "rloo"):  # a verifiable reward: the task score itself, like ppo_fn
        if m in methods:
            rows.append(
                Row(
                    name=m,
                    script=script(m),
                    recipe=m,
                    steps=getattr(args, f"{m}_steps"),
                    flags=fn,
                    extra=getattr(args, f"{m}_args"),
                    on_rm=False,
                )
            )
    if "sft+rl" in methods and any(r.name in RL for r in rows):  # steps: matched_steps, once the RL rows ran
        rows.append(
            Row(
                name="sft+rl",
                script=script("sft"),
                recipe="sft+",
                steps=None,
                flags=[],
                extra=args.sft_args,
                on_rm=False,
            )
        )
    grid = parse_sweep(args.sweep, [r.name for r in rows])
    template = ["--chat-template", args.chat_template] if args.chat_template else []

    def stage(name, *, row, script, recipe, model, flags, seed, extra, needs, setting):
        swept = [x for k, v in setting.items() for x in ("--" + k.replace("_", "-"), v)]
        return {
            "name": name,
            "row": row,
            "recipe": recipe,
            "setting": tag(setting),
            "seed": seed,
            "script": script,
            "needs": needs,
            "own": shlex.split(extra) + swept,  # the flags you passed through: they come last
            "flags": ["--model", model]
            + flags
            + task_flags(args.task, args.model, recipe)
            + shlex.split(RECIPE[recipe])
            + ["--seed", str(seed)]
            + template
            + ["--output-dir", os.path.join(output_dir, name)]
            + shlex.split(extra)
            + swept,
        }

    seeds = [args.seed + k for k in range(args.seeds)]
    stages = []
    if sft:
        stages.append(
            stage(
                "sft",
                row="sft",
                script=script("sft"),
                recipe="sft",
                model=args.model,
                flags=budget(args.sft_steps),
                seed=args.seed,
                extra=args.sft_args,
                needs=[],
                setting={},
            )
        )
    for seed in seeds:
        rm = f"reward/seed{seed}"
        if any(r.on_rm for r in rows):
            stages.append(
                stage(
                    rm,
                    row="reward",
                    script=script("reward"),
                    recipe="reward",
                    model=base,
                    flags=["--max-steps", str(args.reward_steps), "--normalize"],
                    seed=seed,
                    extra=args.reward_args,
                    needs=sft,
                    setting={},
                )
            )
        for row in rows:
            ran = [s["name"] for s in stages if s["seed"] == seed and s["row"] in (RL + ("sft+",))]
            flags = (budget(row.steps) if row.steps else []) + ([] if row.name in CONTROLS else lr)
            flags += row.flags + (
                ["--reward-model", os.path.join(output_dir, rm, "model")] if row.on_rm else []
            )
            needs = sft + ([rm] if row.on_rm else []) + (ran if not row.steps else [])
            for setting in grid.get(row.name, [{}]):
                name = "/".join(filter(None, [row.name, tag(setting), f"seed{seed}"]))
                stages.append(
                    stage(
                        name,
                        row=row.name,
                        script=row.script,
                        recipe=row.recipe,
                        model=base,
                        flags=flags,
                        seed=seed,
                        extra=row.extra,
                        needs=needs,
                        setting=setting,
                    )
                )
    return stages, base, seeds, grid


def curve_flags(steps, points):
    """A run's checkpoints for the curves: every steps / (points + 1) updates, all kept (and its last)."""
    return ["--save-every", str(max(1, steps // (points + 1))), "--save-total-limit", "0"] if points else []


def matched_steps(output_dir, stage):
    """sft+rl's updates: its seed's RL runs' mean logged FLOPs over those of one update of its seed's sft+ run
    (rounded, at least 1); RunsFailed when there is nothing to match."""
    control = [os.path.join(output_dir, n) for n in stage["needs"] if n.split("/")[0] == "sft+"]
    rl = [run_cost(os.path.join(output_dir, n))[2] for n in stage["needs"] if n.split("/")[0] in RL]
    if not control or not rl or not all(np.isfinite(rl)):
        raise RunsFailed(f"{stage['name']}: no sft+ run or logged RL FLOPs to match ({stage['needs']})")
    with open(os.path.join(control[0], "args.json")) as f:
        per_step = run_cost(control[0])[2] / json.load(f)["max_steps"]
    return max(1, round(float(np.mean(rl)) / per_step))


def prepare_output_dir(output_dir, stages, overwrite):
    """Refuse to mix with an earlier comparison unless --overwrite (which removes its runs)."""
    held = sorted(
        {s["name"].split("/")[0] for s in stages if os.path.exists(os.path.join(output_dir, s["name"]))}
    )
    if held and not overwrite:
        raise plumbing.UsageError(
            f"--output-dir {output_dir} already holds runs ({', '.join(held)}); "
            "pass --overwrite to replace them"
        )
    for name in held:
        shutil.rmtree(os.path.join(output_dir, name))
    os.makedirs(output_dir, exist_ok=True)


# === Running the scripts and reading their outputs ===
def read_metrics(run_dir):
    """metrics.jsonl -> list of rows (empty when the run wrote none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) if os.path.exists(path) else open(os.devnull) as f:  # no file: no rows
        return [json.loads(line) for line in f if line.strip()]


def main_curve(rows):
    """(metric name, steps, values) of the run's main training metric."""
    for name in MAIN_METRIC:
        points = [(r["step"], r[name]) for r in rows if name in r]
        if points:
            steps, values = zip(*points)
            return name, list(steps), list(values)
    return None, [], []


def flops_at(rows, step):
    """A run's training FLOPs up to and with `step` (its logged charts/flops, each an interval's sum)."""
    return float(sum(r.get("charts/flops", 0.0) for r in rows if r["step"] <= step))


def run_cost(run_dir):
    """-> [tokens trained, tokens generated, FLOPs]: sums of logged charts/tokens, /generated_tokens, /flops
    (NaN if never logged; generated: else iterations × batch × response length, 0 if it never samples)."""
    rows = read_metrics(run_dir)
    path = os.path.join(run_dir, "args.json")
    a = json.load(open(path)) if os.path.exists(path) else {}

    def total(k):
        return float(sum(r[k] for r in rows if k in r)) if any(k in r for r in rows) else float("nan")

    generated = (
        total("charts/generated_tokens")
        if any("charts/generated_tokens" in r for r in rows)
        else a["max_steps"] * a["batch_size"] * a["response_length"]
        if "response_length" in a
        else 0
    )
    return [total("charts/tokens"), float(generated), total("charts/flops")]


def run_stage(i, n, stage, output_dir):
    """Run one script to completion, its output in <name>.log -> (ok, wall seconds)."""
    log_path = os.path.join(output_dir, f"{stage['name']}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    cmd = [sys.executable, stage["script"]] + stage["flags"]
    print(f"[{i}/{n}] {stage['name']}: {shlex.join(cmd[1:])}", flush=True)
    # A forked script (--extra) may live anywhere: it still finds `common` and the toy data.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [common.HERE, os.environ.get("PYTHONPATH")])),
    }
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        rc = watch(proc, os.path.join(output_dir, stage["name"]), t0)
    wall = time.perf_counter() - t0
    if rc != 0:
        with open(log_path) as f:
            print(
                f"      FAILED (exit {rc}) after {wall:.0f} s; last lines of {log_path}:\n"
                + "".join(f.readlines()[-10:]),
                flush=True,
            )
        return False, wall
    name, _, values = main_curve(read_metrics(os.path.join(output_dir, stage["name"])))
    print(
        f"      done in {wall:.0f} s" + (f"; {name} {values[0]:.3f} -> {values[-1]:.3f}" if values else ""),
        flush=True,
    )
    return True, wall


def progress(run_dir):
    """(the last step a running script logged, its --max-steps), or None before its first step is logged."""
    try:
        with open(os.path.join(run_dir, "args.json")) as f:
            total = json.load(f)["max_steps"]
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            steps = [json.loads(line)["step"] for line in f if line.endswith("\n")]  # whole lines only
    except (OSError, ValueError, KeyError):  # not written yet, or being written
        return None
    return max(steps, default=0), total


def watch(proc, run_dir, t0, every=2.0):
    """Wait for a script -> its exit code, printing how far it is (the steps its metrics.jsonl logged) at each
    quarter of its --max-steps."""
    quarter = 0  # quarters shown
    while proc.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=every)
        step, total = progress(run_dir) or (0, 1)  # nothing logged yet: loading the model, compiling
        if 4 * step >= (quarter + 1) * total:
            quarter = 4 * step // total
            print(f"      step {step}/{total}, {time.perf_counter() - t0:.0f} s", flush=True)
    return proc.returncode


# === Evaluation (evaluate.py's protocol, in this process: one compilation for every model) ===
def evaluate_models(args, prompts_path, base, jobs, eval_dir):
    """jobs: [(key, seed, model dir, reward model dir or None)] -> {key: evaluate.per_prompt arrays}: each model
    on `prompts_path` against `base`, both sampled with `seed` (paired); outputs in eval_dir(key, seed)."""
    import evaluate  # JAX starts only now, after the training processes ended (a TPU admits one)

    def eargs(seed, rm):
        return evaluate.Args(
            model=base,
            baseline=base,
            prompts=prompts_path,
            num_prompts=args.num_prompts,
            reward_fn=(args.reward_fn,),
            reward_model=rm,
            chat_template=args.chat_template,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=seed,
        )

    mesh = common.make_mesh(None)
    ea = eargs(args.seed, None)
    prompts, rows, reward_fn = evaluate.check_args(ea, mesh)
    base_policy = evaluate.load_policy(base, mesh, ea)
    data = evaluate.prepare(ea, mesh, prompts, rows, base_policy.model.preprocessor.tokenizer)
    scorers = {}  # one a reward model (None: the task score only)
    base_outs = {}  # the base's responses, one set a (sampling seed, reward model)
    results = {}
    for key, seed, model_dir, rm in jobs:
        t0 = time.perf_counter()
        ea = eargs(seed, rm)
        if rm not in scorers:
            scorers[rm] = evaluate.make_scorer(ea, mesh, data, reward_fn)
        if (seed, rm) not in base_outs:
            base_outs[seed, rm] = evaluate.evaluate_policy(
                base_policy, data, scorers[rm], ea, mesh, baseline=base_policy
            )
        b = base_outs[seed, rm]
        outs = b  # a base_keys job: the base against itself
        if model_dir != base:
            policy = evaluate.load_policy(model_dir, mesh, ea, like=base_policy)
            evaluate.check_same_tokens(model_dir, policy.model, data, ea, key)
            outs = evaluate.evaluate_policy(policy, data, scorers[rm], ea, mesh, baseline=base_policy)
        results[key] = evaluate.per_prompt(outs, b)
        m = evaluate.summarize(outs, b)
        meta = {
            "model": model_dir,
            "baseline": base,
            "prompts": prompts_path,
            "num_prompts": len(data["prompts"]),
            "seed": seed,
            "temperature": args.temperature,
            **m,
        }
        evaluate.write_outputs(eval_dir(key, seed), meta, evaluate.examples(outs, data, 8, b), results[key])
        print(
            f"      {key} (seed {seed}): task score {m['score']:.3f}, KL {m['kl']:.3f} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    return results


def checkpoint_scores(args, base, run_dirs):
    """Greedy task score on the test split at each run's checkpoints before its end (model/, the table's)
    -> {run dir: [(step, score)]}; weights of other shapes than the base's (a LoRA run's) are not scored."""
    import evaluate
    import jax
    import orbax.checkpoint as ocp

    ea = evaluate.Args(
        model=base,
        prompts=args.test_prompts,
        num_prompts=args.num_prompts,
        seed=args.seed,
        reward_fn=(args.reward_fn,),
        chat_template=args.chat_template,
        max_new_tokens=args.max_new_tokens,
    )
    mesh = common.make_mesh(None)
    prompts, rows, reward_fn = evaluate.check_args(ea, mesh)
    policy = evaluate.load_policy(base, mesh, ea)
    data = evaluate.prepare(ea, mesh, prompts, rows, policy.model.preprocessor.tokenizer)
    scorer = evaluate.make_scorer(ea, mesh, data, reward_fn)
    bs = data["batch_size"]
    curves = {}
    for run_dir in run_dirs:
        folder = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        curves[run_dir] = []
        with open(os.path.join(run_dir, "args.json")) as f:
            last = json.load(f)["max_steps"]  # its end: model/, scored in the table
        steps = (
            [s for s in sorted(map(int, filter(str.isdigit, os.listdir(folder)))) if s < last]
            if os.path.isdir(folder)
            else []
        )
        for step in steps:
            with ocp.CheckpointManager(folder) as manager:  # ppo's weights: PPOParams(policy, value, head)
                params = manager.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore())
                ).state[0]
            params = params["policy"] if isinstance(params, dict) else params
            if [np.shape(w) for w in params] != [w.shape for w in policy.params]:
                print(f"      {run_dir}: its checkpoints hold other weights than {base}'s: no curve")
                break
            at = policy._replace(
                params=[jax.device_put(w, p.sharding) for w, p in zip(params, policy.params)]
            )
            # greedy: the key unused
            out = evaluate.respond(at, data, "greedy", jax.random.key(0), batch_size=bs, mesh=mesh)
            curves[run_dir].append((step, float(evaluate.score(scorer, data, out, bs, mesh)["score"].mean())))
        print(
            f"      {os.path.relpath(run_dir)}: greedy score at steps {steps}: "
            f"{[round(v, 3) for _, v in curves[run_dir]]}",
            flush=True,
        )
    return curves


# === STATISTICS: pure functions of per-prompt score tables [seeds S, prompts P] ===
def t_quantile(p, df):
    """Student-t quantile t_p(df) (SciPy's, a dependency of JAX's)."""
    import scipy.stats  # here: `import compare` stays light

    return float(scipy.stats.t.ppf(p, df))


def mean_interval(x, level=0.95):
    """Mean of x [S seeds, P prompts] and the half-width of its `level` interval (t, mean_variance's)."""
    m, var, df = mean_variance(x)
    return m, float(t_quantile((1 + level) / 2, df) * math.sqrt(var)) if var > 0 else 0.0


def p_above_zero(x):
    """One-sided p-value of "the mean of x [S, P] is above 0", t with mean_variance's variance and df: the
    claim "beats" of a paired difference x holds alone at 2.5% exactly when its 95% interval lies above 0."""
    import scipy.stats

    m, var, df = mean_variance(x)
    return float(scipy.stats.t.sf(m / math.sqrt(var), df)) if var > 0 else float(m <= 0)


def mean_variance(x):
    """Mean of x [S seeds, P prompts], the variance of that mean and its degrees of freedom, seeds and
    prompts random (crossed two-way random effects, Cornfield–Tukey):
    Var(mean) = (MS_seed + MS_prompt − MS_resid) / (S·P), Satterthwaite's df, each MS floored at MS_resid;
    S = 1: prompts only (seed noise unmeasured); var 0: no spread."""
    x = np.asarray(x, np.float64)
    s, p = x.shape
    m = x.mean()
    rows = x.mean(1)  # each seed's mean [S]
    cols = x.mean(0)  # each prompt's mean [P]
    ms_p = s * np.sum((cols - m) ** 2) / max(p - 1, 1)
    if s == 1:
        terms = [(ms_p, p - 1)]
    else:
        ms_s = p * np.sum((rows - m) ** 2) / (s - 1)
        ms_e = np.sum((x - rows[:, None] - cols[None] + m) ** 2) / ((s - 1) * max(p - 1, 1))
        terms = [(max(ms_s, ms_e), s - 1), (max(ms_p, ms_e), p - 1), (-ms_e, (s - 1) * (p - 1))]
    var = sum(t for t, _ in terms) / (s * p)
    if var <= 0 or p < 2:
        return float(m), 0.0, 0.0
    return float(m), float(var), float(sum(t for t, _ in terms) ** 2 / sum(t * t / d for t, d in terms))


def row_stats(arrays, base_arrays):
    """{metric: [S, P]} of a row and of the base -> {metric: (mean, ±)}, `delta`: score row − base, paired,
    and `p`: its one-sided p-value of "beats"."""
    diff = arrays["score"] - base_arrays["score"]
    return {
        **{k: mean_interval(v) for k, v in arrays.items()},
        "delta": mean_interval(diff),
        "p": p_above_zero(diff),
    }


def holm(pvalues, alpha):
    """Holm's step-down correction (Holm 1979) -> which claims of a family hold, the chance that any of them
    is false kept ≤ alpha: sorted ascending, the k-th p-value (from 0) of m must be ≤ alpha / (m − k), as
    must all before it. One claim alone: p ≤ alpha."""
    holds = [False] * len(pvalues)
    for k, i in enumerate(np.argsort(pvalues, kind="stable")):
        if pvalues[i] > alpha / (len(pvalues) - k):
            break
        holds[i] = True
    return holds


# === Report: the summary, the table (markdown), the picture ===
MIN_SEEDS = 3  # fewer: no claim (one seed measures no seed noise; two, too little: docs/compare.md)
ALPHA = 0.025  # one-sided: a lone "beats" claim holds exactly when its 95% interval lies above 0


def verdict(delta, name, seeds=MIN_SEEDS):
    """(Δ, ±) against `name` -> 'beats name (Δ …)', 'within noise of name (… covers 0)' or 'below …'; with
    fewer than MIN_SEEDS seeds no claim: 'needs ≥ 3 seeds vs name (Δ …)'."""
    d, h = delta
    word, covers = ("beats", "") if d > h else ("within noise of", " covers 0") if d >= -h else ("below", "")
    if seeds < MIN_SEEDS:
        word, covers = (f"needs ≥ {MIN_SEEDS} seeds vs", "")
    return f"{word} {name} (Δ {d:+.3f} ± {h:.3f}{covers})"


def summary(stats, costs, *, base_name, seeds):
    """The report's first lines: which rows beat which control (the base, and the row's own), with Holm's
    correction over every "beats" claim the table could make, and at what cost; with fewer than MIN_SEEDS
    seeds no claim, the rows ranked by their Δ vs the base instead (candidates for a run with more seeds)."""
    claims = [
        (name, against, st[d], st[p])
        for name, st in stats.items()
        if name != base_name
        for against, d, p in ((base_name, "delta", "p"), (st.get("control"), "delta_control", "p_control"))
        if d in st
    ]

    def cost(name):
        return f"{fmt(costs[name][2], top=1e10)} FLOPs, {costs[name][3]:.0f} s"  # FLOPs as 3.30e12

    if seeds < MIN_SEEDS:
        noise = "over prompts only: seed noise is unmeasured" if seeds == 1 else "from too few seeds to trust"
        ranked = sorted((c for c in claims if c[1] == base_name), key=lambda c: -c[2][0])
        return (
            f"**Summary: {seeds} seed(s), needs ≥ {MIN_SEEDS} seeds.** The intervals are {noise} "
            f"(docs/compare.md), so no row is said to beat another. Δ vs {base_name}, the candidates for "
            f"`--seeds {MIN_SEEDS}`: "
            + "; ".join(f"{n} {d:+.3f} ± {h:.3f} ({cost(n)})" for n, _, (d, h), _ in ranked)
        )
    holds = holm([c[3] for c in claims], ALPHA)
    won = {}
    for (name, against, (d, h), _), ok in zip(claims, holds):
        if ok:
            won.setdefault(name, []).append(f"{against} (Δ {d:+.3f} ± {h:.3f})")
    lines = [f"- **{n}** beats {' and '.join(w)}, at {cost(n)} a run" for n, w in won.items()]
    rest = [n for n in stats if n != base_name and n not in won]
    return "\n".join(
        [
            f"**Summary** (greedy test score, Δ paired per prompt and seed; Holm's correction over the "
            f'table\'s {len(claims)} "beats" claims, so the chance that any line below is false is '
            f"≤ {ALPHA:.1%}; {base_name}: {cost(base_name)}, paid once):",
            *lines,
            *([f"- no claim holds for {', '.join(rest)}"] if rest else []),
        ]
    )


def note(name, st, base_name, base_st, *, run_metrics, on_reward_model, seeds=MIN_SEEDS):
    """One line a row: verdicts against the base and the control, then the likely why (log-probs, RM, KL)."""
    if name == base_name:
        return "the base every other method starts from (one model, shared by every seed)"
    head = verdict(st["delta"], base_name, seeds) + (
        f"; {verdict(st['delta_control'], st['control'], seeds)}" if "delta_control" in st else ""
    )
    if st["delta"][0] + st["delta"][1] >= 0:
        return head
    head += ": "

    def mean(k, b=st):  # a metric's mean: this row's, or b's
        return b[k][0]

    chosen = [[r["eval/logps/chosen"] for r in rows if "eval/logps/chosen" in r] for rows in run_metrics]
    chosen = [c for c in chosen if len(c) >= 2]
    first, last = (np.mean([c[0] for c in chosen]), np.mean([c[-1] for c in chosen])) if chosen else (0, 0)
    if chosen and last < first:
        longer = "; greedy answers got longer" if mean("length") > mean("length", base_st) + 0.5 else ""
        return head + (
            f"held-out chosen log-prob fell too ({first:.2f} → {last:.2f}): the margin grew "
            f"by pushing both answers down (likelihood displacement){longer}"
        )
    if on_reward_model and "rm_score" in st and mean("rm_score") > mean("rm_score", base_st):
        return head + (
            f"reward hacking: reward-model score {mean('rm_score', base_st):.2f} → "
            f"{mean('rm_score'):.2f} while the task score fell; answers "
            f"{mean('length', base_st):.1f} → {mean('length'):.1f} tokens"
        )
    return head + (
        f"moved (KL {mean('kl'):.2f}) in a direction its training signal prefers but the task score does not"
    )


def fmt(v, digits=3, top=None):
    """(mean, ±) -> '0.558 ± 0.031'; a count -> '5120' / '1.23M' / '3.40e12', in the unit of `top` (a table
    column's largest: '0.06M' beside '1.23M', not '55648'); NaN or None -> '–'."""
    if isinstance(v, tuple):
        return f"{v[0]:.{digits}f} ± {v[1]:.{digits}f}"
    if v is None or not np.isfinite(v):
        return "–"
    top = v if top is None else top
    return f"{v:.2e}".replace("e+", "e") if top >= 1e10 else f"{v / 1e6:.2f}M" if top >= 1e5 else f"{v:.0f}"


def table(rows, base_name, with_rm):
    """rows: [(name, stats or None, cost [tokens trained, generated, FLOPs, wall s], note)] -> markdown."""
    rm = ["rm_score"] if with_rm else []  # the RM score column: only where a row trained on a reward model
    cols = [
        "method",
        "task score",
        f"Δ vs {base_name} (paired)",
        "Δ vs control (paired)",
        "sampled score",
        *["RM score"] * len(rm),
        f"win rate vs {base_name}",
        f"KL from {base_name}",
        "length",
        "tokens trained",
        "tokens generated",
        "FLOPs",
        "wall time",
        "notes",
    ]
    keys = ["score", "delta", "score_sampled", *rm, "win", "kl", "length"]
    lines = [
        "| " + " | ".join(cols) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(cols) - 2) + ["---"]) + "|",
    ]
    tops = np.nanmax(
        [[np.nan if c is None else c for c in cost[:3]] for _, _, cost, _ in rows] + [[0] * 3], 0
    )
    for name, st, cost, text in rows:
        cells = [
            fmt(st[k], 2 if k in ("rm_score", "kl", "length") else 3) if st and k in st else "–" for k in keys
        ]
        against = f"{fmt(st['delta_control'])} ({st['control']})" if st and "delta_control" in st else "–"
        cells.insert(2, against)
        cells += [fmt(c, top=t) for c, t in zip(cost[:3], tops)] + [f"{cost[3]:.0f} s" if cost[3] else "–"]
        lines.append("| " + " | ".join([f"**{name}**"] + cells + [text]) + " |")
    return "\n".join(lines)


def seed_band(runs):
    """Each seed's [[FLOPs, score]] -> x, mean, min, max over seeds at the first k - 1 points and the ends (k: the
    fewest points; sft+rl's seeds may differ by a checkpoint)."""
    fewest = min(map(len, runs))
    xy = np.stack([np.concatenate([r[: fewest - 1], r[-1:]]) for r in runs])  # [seeds, points, 2]
    return xy[..., 0].mean(0), xy[..., 1].mean(0), xy[..., 1].min(0), xy[..., 1].max(0)


def plot(curves, score_curves, stats, *, base_name, temperature, path):
    """Each row's main training metric (left; every seed: `curves`), the test scores ± intervals (middle), the
    greedy test score against training FLOPs, SFT included (right: `score_curves`; mean over seeds, band: their
    range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(1, -(-len(curves) // 2))  # the training curves: two rows of them
    fig = plt.figure(figsize=(3.0 * cols + 10.0, 6.0))
    grid = fig.add_gridspec(2, cols + 2, width_ratios=[1] * cols + [1.6, 2.2])
    for i, (name, runs) in enumerate(curves.items()):
        ax = fig.add_subplot(grid[i % 2, i // 2])
        for k, (metric, steps, values) in enumerate(runs):  # seed --seed bold, the others thin
            ax.plot(steps, values, marker=None if k else ".", lw=0.8 if k else 1.2, alpha=0.6 if k else 1)
        ax.set_title(f"{name}: {runs[0][0]}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    ax = fig.add_subplot(grid[:, cols])
    names = list(stats)
    x = np.arange(len(stats))
    for dx, key, label in ((-0.2, "score", "greedy"), (0.2, "score_sampled", f"sampled (T={temperature:g})")):
        ax.bar(
            x + dx,
            [stats[n][key][0] for n in names],
            0.4,
            yerr=[stats[n][key][1] for n in names],
            capsize=3,
            label=label,
        )
    if base_name in stats:
        ax.axhline(stats[base_name]["score"][0], ls="--", lw=1, color="gray", label=f"{base_name} greedy")
    ax.set_xticks(x, names, rotation=30, fontsize=8)
    ax.legend(fontsize=8, loc="upper right")
    ax.set(ylim=(0, 1.05), ylabel="test task score (mean ± 95% interval)")
    ax.set_title("final scores (evaluate.py protocol, test split)", fontsize=10)
    ax = fig.add_subplot(grid[:, cols + 1])
    span = []  # (first FLOPs, lowest, highest) of each row drawn in full: the zoom
    top = score_curves[base_name][0][-1, 1] if base_name in score_curves else np.nan  # the base's end score
    for i, (n, runs) in enumerate(score_curves.items()):
        x, mean, low, high = seed_band(runs)
        color = plt.cm.tab20(2 * i % 20 + i // 10)
        out = n != base_name and bool(mean.min() < top - 0.06)  # far below the base: outside the zoom
        ax.plot(
            x, mean, marker="o", ms=3, lw=1.2, label=n + f" (to {mean[-1]:.2f}, below)" * out, color=color
        )
        ax.fill_between(x, low, high, alpha=0.15, color=color)
        if n != base_name and not out:
            span.append((x[0], low.min(), high.max()))
    # zoomed on the post-training range: the base climbs in from the left, rows far below leave (legend)
    if span:
        x0 = min(span)[0]
        low, high = np.array(span)[:, 1:].T
        ax.set(xlim=(0.7 * x0, None), ylim=(low.min() - 0.03, high.max() + 0.03))
    ax.set(xlabel=FLOPS_LABEL, ylabel="greedy task score, test split (band: the seeds' range)")
    ax.set_title("score against compute (checkpoints)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    args,
    output_dir,
    *,
    stages,
    rows,
    stats,
    costs,
    curves,
    score_curves,
    sweep,
    base_name,
    reward_acc,
    seeds,
    total,
):
    """comparison.md (summary, table, sweep, protocol, commands) and comparison.png into output_dir -> the
    summary and the table."""
    md = table(rows, base_name, any("rm_score" in st for st in stats.values()))
    md = summary(stats, costs, base_name=base_name, seeds=len(seeds)) + "\n\n" + md

    def short(p):  # relative to the working directory, unless outside it
        return p if os.path.relpath(p).startswith("..") else os.path.relpath(p)

    runs = "\n".join(f"    python {short(s['script'])} {shlex.join(s['flags'])}" for s in stages)
    rm_line = (
        f"- reward model (PPO's reward, trained on the same preference pairs, one per seed): held-out pair "
        f"accuracy {reward_acc:.3f} (mean over seeds).\n"
        if reward_acc is not None
        else ""
    )
    # sweep: {row: [{setting, stats on the eval split, kept}]} -> every setting's eval score
    sweep_md = (
        f"\n## Sweep (chosen on the eval split, {short(args.eval_prompts)})\n\n"
        f"| method | setting | eval task score | Δ vs {base_name} (eval, paired) | kept |\n"
        "|---|---|---:|---:|---|\n"
        + "".join(
            f"| {r} | `{t['setting']}` | {fmt(t['stats']['score'])} | {fmt(t['stats']['delta'])} | "
            f"{'**kept**' * t['kept']} |\n"
            for r, settings in sweep.items()
            for t in settings
        )
        + "\nEach setting trained with every seed; the one with the best mean greedy task score on "
        "the eval split is kept, and only it is scored on the test split (the table above).\n"
        if sweep
        else ""
    )
    ppo_note = "; ppo includes its reward model" if any(s["row"] == "reward" for s in stages) else ""
    text = f"""# Post-training recipes compared on `{args.model}`

`python compare.py {shlex.join(sys.argv[1:])}` — {time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, \
{total / 60:.1f} min in all on {os.cpu_count()} CPU cores; seeds {", ".join(map(str, seeds))}.

{md}

- Every cell: mean over {len(seeds)} training seed(s) × the test prompts ({short(args.test_prompts)}), \
± the half-width of a 95% interval that treats seeds and prompts both as random draws (crossed two-way \
random effects, Satterthwaite t; docs/compare.md). **Δ vs {base_name}**: the greedy task score minus \
{base_name}'s, paired per prompt and per seed; "within noise" where its interval covers 0. {base_name} is \
one model, shared by every seed.
- **task score**: mean `{short(args.reward_fn)}`, greedy responses; **sampled score**: one sample per prompt \
at T={args.temperature:g} (a seed-s model, and {base_name} against it, sampled with seed s).
- **win rate vs {base_name}**: share of prompts whose greedy answer scores higher than {base_name}'s (ties \
count half).
- **KL from {base_name}**: mean over prompts of Σ_t [log π(y_t) − log π_{base_name}(y_t)] on the model's own \
sampled responses (nats per response, float32, prompt and padding masked).
- **length**: greedy response tokens before EOS. Costs are means over seeds of each run's own logged numbers: \
**tokens trained** (`charts/tokens`: real, non-padding batch tokens; PPO, GRPO, RLOO: prompt + response \
tokens of each rollout batch, once), **tokens generated** (`charts/generated_tokens`: sampled, through each \
EOS), **FLOPs** (`charts/flops`: 6N a trained token, 2N an extra forward — reference, value, reward model, \
sampling; N = weights used in matmuls), **wall time** (the whole script: start-up, compilation, training, \
saving){ppo_note}; {base_name}'s costs are paid once for every row.
{rm_line}{sweep_md}
![training curves, final scores, score against compute](comparison.png)

Right: the greedy test score at each run's checkpoints (`--curve-points`) and end against its training FLOPs, \
{base_name} included (line: mean over seeds; band: their range; curves.json).

Commands run:

{runs}
"""
    with open(os.path.join(output_dir, "comparison.md"), "w") as f:
        f.write(text)
    plot(
        curves,
        score_curves,
        stats,
        base_name=base_name,
        temperature=args.temperature,
        path=os.path.join(output_dir, "comparison.png"),
    )
    return md


def main(args):
    output_dir = args.output_dir or plumbing.default_output_dir("compare", args.model, args.seed)
    stages, base, seeds, grid = plan(args, output_dir)
    check_data(args, stages, grid)  # before the task's held-out prompts stand in for those not given
    eval_prompts, test_prompts = task_prompts(args)
    args = dataclasses.replace(args, eval_prompts=eval_prompts, test_prompts=test_prompts)
    common.load_reward_fn(args.reward_fn)
    # --model resolves (no SFT stage: it is the base itself) and every held-out prompt reads
    for path, flag in ((args.eval_prompts, "--eval-prompts"), (args.test_prompts, "--test-prompts")):
        common.read_dataset(path, "prompt", common.chat_template(args.model, args.chat_template), flag)
    prepare_output_dir(output_dir, stages, args.overwrite)
    t_start = time.perf_counter()
    ok = {}  # each run: exited 0
    walls = {}  # each run's wall seconds
    for i, stage in enumerate(stages, 1):
        missing = [n for n in stage["needs"] if not ok.get(n)]
        if missing:
            print(f"[{i}/{len(stages)}] {stage['name']}: skipped ({', '.join(missing)} failed)", flush=True)
            ok[stage["name"]] = False
            walls[stage["name"]] = 0.0
            continue
        if stage["row"] == "sft+rl":  # its budget is known only now: the RL rows' logged FLOPs
            steps = matched_steps(output_dir, stage)
            stage["flags"][2:2] = ["--max-steps", str(steps)] + curve_flags(steps, args.curve_points)
        ok[stage["name"]], walls[stage["name"]] = run_stage(i, len(stages), stage, output_dir)
    if "sft" in ok and not ok["sft"]:
        raise RunsFailed(f"sft failed: nothing to compare (see {output_dir}/sft.log)")
    md = evaluate_and_report(
        args, output_dir, stages, base=base, seeds=seeds, grid=grid, ok=ok, walls=walls, t_start=t_start
    )
    print(
        f"\n{md}\n\ndone in {(time.perf_counter() - t_start) / 60:.1f} min: "
        f"{output_dir}/comparison.md, comparison.png"
    )
    failed = [name for name, done in ok.items() if not done]
    if failed:
        raise RunsFailed(
            f"{len(failed)} of {len(ok)} runs failed or were skipped ({', '.join(failed)}); "
            f"the report covers the rest (logs in {output_dir})"
        )


def stack(results, keys, base_keys):
    """Per-prompt arrays of one row's seeds and of the base's -> ({metric: [S, P]}, {metric: [S, P]})."""
    names = set.intersection(*(set(results[k]) for k in keys + base_keys))
    return (
        {n: np.stack([results[k][n] for k in keys]) for n in names},
        {n: np.stack([results[k][n] for k in base_keys]) for n in names},
    )


def stage_cost(output_dir, stage, walls):
    """run_cost + [wall s] of one run; PPO on a reward model pays for that model too."""
    names = [stage["name"]] + [n for n in stage["needs"] if n.startswith("reward/")]
    return list(np.sum([run_cost(os.path.join(output_dir, n)) + [walls.get(n, 0.0)] for n in names], 0))


def versus_base(res, runs, base_keys):
    """row_stats of `runs` (one row's stages) against the base sampled with each run's seed."""
    return row_stats(*stack(res, [s["name"] for s in runs], [base_keys[s["seed"]] for s in runs]))


def choose_settings(args, grid, swept, evaluate_on, base_keys):
    """Swept runs scored on the eval split -> ({row: kept}, {row: [{setting, stats, kept}]}): best mean."""
    print(f"[eval] sweep: {len(swept)} runs on the eval split ({args.eval_prompts})", flush=True)
    res = evaluate_on("eval", swept)

    def runs(row, t):
        return [s for s in swept if s["row"] == row and s["setting"] == t]

    sweep = {
        row: [
            {"setting": t, "stats": versus_base(res, runs(row, t), base_keys), "kept": False}
            for t in dict.fromkeys(map(tag, grid[row]))
            if runs(row, t)
        ]
        for row in grid
    }
    for settings in sweep.values():
        if settings:
            max(settings, key=lambda x: x["stats"]["score"][0])["kept"] = True
    return {row: s["setting"] for row, settings in sweep.items() for s in settings if s["kept"]}, sweep


def score_curve(res, at, output_dir, stage, metrics, *, walls, base_keys, is_base, sft_flops):
    """One run's [[training FLOPs, greedy test score]]: the base's point (after SFT), its checkpoints `at`
    (the base's FLOPs, a reward model's, its own up to each), its end (the table's score)."""
    seed = stage["seed"]
    run_dir = os.path.join(output_dir, stage["name"])
    own = run_cost(run_dir)[2]
    offset = 0.0 if is_base else sft_flops + stage_cost(output_dir, stage, walls)[2] - own
    start = [] if is_base or not sft_flops else [(sft_flops, res[base_keys[seed]]["score"].mean())]
    end = [(offset + own, res[base_keys[seed] if is_base else stage["name"]]["score"].mean())]
    return np.array(start + [(offset + flops_at(metrics, step), v) for step, v in at.get(run_dir, [])] + end)


def evaluate_and_report(args, output_dir, stages, *, base, seeds, grid, ok, walls, t_start):
    """Pick swept settings on the eval split, score the kept runs and the base on the test split -> table."""
    base_name = "sft" if "sft" in ok else "base"
    done = [s for s in stages if s["row"] not in ("sft", "reward") and ok[s["name"]]]
    base_keys = {seed: f"{base_name} seed{seed}" for seed in seeds}

    def reward_model(seed, split):  # the seed's reward model (PPO's), scored on the test split only
        trained = split == "test" and ok.get(f"reward/seed{seed}")
        return os.path.join(output_dir, f"reward/seed{seed}/model") if trained else None

    def evaluate_on(split, runs):  # the runs, the base each seed
        def eval_dir(key, seed):  # a run's own folder; the base's: one a seed
            own = os.path.join(output_dir, key, f"eval_{split}")
            return own if key in ok else os.path.join(output_dir, base_name, f"eval_{split}", f"seed{seed}")

        jobs = [(k, x, base, reward_model(x, split)) for x, k in base_keys.items()]
        jobs += [
            (
                s["name"],
                s["seed"],
                os.path.join(output_dir, s["name"], "model"),
                reward_model(s["seed"], split),
            )
            for s in runs
        ]
        prompts = args.eval_prompts if split == "eval" else args.test_prompts
        return evaluate_models(args, prompts, base, jobs, eval_dir)

    swept = [s for s in done if s["row"] in grid]
    kept, sweep = choose_settings(args, grid, swept, evaluate_on, base_keys) if swept else ({}, {})
    final = [s for s in done if s["setting"] == kept.get(s["row"], "" if s["row"] not in grid else None)]
    print(f"[eval] {len(final)} runs and {base_name} on the test split ({args.test_prompts})", flush=True)
    res = evaluate_on("test", final)
    stats = {base_name: row_stats(*stack(res, list(base_keys.values()), list(base_keys.values())))}
    costs = {
        base_name: stage_cost(output_dir, stages[0], walls) if base_name == "sft" else [np.nan] * 3 + [0.0]
    }
    scored = [
        os.path.join(output_dir, s["name"]) for s in final + [s for s in stages[:1] if s["row"] == "sft"]
    ]
    at = checkpoint_scores(args, base, scored) if args.curve_points else {}  # the base's own curve too
    sft = costs[base_name][2] if np.isfinite(costs[base_name][2]) else 0.0  # a given base: its FLOPs unknown
    curves = {}  # each row's main training metric, every seed: the left panels
    score_curves = {}  # each row's greedy test score against FLOPs, every seed: the right panel
    rows = []
    names = [base_name] + list(dict.fromkeys(s["row"] for s in stages if s["row"] not in ("sft", "reward")))
    for name in names:
        runs = [s for s in final if s["row"] == name] or [s for s in stages if s["name"] == name]
        metrics = [read_metrics(os.path.join(output_dir, s["name"])) for s in runs]
        if name != base_name and runs:
            stats[name] = versus_base(res, runs, base_keys)
            costs[name] = list(np.mean([stage_cost(output_dir, s, walls) for s in runs], 0))
        if metrics and main_curve(metrics[0])[0]:
            curves[name] = [main_curve(m) for m in metrics]
        on_rm = any("--reward-model" in s["flags"] for s in runs)
        score = (
            [
                score_curve(
                    res,
                    at,
                    output_dir,
                    s,
                    m,
                    walls=walls,
                    base_keys=base_keys,
                    is_base=name == base_name,
                    sft_flops=sft,
                )
                for s, m in zip(runs, metrics)
            ]
            if name in stats
            else []
        )
        if score and np.isfinite(np.concatenate(score)).all():  # the base's point, the checkpoints, the end
            score_curves[name] = score
        ctl = CONTROL.get(name, "sft+")
        control = {s["seed"]: s["name"] for s in final if s["row"] == ctl}
        paired = [s for s in runs if s["seed"] in control] if base_name not in (name, ctl) else []
        if name in stats and paired:  # paired per prompt and per seed against the control of the same seed
            a, c = stack(res, [s["name"] for s in paired], [control[s["seed"]] for s in paired])
            diff = a["score"] - c["score"]
            stats[name].update(delta_control=mean_interval(diff), p_control=p_above_zero(diff), control=ctl)
        rows.append((name, metrics, on_rm))
    rows = [
        (
            f"{n} (`{kept[n]}`)" if n in kept else n,
            stats.get(n),
            costs.get(n, [np.nan] * 3 + [0.0]),
            note(
                n,
                stats[n],
                base_name,
                stats[base_name],
                run_metrics=m,
                on_reward_model=on_rm,
                seeds=len(seeds),
            )
            if n in stats
            else f"failed or skipped: see {n}/*.log",
        )
        for n, m, on_rm in rows
    ]  # controls may come later
    held_out = [  # each reward model's held-out accuracies, as logged
        [
            r["eval/accuracy"]
            for r in read_metrics(os.path.join(output_dir, f"reward/seed{x}"))
            if "eval/accuracy" in r
        ]
        for x in seeds
    ]
    accs = [a[-1] for a in held_out if a]  # each reward model's last held-out one
    reward_acc = float(np.mean(accs)) if accs else None
    with open(os.path.join(output_dir, "curves.json"), "w") as f:  # the right panel's points, to re-plot
        json.dump({n: [c.tolist() for c in cs] for n, cs in score_curves.items()}, f)
    return write_report(
        args,
        output_dir,
        stages=stages,
        rows=rows,
        stats=stats,
        costs=costs,
        curves=curves,
        score_curves=score_curves,
        sweep=sweep,
        base_name=base_name,
        reward_acc=reward_acc,
        seeds=seeds,
        total=time.perf_counter() - t_start,
    )


if __name__ == "__main__":
    sys.argv[1:] = quick_argv(sys.argv[1:])  # --quick: its values unless a flag given says otherwise
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
