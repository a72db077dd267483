"""Compare post-training recipes on one task: SFT, then DPO, SimPO, ORPO, KTO, reward model + PPO, GRPO, RLOO.
Every script runs through its real CLI (a subprocess; a fork slots in by name, `--extra mydpo.py`); each seed
trains its own SFT base, and each row is read against it and against controls matched to it in information
(sft-chosen: SFT on the pairs' chosen answers; rft: SFT on its own samples the checker accepts) and in compute
(each control run at that row's logged FLOPs), paired 95% intervals, Holm's correction over every "beats"
claim and a method-against-method Δ matrix. --sweep chooses on the eval split (the curves are scored there
too); the test split is read once, at the end. Writes comparison.md, comparison.png, results.json (every
cell, the recipe and where each value came from, costs, curves) and scores.npz (the per-prompt test scores).
Your own task: your preference pairs (every run's data derived from them), held-out prompts and checker:
    python compare.py --model gemma_2b --dataset pairs.jsonl --eval-prompts eval.jsonl --test-prompts test.jsonl \
        --reward-fn checker.py:score
Offline, a first look in minutes (`--quick`), and the bundled comparison task (data/compare/):
    python compare.py --model tiny --quick
    python compare.py --model tiny --seeds 3 --sweep all.learning_rate=2e-5,2e-4   # docs/comparison.md
"""

import concurrent.futures
import contextlib
import functools
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Annotated, Literal, NamedTuple

import plumbing  # the run shell: the exit boundary, --help from this file's source (instant to import)

