"""Compare post-training recipes on one base: SFT, then DPO, SimPO, ORPO, reward model + PPO, GRPO.

Every script runs through its real CLI (a subprocess), so a forked script slots in by name
(`--extra mydpo.py`); every resulting model is scored with evaluate.py's protocol against
the SFT model. Writes comparison.md (table) and comparison.png (curves + final scores).
    python compare.py --model gemma_2b --sft-args="--dataset sft.jsonl" --dpo-args="--dataset prefs.jsonl"
Offline, the toy task on the `tiny` model (minutes on a laptop-class CPU):
    python compare.py --model tiny
"""

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Literal

import common  # first: --help without heavy imports, KERAS_BACKEND=jax (JAX's devices start only to evaluate)

import numpy as np

METHODS = ("sft", "dpo", "simpo", "orpo", "ppo", "grpo")
PREFERENCE = ("dpo", "simpo", "orpo")  # started from the SFT model on the same preference data
MAIN_METRIC = ("objective/scores", "reward", "train/loss")  # the curve plotted per run: the first one logged


@dataclass
class Args:
    # what to run
    model: str = "tiny"
    """the base: any --model form (alias, preset, handle, local dir, `tiny`)"""
    chat_template: Literal["gemma", "llama3", "mistral", "chatml"] | None = None
    """how chats (message lists) are rendered; None: --model's family's (Gemma: gemma, Llama 3: llama3,
    Mistral: mistral, Qwen: chatml)"""
    methods: str = "sft,dpo,simpo,orpo,ppo,grpo"
    """comma-separated subset of sft,dpo,simpo,orpo,ppo,grpo (ppo trains a reward model first, see
    --ppo-reward; grpo optimises the task score, --reward-fn)"""
    extra: tuple[str, ...] = ()
    """forked scripts (e.g. mydpo.py), each run like dpo from the SFT model; the row is the file's name"""
    # budgets
    sft_steps: int = 150
    """SFT optimizer updates (the base every other method starts from)"""
    steps: int = 40
    """optimizer updates of each preference method (dpo, simpo, orpo, --extra): one shared budget"""
    reward_steps: int = 40
    """reward model updates (before PPO)"""
    ppo_steps: int = 20
    """PPO iterations (one rollout batch + 4 epochs × 2 mini-batches of updates each)"""
    grpo_steps: int = 100
    """GRPO iterations (one generation batch of 8 prompts × 8 completions + one update each: about
    PPO's wall time at its 20 iterations of 8 updates)"""
    learning_rate: float = 5e-5
    """peak learning rate of every method after SFT (dpo, simpo, orpo, --extra, ppo, grpo); the other fixed
    flags of the recipe are in RECIPE (the scripts' defaults are TRL's, for real pretrained models)"""
    ppo_reward: Literal["model", "fn", "both"] = "both"
    """`model`: PPO optimises a reward model trained on the same preference pairs (the same
    information the preference methods get); `fn`: the task score itself (--reward-fn, a
    verifiable reward); `both`: two PPO rows, `ppo` (reward model) and `ppo_fn`"""
    # pass-through flags, appended last (they override compare's choices); write them with `=`
    sft_args: str = ""
    """extra flags for sft.py, e.g. --sft-args="--learning-rate 5e-4" """
    dpo_args: str = ""
    """extra flags for dpo.py, e.g. --dpo-args="--beta 0.2 --precompute-ref" """
    simpo_args: str = "--sft-weight 1.0"
    """extra flags for simpo.py; the default adds an NLL on the chosen response with weight 1
    (TRL's CPO-SimPO default `cpo_alpha=1`; pure SimPO lowers the chosen likelihood too here)"""
    orpo_args: str = "--no-prompt-nll"
    """extra flags for orpo.py; the default puts the NLL on the chosen response only, like sft.py
    (the toy prompts are random digits: an NLL on them teaches nothing and swamps the loss)"""
    reward_args: str = ""
    """extra flags for reward.py"""
    ppo_args: str = ""
    """extra flags for ppo.py"""
    grpo_args: str = ""
    """extra flags for grpo.py"""
    extra_args: str = ""
    """extra flags for every --extra script"""
    # evaluation (evaluate.py's protocol)
    eval_prompts: str = os.path.join(common.HERE, "data", "prompts_eval.jsonl")
    """held-out prompts"""
    num_prompts: int = 200
    """held-out prompts evaluated (0: all)"""
    reward_fn: str = os.path.join(common.HERE, "data", "toy.py") + ":batch_score"
    """the task score, `path.py:function`"""
    max_new_tokens: int = 16
    """tokens generated per prompt"""
    temperature: float = 1.0
    """temperature of the sampled responses (KL is measured on them)"""
    seed: int = 0
    """passed to every script and to the evaluation"""
    # outputs
    output_dir: str | None = None
    """None: runs/compare__{model}__{seed}__{time}; one sub-directory per run"""
    overwrite: bool = False
    """replace the runs already in --output-dir (otherwise refused)"""


# ---------------------------------------------------------------------------
# The plan: which script runs, from which model, with which flags
# ---------------------------------------------------------------------------
# The recipe's fixed flags per script, ahead of the budgets, --learning-rate and the pass-through flags.
# The scripts' defaults are TRL's for real pretrained models (README: "Defaults"); these are the values
# the committed comparison (docs/comparison.md) was measured with, sized for `tiny` and the toy task.
RECIPE = {
    "sft": "--batch-size 32 --learning-rate 1e-3 --warmup-steps 20 --max-length 512",
    "dpo": "--batch-size 32 --warmup-steps 5 --max-length 512 --beta 0.1",
    "simpo": "--batch-size 32 --grad-accum-steps 1 --warmup-steps 5 --max-length 512 --beta 2.0 --gamma 0.5",
    "orpo": "--batch-size 32 --warmup-steps 5 --max-length 512 --beta 0.1",
    "reward": "--batch-size 32 --learning-rate 1e-3 --warmup-steps 10 --max-length 512",
    "ppo": "--batch-size 32 --num-mini-batches 2 --max-prompt-length 64 --response-length 16 "
           "--missing-eos-penalty 1.0 --kl-coef 0.05",
    "grpo": "--batch-size 64 --num-generations 8 --max-prompt-length 64 --response-length 16 --beta 0.04",
}
def plan(args, output_dir):
    """-> list of stages {name, script, flags, needs}, in run order; bad choices raise UsageError."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not (methods or args.extra):
        raise common.UsageError(f"--methods {args.methods!r}: choose from {','.join(METHODS)}")
    base = os.path.join(output_dir, "sft", "model") if "sft" in methods else args.model
    common_flags = ["--seed", str(args.seed)] + (["--chat-template", args.chat_template] if args.chat_template
                                                 else [])
    tuned = ["--learning-rate", str(args.learning_rate)]
    stage = lambda name, script, flags, extra, needs=(), recipe=None: {
        "name": name, "script": script, "needs": [n for n in needs if n in methods or n == "reward"],
        "flags": flags + shlex.split(RECIPE[recipe or name.split("_")[0]]) + common_flags
        + ["--output-dir", os.path.join(output_dir, name)] + shlex.split(extra)}
    script = lambda name: os.path.join(common.HERE, f"{name}.py")
    stages = []
    if "sft" in methods:
        stages.append(stage("sft", script("sft"), ["--model", args.model, "--max-steps", str(args.sft_steps)],
                            args.sft_args))
    for name in (m for m in PREFERENCE if m in methods):
        stages.append(stage(name, script(name), ["--model", base, "--max-steps", str(args.steps)] + tuned,
                            getattr(args, f"{name}_args"), ["sft"]))
    for path in args.extra:
        name = os.path.splitext(os.path.basename(path))[0]
        if not path.endswith(".py") or not os.path.exists(path) or name in METHODS + ("reward",):
            raise common.UsageError(f"--extra {path}: expected an existing script whose name is not a built-in")
        stages.append(stage(name, os.path.abspath(path), ["--model", base, "--max-steps", str(args.steps)] + tuned,
                            args.extra_args, ["sft"], recipe="dpo"))
    if "ppo" in methods:
        ppo = lambda name, reward, needs: stage(name, script("ppo"), ["--model", base, "--max-steps",
                                                                     str(args.ppo_steps)] + tuned + reward,
                                                args.ppo_args, needs)
        if args.ppo_reward in ("model", "both"):
            stages.append(stage("reward", script("reward"), ["--model", base, "--max-steps", str(args.reward_steps),
                                                              "--normalize"], args.reward_args, ["sft"]))
            stages.append(ppo("ppo", ["--reward-model", os.path.join(output_dir, "reward", "model")],
                              ["sft", "reward"]))
        if args.ppo_reward in ("fn", "both"):
            stages.append(ppo("ppo_fn" if args.ppo_reward == "both" else "ppo", ["--reward-fn", args.reward_fn],
                              ["sft"]))
    if "grpo" in methods:  # a verifiable reward: the task score itself, like ppo_fn
        stages.append(stage("grpo", script("grpo"), ["--model", base, "--max-steps", str(args.grpo_steps)] + tuned
                            + ["--reward-fn", args.reward_fn], args.grpo_args, ["sft"]))
    return stages, base


def prepare_output_dir(output_dir, stages, overwrite):
    """Refuse to mix with an earlier comparison unless --overwrite (which removes its runs)."""
    held = [s["name"] for s in stages if os.path.exists(os.path.join(output_dir, s["name"]))]
    if held and not overwrite:
        raise common.UsageError(f"--output-dir {output_dir} already holds runs ({', '.join(held)}); "
                                "pass --overwrite to replace them")
    for name in held:
        shutil.rmtree(os.path.join(output_dir, name))
    os.makedirs(output_dir, exist_ok=True)


# ---------------------------------------------------------------------------
# Running the scripts and reading their outputs
# ---------------------------------------------------------------------------
def read_metrics(run_dir):
    """metrics.jsonl -> list of rows (empty when the run wrote none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main_curve(rows):
    """(metric name, steps, values) of the run's main training metric."""
    for name in MAIN_METRIC:
        points = [(r["step"], r[name]) for r in rows if name in r]
        if points:
            steps, values = zip(*points)
            return name, list(steps), list(values)
    return None, [], []


def tokens_per_sec(rows):
    """Median of the logged charts/tokens_per_sec (the median drops the compile-heavy first interval)."""
    values = [r["charts/tokens_per_sec"] for r in rows if "charts/tokens_per_sec" in r]
    return float(np.median(values)) if values else float("nan")


def run_stage(i, n, stage, output_dir):
    """Run one script to completion, its output in <name>.log -> (ok, wall seconds)."""
    log_path = os.path.join(output_dir, f"{stage['name']}.log")
    cmd = [sys.executable, stage["script"]] + stage["flags"]
    print(f"[{i}/{n}] {stage['name']}: {shlex.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    # A forked script (--extra) may live anywhere: it still finds `common` and the toy data.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [common.HERE, os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - t0
    name, _, values = main_curve(read_metrics(os.path.join(output_dir, stage["name"])))
    curve = f"; {name} {values[0]:.3f} -> {values[-1]:.3f}" if values else ""
    if rc != 0:
        with open(log_path) as f:
            tail = "".join(f.readlines()[-10:])
        print(f"      FAILED (exit {rc}) after {wall:.0f} s; last lines of {log_path}:\n{tail}", flush=True)
        return False, wall
    print(f"      done in {wall:.0f} s{curve}", flush=True)
    return True, wall


# ---------------------------------------------------------------------------
# Evaluation (evaluate.py's protocol, in this process: one compilation for every model)
# ---------------------------------------------------------------------------
def evaluate_models(args, base, models, reward_model, output_dir):
    """models: {row name: model dir} -> {row name: evaluate.summarize numbers}; each model is
    scored against `base` and its eval.json / samples.jsonl go to <run>/eval/."""
    import evaluate  # JAX starts only now, after the training processes ended (a TPU admits one)

    eargs = evaluate.Args(model=base, baseline=base, prompts=args.eval_prompts, num_prompts=args.num_prompts,
                          reward_fn=args.reward_fn, reward_model=reward_model, chat_template=args.chat_template,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    mesh = common.make_mesh(None)
    prompts, reward_fn = evaluate.check_args(eargs, mesh)
    base_policy = evaluate.load_policy(base, mesh, eargs)
    data = evaluate.prepare(eargs, mesh, prompts, base_policy.model.preprocessor.tokenizer)
    scorer = evaluate.make_scorer(eargs, mesh, data, reward_fn)
    base_outs = evaluate.evaluate_policy(base_policy, data, scorer, eargs, mesh, baseline=base_policy)
    results = {}
    for name, model_dir in models.items():
        t0 = time.perf_counter()
        if model_dir == base:
            outs = base_outs
        else:
            policy = evaluate.load_policy(model_dir, mesh, eargs, like=base_policy)
            evaluate.check_same_tokens(model_dir, policy.model, data, eargs, name)
            outs = evaluate.evaluate_policy(policy, data, scorer, eargs, mesh, baseline=base_policy)
        results[name] = evaluate.summarize(outs, base_outs)
        eval_dir = os.path.join(output_dir, name, "eval")
        evaluate.write_outputs(eval_dir, {"model": model_dir, "baseline": base, "num_prompts": len(data["prompts"]),
                                          "seed": args.seed, "temperature": args.temperature, **results[name]},
                               evaluate.examples(outs, data, 8, base_outs))
        print(f"      eval {name}: task score {results[name]['score']:.3f}, KL {results[name]['kl']:.3f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return results


# ---------------------------------------------------------------------------
# Report: the table (markdown), the picture
# ---------------------------------------------------------------------------
def note(name, m, base_name, base_m, run_metrics, on_reward_model):
    """One honest line per row: does it beat the base on the task score, and if not, the likely
    why, read from the numbers (the run's own held-out log-probs, the reward-model score, KL)."""
    if name == base_name:
        return "the base every other method starts from"
    delta = m["score"] - base_m["score"]
    if delta > 0:
        return f"beats {base_name} (+{delta:.3f})"
    head = f"does not beat {base_name} ({delta:+.3f}): "
    chosen = [r["eval/logps/chosen"] for r in run_metrics if "eval/logps/chosen" in r]
    if len(chosen) >= 2 and chosen[-1] < chosen[0]:
        longer = "; greedy answers got longer" if m["length"] > base_m["length"] + 0.5 else ""
        return head + (f"held-out chosen log-prob fell too ({chosen[0]:.2f} → {chosen[-1]:.2f}): the margin grew "
                       f"by pushing both answers down (likelihood displacement){longer}")
    if on_reward_model and "rm_score" in m and m["rm_score"] > base_m["rm_score"]:
        return head + (f"reward hacking: reward-model score {base_m['rm_score']:.2f} → {m['rm_score']:.2f} while "
                       f"the task score fell; answers got longer ({m['length']:.1f} vs {base_m['length']:.1f} tokens)")
    if abs(delta) < 0.02 or m["kl"] < 0.05:
        return head + f"about unchanged (KL {m['kl']:.2f}): the step budget is too small to move greedy answers"
    return head + f"moved (KL {m['kl']:.2f}) in a direction its training signal prefers but the task score does not"


def table(rows, base_name, with_rm):
    """rows: [(name, metrics or None, tokens/s, wall s, note)] -> markdown table."""
    cols = ["method", "task score", "sampled score"] + (["RM score"] if with_rm else []) + [
        f"win rate vs {base_name}", f"KL from {base_name}", "length", "tokens/s", "wall time", "notes"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] + ["---:"] * (len(cols) - 2) + ["---"]) + "|"]
    for name, m, tps, wall, text in rows:
        if m is None:
            cells = ["–"] * (len(cols) - 4)
        else:
            cells = [f"{m['score']:.3f}", f"{m['score_sampled']:.3f}"] + (
                [f"{m['rm_score']:.2f}"] if with_rm else []) + [
                f"{m['win_rate']:.3f}", f"{m['kl']:.3f}", f"{m['length']:.1f}"]
        cells += [f"{tps:.0f}" if np.isfinite(tps) else "–", f"{wall:.0f} s" if wall else "–"]
        lines.append("| " + " | ".join([f"**{name}**"] + cells + [text]) + " |")
    return "\n".join(lines)


def plot(curves, results, base_name, temperature, path):
    """Each run's main training metric (left grid) and the held-out task scores (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(1, -(-len(curves) // 2))
    fig = plt.figure(figsize=(3.0 * cols + 5.0, 6.0))
    grid = fig.add_gridspec(2, cols + 1, width_ratios=[1] * cols + [1.6])
    for i, (name, (metric, steps, values)) in enumerate(curves.items()):
        ax = fig.add_subplot(grid[i % 2, i // 2])
        ax.plot(steps, values, marker=".", lw=1.2)
        ax.set_title(f"{name}: {metric}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    ax = fig.add_subplot(grid[:, cols])
    names = list(results)
    x = np.arange(len(names))
    ax.bar(x - 0.2, [results[n]["score"] for n in names], 0.4, label="greedy")
    ax.bar(x + 0.2, [results[n]["score_sampled"] for n in names], 0.4, label=f"sampled (T={temperature:g})")
    if base_name in results:
        ax.axhline(results[base_name]["score"], ls="--", lw=1, color="gray", label=f"{base_name} greedy")
    ax.set_xticks(x, names)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("held-out task score")
    ax.set_title("final scores (evaluate.py protocol)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(args, output_dir, stages, rows, results, curves, base_name, reward_acc, total):
    """comparison.md (table, protocol, commands) and comparison.png into output_dir."""
    with_rm = any("rm_score" in m for m in results.values())
    md = table(rows, base_name, with_rm)
    short = lambda p: p if os.path.relpath(p).startswith("..") else os.path.relpath(p)
    runs = "\n".join(f"    python {short(s['script'])} {shlex.join(s['flags'])}" for s in stages)
    rm_line = (f"- reward model (PPO's reward, trained on the same preference pairs): held-out pair accuracy "
               f"{reward_acc:.3f}.\n" if reward_acc is not None else "")
    n_prompts = args.num_prompts or "all"
    ppo_note = "; ppo includes its reward model" if "reward" in curves else ""
    text = f"""# Post-training recipes compared on `{args.model}`

`python compare.py {shlex.join(sys.argv[1:])}` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, \
{total / 60:.1f} min in all on {os.cpu_count()} CPU cores.

{md}

- **task score**: mean `{short(args.reward_fn)}` over {n_prompts} held-out prompts \
({short(args.eval_prompts)}), greedy responses; \
**sampled score**: one sample per prompt at T={args.temperature:g} (seed {args.seed}).
- **win rate vs {base_name}**: share of prompts whose greedy answer scores higher than {base_name}'s (ties count half).
- **KL from {base_name}**: mean over prompts of Σ_t [log π(y_t) − log π_{base_name}(y_t)] on the model's own sampled \
responses (nats per response, float32, prompt and padding masked).
- **length**: greedy response tokens before EOS. **tokens/s**: median of the run's logged `charts/tokens_per_sec` \
(PPO, GRPO: prompt + response tokens of a rollout batch per whole iteration). **wall time**: the script's whole run \
(start-up, compilation, training, saving){ppo_note}.
{rm_line}
![training curves and final scores](comparison.png)

Commands run:

{runs}
"""
    with open(os.path.join(output_dir, "comparison.md"), "w") as f:
        f.write(text)
    plot(curves, results, base_name, args.temperature, os.path.join(output_dir, "comparison.png"))
    return md


def main(args):
    output_dir = args.output_dir or common.default_output_dir("compare", args.model, args.seed)
    stages, base = plan(args, output_dir)
    common.load_reward_fn(args.reward_fn)
    # --model resolves (no SFT stage: it is the base itself) and every held-out prompt reads
    common.read_dataset(args.eval_prompts, "prompt", common.chat_template(args.model, args.chat_template),
                        "--eval-prompts")
    prepare_output_dir(output_dir, stages, args.overwrite)
    t_start, ok, walls = time.perf_counter(), {}, {}
    for i, stage in enumerate(stages, 1):
        missing = [n for n in stage["needs"] if not ok.get(n)]
        if missing:
            print(f"[{i}/{len(stages)}] {stage['name']}: skipped ({', '.join(missing)} failed)", flush=True)
            ok[stage["name"]], walls[stage["name"]] = False, 0.0
            continue
        ok[stage["name"]], walls[stage["name"]] = run_stage(i, len(stages), stage, output_dir)
    if any(s["name"] == "sft" for s in stages) and not ok["sft"]:
        print(f"error: sft failed: nothing to compare (see {output_dir}/sft.log)", file=sys.stderr)
        sys.exit(1)
    md = evaluate_and_report(args, output_dir, stages, base, ok, walls, t_start)
    print(f"\n{md}\n\ndone in {(time.perf_counter() - t_start) / 60:.1f} min: "
          f"{output_dir}/comparison.md, comparison.png")
    sys.exit(0 if all(ok.values()) else 1)


def evaluate_and_report(args, output_dir, stages, base, ok, walls, t_start):
    """Score every finished run against the base, then write comparison.md / .png -> the table."""
    base_name = "sft" if any(s["name"] == "sft" for s in stages) else "base"
    print(f"[eval] {args.num_prompts or 'all'} held-out prompts, every model against {base_name}", flush=True)
    policies = [s["name"] for s in stages if s["name"] != "reward"]
    models = {base_name: base, **{n: os.path.join(output_dir, n, "model") for n in policies
                                  if n != "sft" and ok[n]}}
    reward_model = os.path.join(output_dir, "reward", "model") if ok.get("reward") else None
    results = evaluate_models(args, base, models, reward_model, output_dir)

    metrics = {s["name"]: read_metrics(os.path.join(output_dir, s["name"])) for s in stages}
    curves = {n: main_curve(m) for n, m in metrics.items() if main_curve(m)[0]}
    reward_acc = next((r["eval/accuracy"] for r in reversed(metrics.get("reward", [])) if "eval/accuracy" in r), None)
    rows = []
    for name in ([base_name] if base_name == "base" else []) + policies:
        wall = walls.get(name, 0.0) + (walls.get("reward", 0.0) if name == "ppo" else 0.0)
        m = results.get(name)
        on_rm = any(s["name"] == name and "--reward-model" in s["flags"] for s in stages)
        text = (note(name, m, base_name, results[base_name], metrics.get(name, []), on_rm) if m is not None
                else f"failed or skipped: see {name}.log")
        rows.append((name, m, tokens_per_sec(metrics.get(name, [])), wall, text))
    return write_report(args, output_dir, stages, rows, results, curves, base_name, reward_acc,
                        time.perf_counter() - t_start)


if __name__ == "__main__":
    main(common.cli(Args))