# `python compare.py --help`: before the imports below
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (data files, reward functions, mesh; JAX's devices start only to evaluate)
import numpy as np  # noqa: E402
import tyro  # noqa: E402
from compare_stats import claims_of, holm, mean_interval, p_above_zero, pairwise, row_stats, t_quantile  # noqa: E402, F401

METHODS = (
    "sft",
    "dpo",
    "simpo",
    "orpo",
    "kto",
    "ppo",
    "grpo",
    "rloo",
    "distill",
    "sft+",
    "sft-chosen",
    "rft",
)
PREFERENCE = ("dpo", "simpo", "orpo", "kto")  # started from the SFT model on the same preference data
# The controls, each run once per row it is read against (`kind@row`), from that seed's base, for as many
# updates as match that row's logged FLOPs (matched_steps); which rows each reads: a row's signal
CONTROLS = {
    "sft+": ("prefs", "checker", "teacher"),  # the demonstrations again: "it only trained longer"
    "sft-chosen": ("prefs",),  # the pairs' chosen answers: "it is SFT on better answers"
    "rft": ("checker",),  # its own samples the checker accepts: "it imitates what passed the checker"
}
INFORMATION = {"prefs": "sft-chosen", "checker": "rft"}  # the control a row must clear to "beat" anything
MATCH = 0.10  # a control whose FLOPs miss its row's by more runs again once, at its own measured FLOPs a step
RepeatedStr = Annotated[tuple[str, ...], tyro.conf.UseAppendAction]  # `--flag a --flag b` -> ("a", "b")
MAIN_METRIC = ("objective/scores", "reward", "train/loss")  # the curve plotted per run: the first one logged


class RunsFailed(plumbing.RunFailed):
    """A script exited non-zero (or was skipped for one that did): exit 1, after the report of the rest."""


@dataclasses.dataclass
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
    dataset: str = ""
    """your preference pairs (TRL's prompt/chosen/rejected: strings or message lists, or an implicit prompt; any
    --dataset form): each run's data derived from them into <output-dir>/data/ (derive); you bring --reward-fn,
    --eval-prompts, --test-prompts, and the RL rows' prompts if the pairs have no `prompt` field"""
    methods: str = "sft,dpo,simpo,orpo,kto,ppo,grpo,rloo,sft-chosen,rft"
    """comma-separated subset of METHODS (ppo: --ppo-reward; grpo, rloo: --reward-fn); the controls, one run
    per row they read, at its FLOPs: sft-chosen (SFT on the pairs' chosen answers) reads the preference rows
    and PPO on a reward model, rft (grpo.py --accept-reward: SFT on its own accepted samples) the checker
    rows, sft+ (the demonstrations again) every row; distill (not by default): from --teacher-model"""
    teacher_model: str | None = None
    """the distill row's frozen teacher (any --model form, the base's vocabulary), e.g. a larger sibling"""
    extra: tuple[str, ...] = ()
    """forked scripts (e.g. mydpo.py), each run like dpo from the SFT model; the row is the file's name"""
    quick: bool = False
    """a first look in minutes: QUICK's methods, budgets, 1 seed, 200 test prompts, no curves (a flag you
    give keeps its value: quick_argv); one seed measures no seed noise, so the report claims nothing"""
    seeds: int = 3
    """seeds --seed, --seed+1, …: each trains its own SFT base and every row from it (the base's noise is in
    every interval)"""
    sweep: RepeatedStr = ()
    """`row.flag=v1,v2,…` (repeatable; two flags of a row: their grid); row: a method, a control (every run of
    it), or `all` (every row, controls included: the same tuning for each), e.g. all.learning_rate=2e-5,2e-4;
    every setting × seed, scored on --eval-prompts, the best mean greedy score kept and alone tested"""
    # budgets
    sft_steps: int = 1000
    """SFT updates (each seed's base)"""
    steps: int = 100
    """updates of each preference method (dpo, simpo, orpo, kto, --extra) and distill"""
    reward_steps: int = 40
    """reward model updates (before PPO)"""
    ppo_steps: int = 20
    """PPO iterations (one rollout batch + 4 epochs × 2 mini-batches of updates each)"""
    grpo_steps: int = 200
    """GRPO iterations (8 prompts × 8 completions + one update each)"""
    rloo_steps: int = 200
    """RLOO iterations (as GRPO's: 8 prompts × 8 completions + one update each)"""
    learning_rate: float = 5e-5
    """every row's peak learning rate after SFT (controls included) unless --sweep chooses one; the recipe's
    other flags, each with its source: RECIPE"""
    accept_reward: float = 1.0
    """rft keeps a sample whose --reward-fn score reaches this (the task's checker: 1, exactly right)"""
    ppo_reward: Literal["model", "fn", "both"] = "both"
    """`model`: PPO optimises a reward model trained on the preference pairs; `fn`: --reward-fn; `both`"""
    # pass-through flags, appended last (they override compare's choices); write them with `=`
    sft_args: str = ""
    """extra flags for sft.py, e.g. --sft-args="--learning-rate 5e-4" (the bases and the sft+ controls)"""
    sft_chosen_args: str = ""
    """extra flags for the sft-chosen controls (sft.py); their data: --dataset's chosen answers, or --dataset FILE"""
    rft_args: str = ""
    """extra flags for the rft controls (grpo.py --accept-reward)"""
    dpo_args: str = ""
    """extra flags for dpo.py"""
    simpo_args: str = ""
    """extra flags for simpo.py"""
    orpo_args: str = ""
    """extra flags for orpo.py"""
    kto_args: str = ""
    """extra flags for kto.py (its default data: the same pairs, unpaired)"""
    reward_args: str = ""
    """extra flags for reward.py"""
    ppo_args: str = ""
    """extra flags for ppo.py"""
    grpo_args: str = ""
    """extra flags for grpo.py"""
    rloo_args: str = ""
    """extra flags for rloo.py"""
    distill_args: str = ""
    """extra flags for distill.py"""
    extra_args: str = ""
    """extra flags for every --extra script"""
    # evaluation (evaluate.py's protocol)
    eval_prompts: str | None = None
    """held-out prompts where --sweep chooses and the curves are scored (the eval split); None: --task's"""
    test_prompts: str | None = None
    """held-out prompts of the reported numbers, read once at the end (the test split); None: --task's"""
    num_prompts: int = 0
    """the first N prompts of each split (0: all: 200 eval, 500 test)"""
    reward_fn: str = os.path.join(common.HERE, "data", "toy.py") + ":batch_score"
    """the task score, `path.py:function`"""
    max_new_tokens: int = 16
    """tokens generated per prompt"""
    temperature: float = 1.0
    """temperature of the sampled responses (KL is measured on them)"""
    curve_points: int = 3
    """checkpoints a run keeps and is scored at (greedy, eval split) besides its end: the score-against-FLOPs
    curves; at real sizes each is weights + optimizer state on disk; 0: none"""
    seed: int = 0
    """the first of --seeds; a model of seed s (its base too) is evaluated with sampling seed s"""
    # outputs
    output_dir: str | None = None
    """None: runs/compare__{model}__{seed}__{time}; one sub-directory per run"""
    overwrite: bool = False
    """replace the runs already in --output-dir (otherwise refused)"""
    jobs: int = 1
    """runs at a time (a run starts once what it needs has finished: its base, a control's row); 1: in plan
    order. On a shared machine each run's wall seconds then include the others'"""
    keep_finished: bool = False
    """reuse the runs --output-dir already holds finished (model/ written; their seconds from its walls.json),
    run the rest: e.g. more seeds at the settings an earlier run chose (docs/comparison.md)"""


# === The plan: which script runs, from which model, with which flags, for which seed and setting ===
# Each script's fixed flags, each group with where its value came from (results.json and the report print
# them); the learning rate is --learning-rate or the eval sweep's, for every row alike (the base's: below)
TRL = "TRL's default for the method (the script's own), not tuned"
BUDGET = "the comparison's budget: the same for every row of its kind, not tuned"
SCHEDULE = "a stated schedule: warmup, then cosine to 10% of the peak, the same for every preference row"
PILOT = (
    "set by one-seed pilots that read the test split before this protocol (docs/comparison.md, 'How the "
    "task and recipe came to be'); not re-tuned: the base's eval curve in this run shows where it stands"
)
COSINE_TO_10 = " --lr-scheduler-type cosine_with_min_lr --min-lr-rate 0.1"  # warmup, then to 10% of the peak
SAMPLER = ("--num-generations 8 --max-prompt-length 64 --response-length 16", BUDGET + ": 8 × 8 a step")
SFT_STEP = ("--batch-size 64 --max-length 512", BUDGET + ": 64 sequences a step, a preference step's tokens")
RECIPE = {
    "sft": [
        ("--batch-size 32 --max-length 512", BUDGET),
        ("--learning-rate 1e-3 --warmup-steps 20" + COSINE_TO_10, PILOT),
    ],
    "sft+": [
        SFT_STEP,
        ("--warmup-steps 0 --lr-scheduler-type constant", "a stated constant rate for a control"),
    ],
    "sft-chosen": [SFT_STEP, ("--warmup-steps 0 --lr-scheduler-type constant", "as sft+'s")],
    "dpo": [
        ("--batch-size 32 --max-length 512", BUDGET),
        ("--warmup-steps 5" + COSINE_TO_10, SCHEDULE),
        ("--beta 0.1", TRL),
        ("--sft-weight 1.0", "RPO's α = 1 (Pang et al. 2024): an NLL on the chosen; the row is DPO+NLL"),
    ],
    "simpo": [
        ("--batch-size 32 --grad-accum-steps 1 --max-length 512", BUDGET),
        ("--warmup-steps 5" + COSINE_TO_10, SCHEDULE),
        ("--beta 2.0 --gamma 1.0", "simpo.py's defaults (the SimPO paper's), not tuned"),
        ("--sft-weight 1.0", "TRL's CPO-SimPO default cpo_alpha = 1; the row is SimPO+NLL"),
    ],
    "orpo": [
        ("--batch-size 32 --max-length 512", BUDGET),
        ("--warmup-steps 5" + COSINE_TO_10, SCHEDULE),
        ("--beta 0.1", TRL),
        (
            "--no-prompt-nll",
            "an eval-split trial on the toy task (docs/compare.md): the prompt's NLL swamped it",
        ),
    ],
    "kto": [
        ("--batch-size 64 --max-length 512", BUDGET + ": 64 completions, dpo's 32 pairs"),
        ("--warmup-steps 5" + COSINE_TO_10, SCHEDULE),
        ("--beta 0.1", TRL),
    ],
    "reward": [
        ("--batch-size 32 --max-length 512 --normalize", BUDGET),
        ("--learning-rate 1e-3 --warmup-steps 10" + COSINE_TO_10, "the base's rate, as SFT; not tuned"),
    ],
    "ppo": [
        ("--batch-size 32 --num-mini-batches 2 --max-prompt-length 64 --response-length 16", BUDGET),
        ("--kl-coef 0.05", TRL),
        ("--missing-eos-penalty 1.0", "the N implementation details' penalty (Huang et al. 2024), not tuned"),
        ("--lr-scheduler-type linear", TRL + ": linear to 0"),
    ],
    "grpo": [
        ("--batch-size 64", BUDGET),
        SAMPLER,
        ("--beta 0.0", TRL),
        ("--lr-scheduler-type constant_with_warmup", "a stated constant rate"),
    ],
    "rloo": [
        ("--batch-size 64", BUDGET),
        SAMPLER,
        ("--beta 0.05", TRL),
        ("--lr-scheduler-type constant_with_warmup", "as grpo's"),
    ],
    # grpo.py --accept-reward: grpo's sampler, batch and schedule, SFT on the accepted samples instead of Â
    "rft": [
        ("--batch-size 64", BUDGET),
        SAMPLER,
        ("--beta 0.0 --lr-scheduler-type constant_with_warmup", "as grpo's"),
    ],
    # one completion per prompt, 64 a step (grpo's 8 x 8), reverse KL (TRL's β = 1)
    "distill": [
        ("--batch-size 64 --max-prompt-length 64 --response-length 16", BUDGET),
        ("--warmup-steps 5" + COSINE_TO_10, SCHEDULE),
    ],
}


# --task compare: data/compare/{kind}_train.jsonl (+ _eval but for prompts), before the recipe
TASK_DATA = {
    "sft": "sft",
    "sft+": "sft",
    "sft-chosen": "chosen",
    "dpo": "prefs",
    "simpo": "prefs",
    "orpo": "prefs",
    "reward": "prefs",
    "kto": "kto",
    "ppo": "prompts",
    "grpo": "prompts",
    "rloo": "prompts",
    "rft": "prompts",
    "distill": "prompts",
}
DATA_KIND = {  # what a run's `--<row>-args="--dataset NAME"` holds where compare has no data for it
    "sft": ("DEMOS", "demonstrations"),
    "chosen": ("CHOSEN", "chosen answers, as prompt + completion"),
    "prefs": ("PAIRS", "preference pairs"),
    "kto": ("ROWS", "KTO rows or preference pairs"),
    "prompts": ("PROMPTS", "prompts"),
}


def task_flags(args, recipe):
    """The data flags of one script under --task (its recipe key names it; a fork reads dpo's); none with
    --dataset (derive puts each run's data ahead of its pass-through flags)."""
    if args.task == "toy" or args.dataset or not plumbing.is_toy_model(args.model):
        return []  # each script's own data (toy: sft.py's demonstrations are the pairs' chosen answers)
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


def derive(args, output_dir):
    """--dataset PAIRS -> (args with each run's data put ahead of its --<row>-args, where a --dataset of its own
    still wins; {file under <output-dir>/data/: its rows}, written before any run): the chosen answers as
    prompt + completion (the SFT bases', sft+'s, sft-chosen's data), the pairs as given (dpo, simpo, orpo, reward,
    a fork; kto.py unpairs them) and, where every pair has a `prompt`, the RL rows' prompts (ppo, grpo, rloo,
    rft, distill): each row's columns but chosen/rejected, the prompt as given (reward functions read the
    columns, as TRL passes them). Each with `--eval-dataset ''`: the held-out scores are compare's own."""
    template = common.chat_template(args.model, args.chat_template)
    pairs = common.read_rows(args.dataset)
    chosen = os.path.join(output_dir, "data", "chosen.jsonl")
    prompts = os.path.join(output_dir, "data", "prompts.jsonl")
    files = {
        chosen: [
            dict(
                zip(
                    ("prompt", "completion"),
                    common.preference_triple(row, f"{args.dataset}:{line}", template),
                )
            )
            for row, line in pairs
        ]
    } | (
        {prompts: [{k: v for k, v in row.items() if k not in ("chosen", "rejected")} for row, _ in pairs]}
        if all("prompt" in row for row, _ in pairs)
        else {}
    )
    data = {  # each pass-through flag's (the bases and sft+ share --sft-args; a fork reads dpo's)
        "sft": chosen,
        "sft_chosen": chosen,
        **dict.fromkeys(("dpo", "simpo", "orpo", "reward", "kto", "extra"), args.dataset),
        **dict.fromkeys(("ppo", "grpo", "rloo", "rft", "distill"), prompts if prompts in files else None),
    }
    return dataclasses.replace(
        args,
        **{
            f"{row}_args": shlex.join(["--dataset", path] + ["--eval-dataset", ""] * (path != prompts))
            + f" {getattr(args, f'{row}_args')}"
            for row, path in data.items()
            if path
        },
    ), files


# --quick: SFT's 150 updates; dpo against sft-chosen, grpo (the checker) against rft (docs/compare.md)
QUICK = dict(
    methods="sft,dpo,grpo,sft-chosen,rft",
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
    return ([f"--{k.replace('_', '-')}={v}" for k, v in QUICK.items()] if "--quick" in argv else []) + argv


def check_data(args, stages):
    """compare.py never mixes tasks. Once a run trains on your data (--dataset PAIRS, or --dataset in its
    --<row>-args), or --model is not `tiny`-based, every run does, each with its eval set named beside it where
    the task would pass its own, and every row is scored on your held-out prompts by your --reward-fn; else
    UsageError, one line naming what to pass."""
    yours = [s for s in stages if "--dataset" in s["own"]]
    if not yours and plumbing.is_toy_model(args.model):
        return  # the task's data throughout
    problems = {  # what no --dataset gives (every row is scored on them), then each pass-through flag's
        name: f"pass --{name.replace('_', '-')} {what}"
        for name, what in (
            ("test_prompts", "FILE (your held-out prompts, scored by --reward-fn)"),
            ("eval_prompts", "FILE (where --sweep chooses and the curves are scored)"),
            ("reward_fn", "path.py:function (your task's score; the default scores the bundled task)"),
        )
        if getattr(args, name) == getattr(Args, name)
    }
    for s in stages:  # in run order (the bases and sft+ share --sft-args)
        if "--dataset" not in s["own"]:  # neither yours nor derived from --dataset's pairs
            problems[s["via"]] = '{}="--dataset {}" (your {})'.format(
                s["via"], *DATA_KIND[TASK_DATA[s["recipe"]]]
            ) + (f": {args.dataset}'s pairs have no `prompt` field" if args.dataset else "")
        elif "--eval-dataset" in s["flags"] and not {"--eval-dataset", "--eval-split"} & set(s["own"]):
            problems[s["via"]] = (  # the --eval-dataset compare passed: the task's
                f"{s['via']}: add --eval-dataset FILE or --eval-split SPLIT (--eval-dataset '' for none), else "
                f"{s['row']} is evaluated on the task's "
                + os.path.relpath(last(s["flags"], "--eval-dataset"))
            )
    if problems:
        raise plumbing.UsageError(
            (
                f"{yours[0]['row']} trains on your --dataset"
                if yours
                else f"--model {args.model} is not `tiny` (--dataset PAIRS derives each run's data)"
            )
            + ", so every run trains and is scored on your data: "
            + "; ".join(problems.values())
        )


def last(flags, name):
    """The value a script takes for `name` from `flags` (a repeated flag's last), None where it is absent."""
    return flags[len(flags) - flags[::-1].index(name)] if name in flags else None


def short(path):
    """A path relative to the working directory, unless outside it."""
    return path if os.path.relpath(path).startswith("..") else os.path.relpath(path)


def before_running(stages):
    """What compare says before any run, once a line, in run order: what your pass-through flags replace
    ("--dpo-args: --beta 0.5 replaces the recipe's '0.1'": a script takes a repeated flag's last value, yours),
    and the epochs each run's steps make over its training rows where a --dataset file holds them (yours, derived,
    the task's; a control's steps are known once its row has run), with a `warning:` past 10 epochs."""
    lines = []
    for s in stages:
        flags = s["flags"]
        task = flags[: len(flags) - len(s["own"])]  # compare's flags, before yours
        lines += [
            f"{s['via']}: {flag} {shlex.quote(value)} replaces the recipe's {last(task, flag)!r}"
            for flag, value in zip(s["passed"], s["passed"][1:])
            if flag.startswith("--") and flag in task and value != last(task, flag)
        ]
        path = last(flags, "--dataset") or ""
        rows = common.read_rows(path) if "--max-steps" in flags and os.path.isfile(path) else []
        if rows:  # kto.py unpairs preference pairs: two examples each
            n = len(rows) * (
                1 + (s["recipe"] == "kto" and isinstance(rows[0][0], dict) and "chosen" in rows[0][0])
            )
            # rows a step: grpo.py's and rloo.py's --batch-size counts completions, --num-generations a prompt
            per = int(last(flags, "--batch-size")) // int(last(flags, "--num-generations") or 1)
            steps = int(last(flags, "--max-steps"))
            epochs = steps * per / n
            lines.append(
                f"{s['row']}: {steps} steps × {per} rows = {steps * per:,} rows over the {n:,} "
                + ("(its pairs unpaired, 2 each) " if n > len(rows) else "")
                + f"of {short(path)}: "
                + (f"{epochs:,.0f}" if epochs >= 10 else f"{epochs:.2g}")
                + " epochs"
            )
            if epochs > 10:
                lines.append(
                    f"warning: {s['row']}: {epochs:,.0f} epochs over {n:,} rows, which it may memorise: lower "
                    + (
                        f"--{s['recipe']}-steps"
                        if s["recipe"] in ("sft", "reward", "ppo", "grpo", "rloo")
                        else "--steps"
                    )
                    + " or give more rows"
                )
    return list(dict.fromkeys(lines))


def parse_sweep(specs, rows):
    """['dpo.learning_rate=1e-6,5e-6', …] -> {row: [setting {flag: value}, …]} (the grid of a row's swept
    flags, in the order given); a spec's row: one of `rows`, a control kind (each `kind@row` of it) or `all`
    (every row); else, or without values, UsageError."""
    grid = {}
    for spec in specs:
        key, _, values = spec.partition("=")
        row, _, flag = key.partition(".")
        values = [v.strip() for v in values.split(",") if v.strip()]
        named = [r for r in rows if row in ("all", r, r.split("@")[0])]
        if not named or not flag.isidentifier() or not values:
            raise plumbing.UsageError(
                f"--sweep {spec!r}: expected row.flag=v1,v2,… with row `all` or one of {','.join(rows)}"
            )
        for r in named:
            grid[r] = [{**s, flag: v} for s in grid.get(r, [{}]) for v in values]
    return grid


def tag(setting):
    """A setting's directory name: {'learning_rate': '1e-6'} -> 'learning_rate_1e-6' ('' for no setting)."""
    return "__".join(f"{k}_{v}" for k, v in setting.items())


# A row of the table, run once per seed (and per --sweep setting): its name (a fork's: its file's; a control's
# `kind@row`), its script, its RECIPE key (a fork reads dpo's), its --max-steps (None: a control's, known once
# the row it reads has run: matched_steps), its own flags (a teacher, the task score as reward), its
# pass-through flags (appended last) and their flag's name, whether it is PPO on its seed's reward model (a
# reward stage first), its signal (prefs, checker, teacher; a control: the row it reads)
Row = NamedTuple(
    "Row",
    [
        ("name", str),
        ("script", str),
        ("recipe", str),
        ("steps", int | None),
        ("flags", list[str]),
        ("extra", str),
        ("via", str),
        ("on_rm", bool),
        ("signal", str),
    ],
)


def plan(args, output_dir):
    """-> (stages {name: run dir under output_dir, row, setting, seed, script, flags, needs, match} in run
    order, {seed: its base model}, the seeds, the sweep grid); bad choices raise UsageError."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if any(m not in METHODS for m in methods) or not (methods or args.extra) or args.seeds < 1:
        raise plumbing.UsageError(
            f"--methods {args.methods!r}: choose from {','.join(METHODS)}; --seeds >= 1"
        )
    seeds = [args.seed + k for k in range(args.seeds)]
    sft = "sft" in methods
    bases = {s: os.path.join(output_dir, f"sft/seed{s}", "model") if sft else args.model for s in seeds}
    fn = ["--reward-fn", args.reward_fn]

    def budget(steps):
        return ["--max-steps", str(steps)] + curve_flags(steps, args.curve_points)

    def row(name, *, recipe=None, steps=None, flags=(), on_rm=False, signal="prefs", path=None, fork=False):
        recipe = recipe or name
        own = "extra" if fork else recipe.rstrip("+").replace("-", "_")  # its pass-through flag: --{own}-args
        return Row(
            name=name,
            script=path  # a control runs sft.py, rft grpo.py --accept-reward
            or os.path.join(
                common.HERE, {"rft": "grpo", "sft+": "sft", "sft-chosen": "sft"}.get(recipe, recipe) + ".py"
            ),
            recipe=recipe,
            steps=steps,
            flags=list(flags),
            extra=getattr(args, f"{own}_args"),
            via=f"--{own.replace('_', '-')}-args",
            on_rm=on_rm,
            signal=signal,
        )

    rows = [row(m, steps=args.steps) for m in PREFERENCE if m in methods]
    for path in args.extra:
        name = os.path.splitext(os.path.basename(path))[0]
        if not path.endswith(".py") or not os.path.exists(path) or name in METHODS + ("reward",):
            raise plumbing.UsageError(
                f"--extra {path}: expected an existing script whose name is not a built-in"
            )
        rows.append(row(name, recipe="dpo", steps=args.steps, path=os.path.abspath(path), fork=True))
    if "distill" in methods:  # the preference rows' budget, graded token by token by the teacher
        if not args.teacher_model:
            raise plumbing.UsageError(
                "--methods distill needs --teacher-model (a model of the base's vocabulary)"
            )
        rows.append(
            row("distill", steps=args.steps, flags=["--teacher-model", args.teacher_model], signal="teacher")
        )
    rows += [  # PPO on a reward model learnt from the pairs, or on the checker (--ppo-reward: either or both)
        row(
            name,
            recipe="ppo",
            steps=args.ppo_steps,
            flags=[] if on_rm else fn,
            on_rm=on_rm,
            signal="prefs" if on_rm else "checker",
        )
        for name, on_rm in (("ppo", True), ("ppo_fn" if args.ppo_reward == "both" else "ppo", False))
        if "ppo" in methods and args.ppo_reward in ("both", "model" if on_rm else "fn")
    ]
    rows += [  # a verifiable reward: the task score itself, like ppo_fn
        row(m, steps=getattr(args, f"{m}_steps"), flags=fn, signal="checker")
        for m in ("grpo", "rloo")
        if m in methods
    ]
    controls = [  # steps: matched_steps, once the row read has run; rft: grpo.py --accept-reward
        row(
            f"{kind}@{r.name}",
            recipe=kind,
            flags=(fn + ["--accept-reward", str(args.accept_reward)]) if kind == "rft" else [],
            signal=r.name,
        )
        for r in rows
        for kind, reads in CONTROLS.items()
        if kind in methods and r.signal in reads
    ]
    grid = parse_sweep(args.sweep, [r.name for r in rows + controls])

    def stage(name, *, row, model, flags, seed, needs, setting, match=()):
        swept = [x for k, v in setting.items() for x in ("--" + k.replace("_", "-"), v)]
        return {
            "name": name,
            "row": row.name,
            "recipe": row.recipe,
            "setting": tag(setting),
            "seed": seed,
            "script": row.script,
            "needs": needs,
            "match": list(match),  # the runs whose FLOPs a control matches (its row's, every setting)
            "via": row.via,  # the pass-through flag its own flags came from
            "own": shlex.split(row.extra) + swept,  # the flags you passed through (then --sweep's): last
            "passed": shlex.split(row.extra),
            "flags": ["--model", model]
            + flags
            + task_flags(args, row.recipe)
            + [x for flags, _ in RECIPE[row.recipe] for x in shlex.split(flags)]  # the recipe's, in order
            + ["--seed", str(seed)]
            + (["--chat-template", args.chat_template] if args.chat_template else [])
            + ["--output-dir", os.path.join(output_dir, name)]
            + shlex.split(row.extra)
            + swept,
        }

    stages = []
    for seed in seeds:
        base = [f"sft/seed{seed}"] if sft else []
        if sft:  # this seed's base: its noise is in every interval of the seed's rows
            stages.append(
                stage(
                    base[0],
                    row=row("sft", signal="base"),
                    model=args.model,
                    flags=budget(args.sft_steps),
                    seed=seed,
                    needs=[],
                    setting={},
                )
            )
        rm = f"reward/seed{seed}"
        if any(r.on_rm for r in rows):
            stages.append(
                stage(
                    rm,
                    row=row("reward"),
                    model=bases[seed],
                    flags=["--max-steps", str(args.reward_steps)],
                    seed=seed,
                    needs=base,
                    setting={},
                )
            )
        for r in rows + controls:
            flags = (
                (budget(r.steps) if r.steps else [])
                + ["--learning-rate", str(args.learning_rate)]
                + r.flags
                + (["--reward-model", os.path.join(output_dir, rm, "model")] if r.on_rm else [])
            )
            match = [
                s["name"] for s in stages if s["seed"] == seed and s["row"] == r.signal and "@" in r.name
            ]
            for setting in grid.get(r.name, [{}]):
                name = "/".join(filter(None, [r.name, tag(setting), f"seed{seed}"]))
                stages.append(
                    stage(
                        name,
                        row=r,
                        model=bases[seed],
                        flags=flags,
                        seed=seed,
                        needs=base + ([rm] if r.on_rm else []) + match,
                        setting=setting,
                        match=match,
                    )
                )
    return stages, bases, seeds, grid


def curve_flags(steps, points):
    """A run's checkpoints for the curves: every steps / (points + 1) updates, all kept (and its last)."""
    return ["--save-every", str(max(1, steps // (points + 1))), "--save-total-limit", "0"] if points else []


def target_flops(output_dir, stage, done, walls):
    """The FLOPs a control matches: the mean over its row's finished runs (stage_cost: a reward model, a
    teacher included); RunsFailed when none logged any."""
    flops = [stage_cost(output_dir, s, walls)[2] for s in done if s["name"] in stage["match"]]
    if not flops or not all(np.isfinite(flops)):
        raise RunsFailed(f"{stage['name']}: no logged FLOPs of {', '.join(stage['match'])} to match")
    return float(np.mean(flops))


def flops_per_step(run_dir):
    """A finished run's logged FLOPs over its --max-steps."""
    return run_cost(run_dir)[2] / json.load(open(os.path.join(run_dir, "args.json")))["max_steps"]


def matched_steps(target, per_step):
    """A control's updates: the row's FLOPs over one update's (rounded, at least 1)."""
    return max(1, round(target / per_step))


def run_control(i, n, stage, output_dir, *, done, walls, curve_points):
    """Run a control at its row's FLOPs -> (ok, wall s): its updates from the FLOPs a step of a finished run of
    its kind, else of its script (a base, a grpo run) scaled by batch size, else of its row; more than MATCH off
    its target, it runs again, once, at its own FLOPs a step."""
    target = target_flops(output_dir, stage, done, walls)
    like = (
        [s for s in done if s["recipe"] == stage["recipe"]]
        or [s for s in done if s["script"] == stage["script"]]
        or [s for s in done if s["name"] in stage["match"]]
    )[-1]
    per_step = (  # scaled by the --batch-size each was given
        flops_per_step(os.path.join(output_dir, like["name"]))
        * float(last(stage["flags"], "--batch-size"))
        / float(last(like["flags"], "--batch-size"))
    )
    flags = list(stage["flags"])
    for attempt in range(2):
        steps = matched_steps(target, per_step)
        stage["flags"] = (
            flags[:2] + ["--max-steps", str(steps)] + curve_flags(steps, curve_points) + flags[2:]
        )
        ok, wall = run_stage(i, n, stage, output_dir)
        run_dir = os.path.join(output_dir, stage["name"])
        if not ok or abs(run_cost(run_dir)[2] / target - 1) <= MATCH or attempt:
            return ok, wall
        per_step = flops_per_step(run_dir)
        print(f"      {run_cost(run_dir)[2]:.3g} FLOPs against {target:.3g}: again, {per_step:.3g} a step")
        shutil.rmtree(run_dir)


def prepare_output_dir(output_dir, stages, overwrite, keep=False):
    """Refuse to mix with an earlier comparison unless --overwrite (which removes its runs) or --keep-finished
    (which removes only the unfinished ones)."""
    held = [  # --keep-finished: the unfinished ones (no model/)
        s["name"]
        for s in stages
        if os.path.exists(os.path.join(output_dir, s["name"]))
        and not (keep and os.path.isdir(os.path.join(output_dir, s["name"], "model")))
    ]
    folders = sorted({name.split("/")[0] for name in held})  # --overwrite: each one's row's whole folder
    if held and not (keep or overwrite):
        raise plumbing.UsageError(
            f"--output-dir {output_dir} already holds runs ({', '.join(folders)}); pass --overwrite to replace them"
        )
    for name in held if keep else folders:
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
        print(
            f"      FAILED (exit {rc}) after {wall:.0f} s; last lines of {log_path}:\n"
            + "".join(open(log_path).readlines()[-10:]),
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
        total = json.load(open(os.path.join(run_dir, "args.json")))["max_steps"]
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
def evaluate_models(args, prompts_path, bases, jobs, eval_dir):
    """jobs: [(key, seed, model dir, reward model dir or None)] -> {key: evaluate.per_prompt arrays}: each model
    on `prompts_path` against its seed's base (bases {seed: model}), both sampled with `seed` (paired); a job
    whose model is its seed's base scores the base against itself; outputs in eval_dir(key, seed)."""
    import evaluate  # JAX starts only now, after the training processes ended (a TPU admits one)

    def eargs(seed, rm):
        return evaluate.Args(
            model=bases[seed],
            baseline=bases[seed],
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
    first = min(bases)
    ea = eargs(first, None)
    prompts, rows, reward_fn = evaluate.check_args(ea, mesh)
    policies = {bases[first]: evaluate.load_policy(bases[first], mesh, ea)}  # one a base; compiled once
    like = policies[bases[first]]
    data = evaluate.prepare(ea, mesh, prompts, rows, like.model.preprocessor.tokenizer)
    scorers = {}  # one a reward model (None: the task score only)
    base_outs = {}  # each base's responses, one set a (sampling seed, reward model)
    results = {}
    for key, seed, model_dir, rm in jobs:
        t0 = time.perf_counter()
        ea = eargs(seed, rm)
        if bases[seed] not in policies:
            policies[bases[seed]] = evaluate.load_policy(bases[seed], mesh, ea, like=like)
        base_policy = policies[bases[seed]]
        if rm not in scorers:
            scorers[rm] = evaluate.make_scorer(ea, mesh, data, reward_fn)
        if (seed, rm) not in base_outs:
            base_outs[seed, rm] = evaluate.evaluate_policy(
                base_policy, data, scorers[rm], ea, mesh, baseline=base_policy
            )
        b = base_outs[seed, rm]
        outs = b  # the base against itself
        if model_dir != bases[seed]:
            policy = evaluate.load_policy(model_dir, mesh, ea, like=like)
            evaluate.check_same_tokens(model_dir, policy.model, data, ea, key)
            outs = evaluate.evaluate_policy(policy, data, scorers[rm], ea, mesh, baseline=base_policy)
        results[key] = evaluate.per_prompt(outs, b)
        m = evaluate.summarize(outs, b)
        evaluate.write_outputs(
            eval_dir(key, seed),
            {
                "model": model_dir,
                "baseline": bases[seed],
                "prompts": prompts_path,
                "num_prompts": len(data["prompts"]),
                "seed": seed,
                "temperature": args.temperature,
                **m,
            },
            evaluate.examples(outs, data, 8, b),
            results[key],
        )
        print(
            f"      {key} (seed {seed}): task score {m['score']:.3f}, KL {m['kl']:.3f} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    return results


def checkpoint_scores(args, base, run_dirs):
    """Greedy task score on the eval split (never the test split) at each run's checkpoints before its end
    -> {run dir: [(step, score)]}; weights of other shapes than the base's (a LoRA run's) are not scored."""
    import evaluate
    import jax
    import orbax.checkpoint as ocp

    ea = evaluate.Args(
        model=base,
        prompts=args.eval_prompts,
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
        end = json.load(open(os.path.join(run_dir, "args.json")))["max_steps"]  # model/, scored in the table
        steps = (
            [s for s in sorted(map(int, filter(str.isdigit, os.listdir(folder)))) if s < end]
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


# === Report: the summary, the table (markdown), the picture ===
MIN_SEEDS = 3  # fewer: no claim (one seed measures no seed noise; two, too little: docs/compare.md)
ALPHA = 0.025  # one-sided: a lone "beats" claim holds exactly when its 95% interval lies above 0


def verdict(delta, name, seeds=MIN_SEEDS, held=None, row=None):
    """(Δ, ±) of `row` against `name` -> 'beats name (Δ …)', 'within noise of name (… covers 0)' or
    'below …'; with fewer than MIN_SEEDS seeds no claim: 'needs ≥ 3 seeds vs name (Δ …)'. held: the claims
    that survive the report's correction ({(row, against, side)}: Holm over every claim; None: every one);
    one that does not is worded as this interval's alone: 'above name (Δ …; alone, not after Holm's
    correction)'."""
    d, h = delta
    holds = held is None or (row, name, "above" if d > 0 else "below") in held
    word, covers = (
        (f"needs ≥ {MIN_SEEDS} seeds vs", "")
        if seeds < MIN_SEEDS
        else ("beats" if holds else "above", "" if holds else "; alone, not after Holm's correction")
        if d > h
        else ("within noise of", " covers 0")
        if d >= -h
        else ("below", "" if holds else "; alone, not after Holm's correction")
    )
    return f"{word} {name} (Δ {d:+.3f} ± {h:.3f}{covers})"


def summary(stats, costs, *, base_name, seeds, claims, held=()):
    """The report's first lines: which rows clear the control matched to them in information (a preference
    row sft-chosen, a checker row rft: what "beats" needs), which beat or fall below what else, Holm's
    correction over every claim the report could make (`claims`: claims_of's; `held`: {(row, against, side)}
    of those that hold), and at what cost; with fewer than MIN_SEEDS seeds no claim, the Δs ranked instead
    (candidates for a run with more seeds)."""
    informed = {n: st["informed"] for n, st in stats.items() if st.get("informed")}

    def cost(name):
        return f"{fmt(costs[name][2], top=1e10)} FLOPs, {costs[name][3]:.0f} s"  # FLOPs as 3.30e12

    def delta(name, against):  # 'dpo − sft-chosen@dpo +0.375 ± 0.398'
        return f"{name} − {against} " + "{:+.3f} ± {:.3f}".format(
            *next(c[2] for c in claims if c[:2] == (name, against))
        )  # the first: "above", whose Δ is the pair's

    if seeds < MIN_SEEDS:
        noise = "over prompts only: seed noise is unmeasured" if seeds == 1 else "from too few seeds to trust"
        ranked = sorted((c for c in claims if c[1] == base_name and c[4] == "above"), key=lambda c: -c[2][0])
        return (
            f"**Summary: {seeds} seed(s), needs ≥ {MIN_SEEDS} seeds.** The intervals are {noise} "
            f"(docs/compare.md), so no row is said to beat another. Δ vs {base_name}, the candidates for "
            f"`--seeds {MIN_SEEDS}`: "
            + "; ".join(f"{n} {d:+.3f} ± {h:.3f} ({cost(n)})" for n, _, (d, h), *_ in ranked)
            + (
                ". Against the control matched in information: "
                + "; ".join(delta(n, c) for n, c in informed.items())
                if informed
                else ""
            )
        )
    won = {  # each row's claims that hold, if any: "beats a (Δ …)", "falls below a (Δ …)"
        n: [
            f"{'beats' if side == 'above' else 'falls below'} {a} (Δ {d:+.3f} ± {h:.3f})"
            for m, a, (d, h), _, side in claims
            if (m, a, side) in held and m == n
        ]
        for n in stats
        if n != base_name
    }
    cleared = [n for n, c in informed.items() if (n, c, "above") in held]
    rest = [n for n, w in won.items() if not w]
    return "\n".join(
        [
            f"**Summary** (greedy test score, Δ paired per prompt and seed, each seed its own {base_name}; "
            f"Holm's correction over the report's {len(claims)} claims: each row against {base_name} and its "
            f"control, beats and falls below, and each ordered pair of the Δ matrix; so the chance that any line "
            f"below is false is ≤ {ALPHA:.1%}; {base_name}: {cost(base_name)} a seed):",
            *(
                [
                    "- **Against the control matched in information** (a preference row must clear sft-chosen, "
                    "a checker row rft): "
                    + (f"cleared by {', '.join(cleared)}" if cleared else "cleared by none")
                    + "; "
                    + "; ".join(delta(n, c) for n, c in informed.items() if n not in cleared)
                ]
                if informed
                else []
            ),
            *[f"- **{n}** {'; '.join(w)}, at {cost(n)} a run" for n, w in won.items() if w],
            *([f"- no claim holds for {', '.join(rest)}"] if rest else []),
        ]
    )


def note(name, st, base_name, base_st, *, run_metrics, on_reward_model, seeds=MIN_SEEDS, held=None):
    """One line a row: verdicts against the base and the control, then the likely why (log-probs, RM, KL).
    held: the claims that survive the report's correction ({(row, against, side)}; None: every one)."""
    if name == base_name:
        return "the base: each seed trains its own, and that seed's rows start from it"
    head = verdict(st["delta"], base_name, seeds, held, name) + (
        f"; {verdict(st['delta_control'], st['control'], seeds, held, name)}" if "delta_control" in st else ""
    )
    if st["delta"][0] + st["delta"][1] >= 0:
        return head

    def mean(k, b=st):  # a metric's mean: this row's, or b's
        return b[k][0]

    chosen = [  # each seed's held-out chosen log-probs, where it logged two or more
        c
        for c in ([r["eval/logps/chosen"] for r in rows if "eval/logps/chosen" in r] for rows in run_metrics)
        if len(c) >= 2
    ]
    first, last = (np.mean([c[0] for c in chosen]), np.mean([c[-1] for c in chosen])) if chosen else (0, 0)
    if chosen and last < first:
        longer = "; greedy answers got longer" if mean("length") > mean("length", base_st) + 0.5 else ""
        return f"{head}: " + (
            f"held-out chosen log-prob fell too ({first:.2f} → {last:.2f}): the margin grew "
            f"by pushing both answers down (likelihood displacement){longer}"
        )
    if on_reward_model and "rm_score" in st and mean("rm_score") > mean("rm_score", base_st):
        return f"{head}: " + (
            f"reward hacking: reward-model score {mean('rm_score', base_st):.2f} → "
            f"{mean('rm_score'):.2f} while the task score fell; answers "
            f"{mean('length', base_st):.1f} → {mean('length'):.1f} tokens"
        )
    return f"{head}: " + (
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
    """rows: [(name, stats or None, cost [tokens trained, generated, FLOPs, wall s], note, its FLOPs and
    seconds over its row's (a control's) or over its control's, else '')] -> markdown."""
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
        "FLOPs, s: control ÷ row",
        "notes",
    ]
    keys = ["score", "delta", "score_sampled", *rm, "win", "kl", "length"]
    lines = [
        "| " + " | ".join(cols) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(cols) - 2) + ["---"]) + "|",
    ]
    tops = np.nanmax(
        [[np.nan if c is None else c for c in cost[:3]] for _, _, cost, *_ in rows] + [[0] * 3], 0
    )
    for name, st, cost, text, ratio in rows:
        cells = [
            fmt(st[k], 2 if k in ("rm_score", "kl", "length") else 3) if st and k in st else "–" for k in keys
        ]
        cells.insert(
            2, f"{fmt(st['delta_control'])} ({st['control']})" if st and "delta_control" in st else "–"
        )
        cells += [fmt(c, top=t) for c, t in zip(cost[:3], tops)] + [f"{cost[3]:.0f} s" if cost[3] else "–"]
        lines.append("| " + " | ".join([f"**{name}**", *cells, ratio or "–", text]) + " |")
    return "\n".join(lines)


def seed_band(runs):
    """Each seed's [[FLOPs, score]] -> x, mean, min, max over seeds at the first k - 1 points and the ends (k: the
    fewest points; sft+rl's seeds may differ by a checkpoint)."""
    fewest = min(map(len, runs))
    xy = np.stack([np.concatenate([r[: fewest - 1], r[-1:]]) for r in runs])  # [seeds, points, 2]
    return xy[..., 0].mean(0), xy[..., 1].mean(0), xy[..., 1].min(0), xy[..., 1].max(0)


def plot(curves, score_curves, stats, *, base_name, temperature, path):
    """Each row's main training metric (left; every seed: `curves`), the test scores ± intervals (middle), the
    greedy eval score against training FLOPs, SFT included (right: `score_curves`; mean over seeds, band: their
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
    ax = fig.add_subplot(grid[:, cols], ylim=(0, 1.05), ylabel="test task score (mean ± 95% interval)")
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
    ax.set_title("final scores (evaluate.py protocol, test split)", fontsize=10)
    ax = fig.add_subplot(
        grid[:, cols + 1],
        xlabel='training FLOPs (SFT included; docs/design.md, "FLOPs")',
        ylabel="greedy task score, eval split (band: the seeds' range)",
    )
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
        low, high = np.array(span)[:, 1:].T
        ax.set(xlim=(0.7 * min(span)[0], None), ylim=(low.min() - 0.03, high.max() + 0.03))
    ax.set_title("score against compute (checkpoints)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def matrix_md(matrix, names, seeds, held=()):
    """The method-against-method Δ matrix (pairwise's) as markdown: row − column; bold where "row beats
    column" is in `held` (one Holm correction over the report's claims, claims_of; with ≥ MIN_SEEDS seeds)."""
    head = "| row − column | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names) + "\n"

    def cell(a, b):
        if a == b:
            return "–"
        d, h, _ = matrix[a, b]
        text = f"{d:+.3f} ± {h:.3f}"
        return f"**{text}**" if (a, b, "above") in held and seeds >= MIN_SEEDS else text

    return head + "".join(f"| **{a}** | " + " | ".join(cell(a, b) for b in names) + " |\n" for a in names)


def recipe_md(stages, args):
    """The recipe section: every value a run got and where it came from (compare's flags, RECIPE's groups)."""
    lines = [
        f"- every row after SFT (controls included): `--learning-rate {args.learning_rate:g}` "
        + ("unless the sweep below chose one on the eval split" if args.sweep else "(no row tuned)"),
        f"- budgets (compare's flags, the same for every row of a kind, not tuned): `--sft-steps {args.sft_steps}` "
        f"(source: {PILOT}), `--steps {args.steps}`, `--reward-steps {args.reward_steps}`, `--ppo-steps "
        f"{args.ppo_steps}`, `--grpo-steps {args.grpo_steps}`, `--rloo-steps {args.rloo_steps}`; each control: "
        f"its row's FLOPs (within {MATCH:.0%}, matched_steps)",
    ]
    used = dict.fromkeys(s["recipe"] for s in stages)  # each recipe a run got, in run order
    return "\n".join(lines + [f"- {r}: `{f.strip()}`: {source}" for r in used for f, source in RECIPE[r]])


def write_report(
    args, output_dir, *, stages, rows, stats, costs, curves, score_curves, sweep, base_name, extras
):
    """comparison.md (summary, table, Δ matrix, sweep, recipe, protocol, commands) and comparison.png into
    output_dir -> the summary and the table. extras: reward_acc, seeds, total (s), matrix (markdown)."""
    seeds = extras["seeds"]
    md = (
        summary(
            stats, costs, base_name=base_name, seeds=len(seeds), claims=extras["claims"], held=extras["held"]
        )
        + "\n\n"
        + table(rows, base_name, any("rm_score" in st for st in stats.values()))
    )

    runs = "\n".join(f"    python {short(s['script'])} {shlex.join(s['flags'])}" for s in stages)
    rm_line = (
        f"- reward model (PPO's reward, trained on the same preference pairs, one per seed): held-out pair "
        f"accuracy {extras['reward_acc']:.3f} (mean over seeds).\n"
        if extras["reward_acc"] is not None
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
{extras["total"] / 60:.1f} min in all on {os.cpu_count()} CPU cores; seeds {", ".join(map(str, seeds))}.

{md}

- Every cell: mean over {len(seeds)} training seed(s) × the test prompts ({short(args.test_prompts)}), \
± the half-width of a 95% interval that treats seeds and prompts both as random draws (crossed two-way \
random effects, Satterthwaite t; docs/compare.md). Each seed trains its own {base_name} and every row of that \
seed from it, so the base's seed noise is in every interval. **Δ vs {base_name}**: the greedy task score \
minus its seed's {base_name}'s, paired per prompt and per seed; **Δ vs control**: minus the control run of \
the same seed matched to the row (the one matched in information where there is one: sft-chosen for a \
preference row, rft for a checker row); "within noise" where its interval covers 0.
- **task score**: mean `{short(args.reward_fn)}`, greedy responses; **sampled score**: one sample per prompt \
at T={args.temperature:g} (a seed-s model, and its {base_name} against it, sampled with seed s).
- **win rate vs {base_name}**: share of prompts whose greedy answer scores higher than {base_name}'s (ties \
count half).
- **KL from {base_name}**: mean over prompts of Σ_t [log π(y_t) − log π_{base_name}(y_t)] on the model's own \
sampled responses (nats per response, float32, prompt and padding masked).
- **length**: greedy response tokens before EOS. Costs are means over seeds of each run's own logged numbers: \
**tokens trained** (`charts/tokens`: real, non-padding batch tokens; PPO, GRPO, RLOO: prompt + response \
tokens of each rollout batch, once), **tokens generated** (`charts/generated_tokens`: sampled, through each \
EOS), **FLOPs** (`charts/flops`: 6N a trained token, 2N an extra forward — reference, value, reward model, \
sampling; N = weights used in matmuls), **wall time** (the whole script: start-up, compilation, training, \
saving){ppo_note}; distill includes its teacher's training; {base_name}'s costs are paid once a seed. \
**FLOPs, s: control ÷ row**: a control's FLOPs and seconds over its row's (matched on FLOPs within \
{MATCH:.0%}; RL's decoding is memory-bound, so seconds say what FLOPs do not).
{rm_line}
## Method against method (greedy test score, Δ row − column, paired per prompt and seed)

{extras["matrix"]}
Bold: "row beats column" holds under the summary's one Holm correction over every claim of this report (≥ \
{MIN_SEEDS} seeds); only bold cells rank two methods.
{sweep_md}
## Recipe: every value and where it came from

{recipe_md(stages, args)}

![training curves, final scores, score against compute](comparison.png)

Right: the greedy **eval** score at each run's checkpoints (`--curve-points`) and end against its training \
FLOPs, {base_name} included (line: mean over seeds; band: their range; results.json's `curves`). The test split \
is read once, for the table.

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


def run_stages(args, stages, output_dir):
    """Run every stage once its needs have finished, --jobs at a time (1: in plan order) -> ({run: exited 0},
    {run: wall s}): a stage whose needs failed is skipped, one finished before is kept under --keep-finished."""
    walls_path = os.path.join(output_dir, "walls.json")
    kept = json.load(open(walls_path)) if args.keep_finished and os.path.exists(walls_path) else {}
    ok = {}
    walls = {}
    pending = list(enumerate(stages, 1))
    running = {}  # future -> its stage
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        while pending or running:
            for i, stage in [p for p in pending if all(n in ok for n in p[1]["needs"])]:
                if len(running) >= args.jobs:
                    break
                pending.remove((i, stage))
                name = stage["name"]
                missing = [n for n in stage["needs"] if not ok[n]]
                if missing or (args.keep_finished and os.path.isdir(os.path.join(output_dir, name, "model"))):
                    print(
                        f"[{i}/{len(stages)}] {name}: "
                        + (f"skipped ({', '.join(missing)} failed)" if missing else "finished before, kept"),
                        flush=True,
                    )
                    ok[name] = not missing
                    walls[name] = kept.get(name, 0.0) if ok[name] else 0.0
                    continue
                run = (  # a control: its budget is known only now, from its row's logged FLOPs
                    functools.partial(
                        run_control,
                        done=[s for s in stages if ok.get(s["name"])],
                        walls=walls,
                        curve_points=args.curve_points,
                    )
                    if stage["match"]
                    else run_stage
                )
                running[pool.submit(run, i, len(stages), stage, output_dir)] = stage
            finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                name = running.pop(future)["name"]
                ok[name], walls[name] = future.result()
                with open(walls_path, "w") as f:  # what --keep-finished reads
                    json.dump(kept | walls, f)
    return ok, walls


def main(args):
    output_dir = args.output_dir or plumbing.default_output_dir("compare", args.model, args.seed)
    args, files = derive(args, output_dir) if args.dataset else (args, {})  # written below, before any run
    stages, bases, seeds, grid = plan(args, output_dir)
    check_data(args, stages)  # before the task's held-out prompts stand in for those not given
    args = dataclasses.replace(args, **dict(zip(("eval_prompts", "test_prompts"), task_prompts(args))))
    common.load_reward_fn(args.reward_fn)
    # --model resolves (no SFT stage: it is the base itself) and every held-out prompt reads
    for path, flag in ((args.eval_prompts, "--eval-prompts"), (args.test_prompts, "--test-prompts")):
        common.read_dataset(path, "prompt", common.chat_template(args.model, args.chat_template), flag)
    prepare_output_dir(output_dir, stages, args.overwrite, args.keep_finished)
    for path, rows in files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    for line in before_running(stages):  # said, not silent: a recipe's value replaced, a run's epochs
        print(line)
    t_start = time.perf_counter()
    ok, walls = run_stages(args, stages, output_dir)  # each run: exited 0; its wall seconds
    failed_bases = [f"sft/seed{s}" for s in seeds if ok.get(f"sft/seed{s}") is False]
    if failed_bases:
        raise RunsFailed(f"{', '.join(failed_bases)} failed: nothing to compare (see {output_dir}/sft/*.log)")
    md = evaluate_and_report(
        args, output_dir, stages, bases=bases, seeds=seeds, grid=grid, ok=ok, walls=walls, t_start=t_start
    )
    print(
        f"\n{md}\n\ndone in {(time.perf_counter() - t_start) / 60:.1f} min: "
        f"{output_dir}/comparison.md, comparison.png, results.json, scores.npz"
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
    """run_cost + [wall s] of one run; PPO on a reward model pays for that model too, distill for its teacher's
    training when the teacher is a run's model/ (its logged FLOPs and training seconds; not its start-up)."""
    names = [stage["name"]] + [n for n in stage["needs"] if n.startswith("reward/")]
    cost = np.sum([run_cost(os.path.join(output_dir, n)) + [walls.get(n, 0.0)] for n in names], 0)
    flags = stage.get("flags", [])
    if "--teacher-model" in flags:
        teacher = os.path.dirname(os.path.abspath(last(flags, "--teacher-model")))
        rows = [r for r in read_metrics(teacher) if r.get("charts/tokens_per_sec")]
        seconds = sum(r["charts/tokens"] / r["charts/tokens_per_sec"] for r in rows)
        cost = cost + np.array(run_cost(teacher)[:1] + [0.0] + run_cost(teacher)[2:] + [seconds]) * bool(rows)
    return list(cost)


def paired_stats(res, runs, against):
    """row_stats of `runs` (one row's stages) against the run of each one's seed in `against` {seed: run}: its
    base's, or a control's (a seed without one: that run left out)."""
    runs = [s for s in runs if s["seed"] in against]
    return row_stats(*stack(res, [s["name"] for s in runs], [against[s["seed"]] for s in runs]))


def choose_settings(grid, res, runs, base_keys):
    """Every run's scores on the eval split -> ({row: kept setting}, {row: [{setting, stats, kept}]}): the
    setting with the best mean greedy eval score (ties: the first given)."""

    def of(row, t):
        return [s for s in runs if s["row"] == row and s["setting"] == t]

    sweep = {
        row: [
            {"setting": t, "stats": paired_stats(res, of(row, t), base_keys), "kept": False}
            for t in dict.fromkeys(map(tag, grid[row]))
            if of(row, t)
        ]
        for row in grid
    }
    for settings in sweep.values():
        if settings:
            max(settings, key=lambda x: x["stats"]["score"][0])["kept"] = True
    return {row: s["setting"] for row, settings in sweep.items() for s in settings if s["kept"]}, sweep


def score_curve(res, at, output_dir, stage, metrics, *, walls, base_keys, is_base, sft_flops):
    """One run's [[training FLOPs, greedy eval score]]: its seed's base's point (after SFT), its checkpoints
    `at` (the base's FLOPs, a reward model's, its own up to each), its end."""
    seed = stage["seed"]
    run_dir = os.path.join(output_dir, stage["name"])
    own = run_cost(run_dir)[2]
    offset = 0.0 if is_base else sft_flops + stage_cost(output_dir, stage, walls)[2] - own
    start = [] if is_base or not sft_flops else [(sft_flops, res[base_keys[seed]]["score"].mean())]
    end = [(offset + own, res[base_keys[seed] if is_base else stage["name"]]["score"].mean())]
    return np.array(start + [(offset + flops_at(metrics, step), v) for step, v in at.get(run_dir, [])] + end)


def evaluate_and_report(args, output_dir, stages, *, bases, seeds, grid, ok, walls, t_start):
    """Every run and base on the eval split (the sweep's choice, the curves' ends), the kept runs and the bases
    on the test split, once -> the table, the Δ matrix, results.json and scores.npz."""
    base_name = "sft" if any(s["row"] == "sft" for s in stages) else "base"
    done = [s for s in stages if s["row"] not in ("sft", "reward") and ok[s["name"]]]
    base_keys = {seed: f"{base_name}/seed{seed}" for seed in seeds}

    def evaluate_on(split, runs, prompts):  # the runs, the base of each seed
        print(
            f"[eval] {len(runs)} runs and {base_name} on the {split} split"
            + (", once" if split == "test" else "")
            + f" ({prompts})",
            flush=True,
        )
        rms = {  # each seed's reward model (PPO's), scored on the test split only
            x: os.path.join(output_dir, f"reward/seed{x}/model")
            if split == "test" and ok.get(f"reward/seed{x}")
            else None
            for x in bases
        }
        jobs = [(k, x, bases[x], rms[x]) for x, k in base_keys.items()] + [
            (s["name"], s["seed"], os.path.join(output_dir, s["name"], "model"), rms[s["seed"]]) for s in runs
        ]
        return evaluate_models(
            args, prompts, bases, jobs, lambda key, seed: os.path.join(output_dir, key, f"eval_{split}")
        )

    res_eval = evaluate_on("eval", done, args.eval_prompts)
    kept, sweep = choose_settings(grid, res_eval, [s for s in done if s["row"] in grid], base_keys)
    final = [s for s in done if s["setting"] == kept.get(s["row"], "" if s["row"] not in grid else None)]
    res = evaluate_on("test", final, args.test_prompts)
    base_stages = [s for s in stages if s["row"] == "sft"]
    stats = {base_name: row_stats(*stack(res, list(base_keys.values()), list(base_keys.values())))}
    costs = {
        base_name: list(np.mean([stage_cost(output_dir, s, walls) for s in base_stages], 0))
        if base_stages
        else [np.nan] * 3 + [0.0]
    }
    at = (  # the kept runs' checkpoints, the bases' too
        checkpoint_scores(
            args, bases[seeds[0]], [os.path.join(output_dir, s["name"]) for s in final + base_stages]
        )
        if args.curve_points
        else {}
    )
    sft = {  # each seed's base's FLOPs, where its curves start (a given base: its FLOPs unknown, 0)
        s["seed"]: run_cost(os.path.join(output_dir, s["name"]))[2] for s in base_stages
    }
    score_curves = {}  # each row's greedy eval score against FLOPs, every seed: the right panel
    names = list(dict.fromkeys(s["row"] for s in stages if s["row"] not in ("sft", "reward")))
    # the base, then each row followed by its controls
    order = [base_name] + [
        m for n in names if "@" not in n for m in [n] + [c for c in names if c.endswith(f"@{n}")]
    ]
    by_name = {  # each row's kept runs, the base's: its stages
        name: [s for s in final if s["row"] == name] or [s for s in base_stages if name == base_name]
        for name in order
    }
    logs = {  # each run's metrics.jsonl, by row
        name: [read_metrics(os.path.join(output_dir, s["name"])) for s in runs]
        for name, runs in by_name.items()
    }
    curves = {  # each row's main training metric, every seed: the left panels
        name: [main_curve(m) for m in metrics]
        for name, metrics in logs.items()
        if metrics and main_curve(metrics[0])[0]
    }
    for name, runs in by_name.items():
        if name != base_name and runs:
            stats[name] = paired_stats(res, runs, base_keys)
            costs[name] = list(np.mean([stage_cost(output_dir, s, walls) for s in runs], 0))
        score = [
            score_curve(
                res_eval,
                at,
                output_dir,
                s,
                m,
                walls=walls,
                base_keys=base_keys,
                is_base=name == base_name,
                sft_flops=sft.get(s["seed"], 0.0),
            )
            for s, m in zip(runs, logs[name])
            if name in stats
        ]
        if score and np.isfinite(np.concatenate(score)).all():  # the base's point, the checkpoints, the end
            score_curves[name] = score
    methods = [n for n in stats if n != base_name and "@" not in n]
    for name in methods:  # each row against its controls, paired by seed
        versus = {  # paired by seed: each control's Δ and p
            ctl: {
                k: v
                for k, v in paired_stats(
                    res, by_name[name], {s["seed"]: s["name"] for s in by_name[ctl]}
                ).items()
                if k in ("delta", "p", "p_below")
            }
            for ctl in stats
            if ctl.endswith(f"@{name}")
        }
        if versus:
            informed = next((c for k in INFORMATION.values() for c in versus if c.startswith(f"{k}@")), None)
            primary = informed or next(iter(versus))
            stats[name].update(
                versus=versus,
                informed=informed,
                control=primary,
                delta_control=versus[primary]["delta"],
                p_control=versus[primary]["p"],
            )

    def ratio(name):
        # a control's FLOPs and seconds over its row's; a row's: its primary control's over its own
        pair = [name, name.split("@")[1]] if "@" in name else [stats.get(name, {}).get("control"), name]
        if not all(n in costs and np.all(np.array(costs[n])[[2, 3]] > 0) for n in pair):
            return ""  # a cost unknown (NaN fails > 0) or zero
        f, w = np.array(costs[pair[0]])[[2, 3]] / np.array(costs[pair[1]])[[2, 3]]
        return f"{f:.2f}×, {w:.2f}×"

    common_seeds = [x for x in seeds if all(any(s["seed"] == x for s in by_name[n]) for n in methods)]
    tables = {
        n: np.stack(
            [res[next(s["name"] for s in by_name[n] if s["seed"] == x)]["score"] for x in common_seeds]
        )
        for n in methods
    }
    matrix = pairwise(tables) if len(methods) > 1 and common_seeds else {}
    claims = claims_of(stats, base_name, matrix)  # every claim the report could make: one Holm correction
    held = {c[:2] + c[4:] for c, ok in zip(claims, holm([c[3] for c in claims], ALPHA)) if ok}
    table_rows = [
        (
            f"{n} (`{kept[n]}`)" if n in kept else n,
            stats.get(n),
            costs.get(n, [np.nan] * 3 + [0.0]),
            note(
                n,
                stats[n],
                base_name,
                stats[base_name],
                run_metrics=logs[n],
                on_reward_model=any("--reward-model" in s["flags"] for s in runs),
                seeds=len(seeds),
                held=held,
            )
            if n in stats
            else f"failed or skipped: see {n}/*.log",
            ratio(n) if n != base_name else "",
        )
        for n, runs in by_name.items()
    ]
    accs = [  # each reward model's last held-out accuracy, as logged
        a[-1]
        for a in (
            [
                r["eval/accuracy"]
                for r in read_metrics(os.path.join(output_dir, f"reward/seed{x}"))
                if "eval/accuracy" in r
            ]
            for x in seeds
        )
        if a
    ]
    extras = {
        "reward_acc": float(np.mean(accs)) if accs else None,
        "seeds": seeds,
        "total": time.perf_counter() - t_start,
        "matrix": matrix_md(matrix, methods, len(seeds), held) if matrix else "(fewer than two methods)\n",
        "claims": claims,
        "held": held,
    }
    md = write_report(
        args,
        output_dir,
        stages=stages,
        rows=table_rows,
        stats=stats,
        costs=costs,
        curves=curves,
        score_curves=score_curves,
        sweep=sweep,
        base_name=base_name,
        extras=extras,
    )
    write_results(
        args,
        output_dir,
        stages=stages,
        stats=stats,
        costs=costs,
        sweep=sweep,
        matrix=matrix,
        extras=extras | {"kept": kept, "summary": md.split("\n\n")[0], "curves": score_curves},
        test={k: res[k] for k in list(base_keys.values()) + [s["name"] for s in final]},
        walls=walls,
    )
    return md


def write_results(args, output_dir, *, stages, stats, costs, sweep, matrix, extras, test, walls):
    """results.json (every number the report shows, the recipe and each value's source, every run's costs,
    the eval curves) and scores.npz (the per-prompt test arrays each cell is computed from, `run|metric`)."""
    results = {
        "command": "python compare.py " + shlex.join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "minutes": extras["total"] / 60,
        "cpu_cores": os.cpu_count(),
        "seeds": extras["seeds"],
        "summary": extras["summary"],
        "rows": {
            n: {
                "stats": st,
                "cost": dict(
                    zip(("tokens_trained", "tokens_generated", "flops", "seconds"), costs.get(n, []))
                ),
            }
            for n, st in stats.items()
        },
        "matrix": {  # Δ, ±, p, and whether "a beats b" holds (the report's one Holm correction)
            f"{a} − {b}": [*v, (a, b, "above") in extras["held"]] for (a, b), v in matrix.items()
        },
        "sweep": {
            r: [
                {"setting": t["setting"], "kept": t["kept"], **{k: t["stats"][k] for k in ("score", "delta")}}
                for t in ts
            ]
            for r, ts in sweep.items()
        },
        "kept": extras["kept"],
        "recipe": {
            "learning_rate": args.learning_rate,
            "budgets": {
                k: getattr(args, k)
                for k in ("sft_steps", "steps", "reward_steps", "ppo_steps", "grpo_steps", "rloo_steps")
            },
            "flags": {
                r: [{"flags": f, "source": src} for f, src in RECIPE[r]]
                for r in dict.fromkeys(s["recipe"] for s in stages)
            },
            "sources": {
                "learning_rate": "--sweep's choice on the eval split (`sweep`, `kept`)"
                if args.sweep
                else "compare.py's --learning-rate, a stated default: the same for every row, not tuned",
                "sft_steps": PILOT,
                "budgets": BUDGET,
                "controls": f"each at its row's FLOPs, within {MATCH:.0%}",
            },
        },
        "runs": {
            s["name"]: dict(
                zip(
                    ("tokens_trained", "tokens_generated", "flops", "seconds"),
                    stage_cost(output_dir, s, walls),
                )
            )
            | {"max_steps": json.load(open(os.path.join(output_dir, s["name"], "args.json")))["max_steps"]}
            for s in stages
            if os.path.exists(os.path.join(output_dir, s["name"], "args.json"))
        },
        "curves_eval": {n: [c.tolist() for c in cs] for n, cs in extras["curves"].items()},
        "reward_model_accuracy": extras["reward_acc"],
    }
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        # numpy scalars and arrays -> JSON
        json.dump(results, f, indent=1, default=lambda v: v.tolist() if hasattr(v, "tolist") else float(v))
    np.savez_compressed(
        os.path.join(output_dir, "scores.npz"),
        **{f"{k}|{m}": np.asarray(v, np.float32) for k, a in test.items() for m, v in a.items()},
    )


if __name__ == "__main__":
    sys.argv[1:] = quick_argv(sys.argv[1:])  # --quick: its values unless a flag given says otherwise
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
