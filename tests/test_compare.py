"""evaluate.py: win rate and KL by hand and in float64 NumPy, a worked example on `tiny`
(scores re-derived from the decoded outputs, KL = 0 and win rate 0.5 against itself, greedy
== KerasHub's own generate), bad flags exit 2; compare.py's statistics (intervals by hand and on synthetic tables with a
known difference), sweep, costs and plan, and compare.py end to end with a tiny budget."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import common  # noqa: F401  (first: KERAS_BACKEND=jax)
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import compare
import evaluate
from evaluate import response_lengths, sequence_kl, win_rate
from helpers import learning_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------
# The protocol's arithmetic
# ---------------------------------------------------------------------------
def test_win_rate_by_hand():
    # wins 1, ties 2 (½ each), losses 1 -> (1 + 2·½ + 0) / 4
    assert win_rate([1.0, 0.5, 0.5, 0.0], [0.0, 0.5, 0.5, 1.0]) == (1 + 2 * 0.5) / 4
    assert win_rate([2.0, 3.0], [1.0, 1.0]) == 1.0
    assert win_rate([0.0], [1.0]) == 0.0


def test_sequence_kl_by_hand_numpy_and_masking():
    logps = jnp.array([[-1.0, -2.0, -3.0]])
    base = jnp.array([[-2.0, -2.5, -100.0]])
    mask = jnp.array([[True, True, False]])  # the third token is padding: it must not count
    np.testing.assert_allclose(sequence_kl(logps, base, mask), [(-1 + 2) + (-2 + 2.5)])
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(16, 12)), rng.normal(size=(16, 12))
    m = rng.random((16, 12)) < 0.7
    expected = np.sum(np.where(m, a - b, 0.0), axis=1)  # float64
    np.testing.assert_allclose(sequence_kl(jnp.array(a), jnp.array(b), jnp.array(m)), expected, rtol=1e-5)
    assert (sequence_kl(jnp.array(a), jnp.array(a), jnp.array(m)) == 0).all()  # identical models: exactly 0


def test_response_lengths_exclude_the_stop_token():
    stops = (1, 9)  # EOS and a turn end
    responses = np.array([[5, 1, 0, 0], [5, 6, 7, 8], [1, 0, 0, 0], [5, 6, 9, 0]])
    lengths, has_eos = response_lengths(responses, np.array([1, 3, 0, 2]), stops)
    np.testing.assert_array_equal(lengths, [1, 4, 0, 2])  # no stop token: all R tokens count
    np.testing.assert_array_equal(has_eos, [True, False, True, True])


# ---------------------------------------------------------------------------
# evaluate.py on a known model / scorer pair
# ---------------------------------------------------------------------------
def test_evaluate_worked_example(tmp_path):
    """tiny (seed 0) against itself, scored by a reward fn that counts the digit 4 in a response (in
    TRL's form, with the prompts' `answer` column: it checks each is its prompt's)."""
    scorer = tmp_path / "count4.py"
    scorer.write_text(
        "def count4(prompts, completions, answer, **kwargs):\n"
        "    assert all(a.split() == sorted(p.split()[1:]) for p, a in zip(prompts, answer))\n"
        "    return [float(r.count('4')) for r in completions]\n"
        "def one(prompts, responses):\n"
        "    return [1.0] * len(responses)\n"
    )
    out = tmp_path / "eval"
    flags = dict(
        model="tiny",
        baseline="tiny",
        num_prompts=12,
        num_examples=12,
        max_new_tokens=8,
        batch_size=8,
        output_dir=str(out),
    )
    evaluate.main(evaluate.Args(reward_fn=(f"{scorer}:count4",), **flags))
    result = json.loads((out / "eval.json").read_text())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == result["num_prompts"] == 12
    # The task score is the mean of the scorer over the decoded responses.
    assert result["score"] == np.mean([s["greedy"].count("4") for s in samples])
    assert result["score_sampled"] == np.mean([s["sampled"].count("4") for s in samples])
    assert [s["greedy_score"] for s in samples] == [float(s["greedy"].count("4")) for s in samples]
    # Against itself: identical responses and log-probs -> KL exactly 0, every prompt a tie.
    assert result["kl"] == 0.0 and result["win_rate"] == 0.5
    assert result["baseline_score"] == result["score"]
    assert [s["baseline_greedy"] for s in samples] == [s["greedy"] for s in samples]
    assert 0 <= result["length"] <= 8 and 0 <= result["eos_rate"] <= 1
    arrays = np.load(out / "scores.npz")  # per prompt: the means of eval.json, and the ties against itself
    assert arrays["score"].shape == (12,) and arrays["score"].mean() == result["score"]
    assert (arrays["win"] == 0.5).all() and (arrays["kl"] == 0).all()

    # An earlier evaluation is kept unless --overwrite; several functions score as grpo.py's do:
    # 2 × count4 + 0.5 × one, on the same responses (same seed; no baseline: only the policy's are read).
    before = (out / "eval.json").read_text()
    with pytest.raises(common.UsageError, match="already holds an evaluation.*--overwrite"):
        evaluate.main(evaluate.Args(reward_fn=(f"{scorer}:count4",), **flags))
    assert (out / "eval.json").read_text() == before
    evaluate.main(
        evaluate.Args(
            reward_fn=(f"{scorer}:count4", f"{scorer}:one"),
            reward_weights=(2.0, 0.5),
            overwrite=True,
            **{**flags, "baseline": None},
        )
    )
    weighted = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["greedy"] for s in weighted] == [s["greedy"] for s in samples]
    assert [s["greedy_score"] for s in weighted] == [2.0 * s["greedy"].count("4") + 0.5 for s in samples]

    # Deterministic for a seed: the same sampled responses again, from a fresh load.
    args = evaluate.Args(model="tiny", num_prompts=12, max_new_tokens=8, batch_size=8)
    mesh = common.make_mesh(None)
    policy = evaluate.load_policy("tiny", mesh, args)
    prompts, rows, _ = evaluate.check_args(args, mesh)
    data = evaluate.prepare(args, mesh, prompts, rows, policy.model.preprocessor.tokenizer)
    again = evaluate.respond(policy, data, "sampled", jax.random.key(0), data["batch_size"], mesh)
    assert again["texts"] == [s["sampled"] for s in samples]

    # The greedy responses are KerasHub's own greedy generate (an independent sampler); prompts
    # of one token length share a call (KerasHub fills a batch up to one max_length).
    tokenizer = policy.model.preprocessor.tokenizer
    n = len(tokenizer.tokenize(samples[0]["prompt"])) + 1  # + BOS
    same = [s for s in samples if len(tokenizer.tokenize(s["prompt"])) + 1 == n][:4]
    outs = policy.model.generate([s["prompt"] for s in same], max_length=n + 8, strip_prompt=True)
    assert list(outs) == [s["greedy"] for s in same]


def test_evaluate_bad_flags_exit_2(tmp_path, monkeypatch):
    """Bad input: one line on stderr, exit 2, before any model loads (through the CLI once; in
    process, the UsageError that the CLI turns into that line, naming the flag)."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "evaluate.py"), "--reward-fn", "nope.py:f"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and out.stderr.startswith("error: --reward-fn"), out.stderr[-500:]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr[-500:]
    loads = []
    monkeypatch.setattr(
        common, "load_model", lambda *a, **k: loads.append(a) or pytest.fail("a model loaded")
    )
    cases = [
        ({"model": "no_such_model"}, "--model"),
        ({"prompts": str(tmp_path / "missing.jsonl")}, "--prompts"),
        ({"batch_size": 3}, "--batch-size"),
        ({"reward_model": str(tmp_path)}, "--reward-model"),
        ({"reward_fn": ()}, "--reward-fn"),
        ({"reward_weights": (1.0, 2.0)}, "--reward-weights"),
        ({"temperature": 0.0}, "--temperature"),
    ]
    for flags, named in cases:
        with pytest.raises(common.UsageError) as e:
            evaluate.main(evaluate.Args(output_dir=str(tmp_path / "e"), **flags))
        assert named in str(e.value) and len(str(e.value).splitlines()) == 1, (flags, str(e.value))
    assert not loads and not (tmp_path / "e").exists()
    import grpo  # GRPO's completion length by default (TRL's max_completion_length)

    assert evaluate.Args().max_new_tokens == grpo.Args().response_length == 256


# ---------------------------------------------------------------------------
# compare.py: statistics, sweep, costs (pure functions, synthetic inputs)
# ---------------------------------------------------------------------------
def test_t_quantile_against_tables():
    for p, df, table in [
        (0.975, 1, 12.7062),
        (0.975, 2, 4.302653),
        (0.975, 10, 2.228139),
        (0.95, 5, 2.015048),
        (0.975, 1e9, 1.959964),
    ]:
        assert abs(compare.t_quantile(p, df) - table) < 1e-4 * table, (p, df)


def test_mean_interval_by_hand():
    # one seed: the t-interval over prompts: var = s²/P = (5/3)/4, df 3, t_.975(3) = 3.182446
    m, h = compare.mean_interval([[0.0, 1.0, 2.0, 3.0]])
    assert m == 1.5 and abs(h - 3.182446 * np.sqrt(5 / 3 / 4)) < 1e-5
    # 2 seeds × 2 prompts: MS_seed = 9, MS_prompt = 4, MS_resid = 1 -> Var = (9 + 4 - 1) / 4 = 3,
    # Satterthwaite df = 12² / (9²/1 + 4²/1 + 1²/1) = 144/98
    m, h = compare.mean_interval([[1.0, 2.0], [3.0, 6.0]])
    assert m == 3.0 and abs(h - compare.t_quantile(0.975, 144 / 98) * np.sqrt(3)) < 1e-9
    # identical seeds (the shared SFT base's greedy scores): only the prompts' spread counts
    x = np.array([[0.0, 1.0, 2.0, 3.0]] * 3)
    assert np.isclose(compare.mean_interval(x)[1], compare.mean_interval(x[:1])[1])
    assert compare.mean_interval(np.zeros((3, 5))) == (0.0, 0.0)


def synthetic(rng, delta, seeds=3, prompts=300):
    """A shared base and one method whose true mean differs by `delta`: prompt difficulty shared by both,
    a seed effect and per-(seed, prompt) noise on the method."""
    difficulty = rng.normal(0, 0.2, prompts)
    base = np.tile(0.5 + difficulty + rng.normal(0, 0.1, prompts), (seeds, 1))
    row = 0.5 + delta + difficulty + rng.normal(0, 0.02, (seeds, 1)) + rng.normal(0, 0.1, (seeds, prompts))
    ones = np.ones((seeds, prompts))
    return {"score": row, "kl": ones, "length": 8 * ones}, {"score": base, "kl": 0 * ones, "length": 8 * ones}


def test_paired_interval_covers_the_truth_and_within_noise_note():
    rng = np.random.default_rng(0)
    notes = {}
    for name, delta in (("better", 0.08), ("same", 0.0), ("worse", -0.08)):
        row, base = synthetic(rng, delta)
        st, base_st = compare.row_stats(row, base), compare.row_stats(base, base)
        d, h = st["delta"]
        assert abs(d - delta) <= h < 0.05, (name, d, h)  # covers the truth, and is narrow enough to tell
        notes[name] = compare.note(name, st, "sft", base_st, run_metrics=[[]], on_reward_model=False)
    assert notes["better"].startswith("beats sft") and notes["worse"].startswith("below sft")
    assert notes["same"].startswith("within noise of sft")
    assert ["within noise" in n for n in notes.values()] == [False, True, False]
    # in a report the words follow Holm's correction: an interval clear of 0 whose claim does not survive it
    # is said to be that interval's alone, never "beats"
    row, base = synthetic(rng, 0.08)
    st, base_st = compare.row_stats(row, base), compare.row_stats(base, base)
    d, h = st["delta"]
    args = dict(run_metrics=[[]], on_reward_model=False)
    alone = compare.note("dpo", st, "sft", base_st, held=set(), **args)
    assert alone == f"above sft (Δ {d:+.3f} ± {h:.3f}; alone, not after Holm's correction)"
    assert compare.note("dpo", st, "sft", base_st, held={("dpo", "sft", "above")}, **args).startswith(
        "beats sft"
    )
    assert compare.verdict((-0.1, 0.01), "sft", held=set(), row="dpo") == (
        "below sft (Δ -0.100 ± 0.010; alone, not after Holm's correction)"
    )
    assert base_st["delta"] == (0.0, 0.0)
    # coverage over many synthetic tables: close to the nominal 95% with 3 seeds
    hits = 0
    for _ in range(300):
        d, h = compare.row_stats(*synthetic(rng, 0.03, prompts=100))["delta"]
        hits += abs(d - 0.03) <= h
    assert 0.90 <= hits / 300 <= 0.99, hits / 300


def test_sweep_parsing_and_plan(tmp_path):
    grid = compare.parse_sweep(
        ["dpo.learning_rate=1e-6,5e-6", "dpo.beta=0.1,0.2", "grpo.beta=0"], ["dpo", "grpo"]
    )
    assert grid["dpo"] == [
        {"learning_rate": "1e-6", "beta": "0.1"},
        {"learning_rate": "1e-6", "beta": "0.2"},
        {"learning_rate": "5e-6", "beta": "0.1"},
        {"learning_rate": "5e-6", "beta": "0.2"},
    ]
    assert grid["grpo"] == [{"beta": "0"}] and compare.tag(grid["dpo"][1]) == "learning_rate_1e-6__beta_0.2"
    for bad in ("sft.learning_rate=1e-3", "dpo.learning_rate=", "dpo=1", "orpo.beta=0.1", "dpo.bad-flag=1"):
        with pytest.raises(common.UsageError, match="--sweep"):
            compare.parse_sweep([bad], ["dpo", "grpo"])
    # `all`: every row, controls included; a control's kind: each run of it
    rows = ["dpo", "grpo", "sft-chosen@dpo", "rft@grpo"]
    every = compare.parse_sweep(["all.learning_rate=2e-5,2e-4", "rft.beta=0.1"], rows)
    assert list(every) == rows and every["dpo"] == [{"learning_rate": "2e-5"}, {"learning_rate": "2e-4"}]
    assert every["rft@grpo"] == [
        {"learning_rate": "2e-5", "beta": "0.1"},
        {"learning_rate": "2e-4", "beta": "0.1"},
    ]
    args = compare.Args(
        methods="sft,dpo,simpo",
        seeds=2,
        seed=5,
        sweep=("dpo.learning_rate=1e-6,5e-6",),
        dpo_args="--learning-rate 1e-5",
    )
    stages, bases, seeds, _ = compare.plan(args, str(tmp_path))
    assert seeds == [5, 6] and [s["name"] for s in stages] == [
        "sft/seed5",
        "dpo/learning_rate_1e-6/seed5",
        "dpo/learning_rate_5e-6/seed5",
        "simpo/seed5",
        "sft/seed6",
        "dpo/learning_rate_1e-6/seed6",
        "dpo/learning_rate_5e-6/seed6",
        "simpo/seed6",
    ]
    dpo = stages[5]["flags"]
    assert dpo[-2:] == [
        "--learning-rate",
        "1e-6",
    ]  # the swept value comes last: it overrides the pass-through
    assert dpo[dpo.index("--seed") + 1] == "6" and dpo[dpo.index("--model") + 1] == bases[6]
    # each seed its own SFT base, trained with that seed, and its rows start from it
    assert bases == {s: str(tmp_path / "sft" / f"seed{s}" / "model") for s in (5, 6)}
    assert [last(stages[i]["flags"], "--seed") for i in (0, 4)] == ["5", "6"]
    assert stages[5]["needs"] == ["sft/seed6"]
    assert dpo[dpo.index("--output-dir") + 1] == str(tmp_path / "dpo" / "learning_rate_1e-6" / "seed6")


def test_run_cost_from_logged_numbers(tmp_path):
    rl, plain, old = tmp_path / "ppo", tmp_path / "dpo", tmp_path / "fork"
    for d in (rl, plain, old):
        d.mkdir()
    rows = [
        {"step": 1, "charts/tokens": 2560.0, "charts/flops": 1e9},
        {"step": 1, "eval/accuracy": 0.5},
        {"step": 2, "charts/tokens": 2560.0, "charts/flops": 1.5e9},
    ]
    for d in (rl, plain):
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (rl / "args.json").write_text(json.dumps({"max_steps": 20, "batch_size": 32, "response_length": 16}))
    (plain / "args.json").write_text(json.dumps({"max_steps": 40, "batch_size": 32}))
    (old / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    assert compare.run_cost(str(rl)) == [
        5120.0,
        20 * 32 * 16,
        2.5e9,
    ]  # logged before generated_tokens: R each
    sampled = [dict(r, **{"charts/generated_tokens": n}) for r, n in zip(rows[::2], (300.0, 212.0))]
    (rl / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sampled))
    assert compare.run_cost(str(rl)) == [5120.0, 512.0, 2.5e9]  # the tokens sampled, through each EOS
    assert compare.run_cost(str(plain)) == [5120.0, 0.0, 2.5e9]  # no sampling: nothing generated
    tokens, generated, flops = compare.run_cost(str(old))  # a script that logs no counts: unknown, not 0
    assert np.isnan(tokens) and np.isnan(flops) and generated == 0
    assert [compare.fmt(v) for v in (5120.0, 1.234e6, 2.5e12, float("nan"))] == [
        "5120",
        "1.23M",
        "2.50e12",
        "–",
    ]
    table = compare.table(
        [
            ("a", None, [55648.0, 0.0, 5e9, 1.0], "", ""),
            ("b", None, [1.1e5, 0.0, 2.5e12, 1.0], "", "1.02×, 0.7×"),
        ],
        "a",
        False,
    )
    assert [line.split(" | ")[8:11] for line in table.splitlines()[2:]] == [
        ["0.06M", "0", "5.00e09"],
        ["0.11M", "0", "2.50e12"],
    ]  # one unit a column: its largest value's
    assert [line.split(" | ")[12] for line in table.splitlines()[2:]] == ["–", "1.02×, 0.7×"]
    assert compare.fmt((0.5581, 0.0312)) == "0.558 ± 0.031"


def last(flags, name):
    """The value a flag ends with (the scripts' CLIs: the last occurrence wins)."""
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]


def test_plan_controls_and_task_data(tmp_path):
    """--task compare: each script reads data/compare/ (its own files); every control runs once per row it reads,
    after that row (its step count comes from the row's logged FLOPs): sft-chosen, the chosen answers, reads
    the preference rows and PPO on a reward model; rft, grpo.py --accept-reward on the prompts, the checker
    rows; sft+, the demonstrations, every row. Every row after SFT, controls too, at --learning-rate."""
    args = compare.Args(methods="sft,dpo,kto,ppo,grpo,sft+,sft-chosen,rft", seeds=1, steps=7, grpo_steps=3)
    stages = {s["name"]: s for s in compare.plan(args, str(tmp_path))[0]}
    assert list(stages) == [
        "sft/seed0",
        "reward/seed0",
        "dpo/seed0",
        "kto/seed0",
        "ppo/seed0",
        "ppo_fn/seed0",
        "grpo/seed0",
        "sft+@dpo/seed0",
        "sft-chosen@dpo/seed0",
        "sft+@kto/seed0",
        "sft-chosen@kto/seed0",
        "sft+@ppo/seed0",
        "sft-chosen@ppo/seed0",
        "sft+@ppo_fn/seed0",
        "rft@ppo_fn/seed0",
        "sft+@grpo/seed0",
        "rft@grpo/seed0",
    ]
    data = os.path.join(ROOT, "data", "compare")
    expect = {
        "sft/seed0": "sft_train",
        "dpo/seed0": "prefs_train",
        "kto/seed0": "kto_train",
        "grpo/seed0": "prompts_train",
        "sft+@grpo/seed0": "sft_train",
        "sft-chosen@dpo/seed0": "chosen_train",
        "rft@grpo/seed0": "prompts_train",
    }
    for name, file in expect.items():
        assert last(stages[name]["flags"], "--dataset") == os.path.join(data, file + ".jsonl"), name
    chosen = [json.loads(line) for line in open(os.path.join(data, "chosen_train.jsonl"))]
    pairs = [json.loads(line) for line in open(os.path.join(data, "prefs_train.jsonl"))]
    assert [(c["prompt"], c["completion"]) for c in chosen] == [(p["prompt"], p["chosen"]) for p in pairs]
    rft, ctl, dpo = stages["rft@grpo/seed0"], stages["sft-chosen@dpo/seed0"], stages["dpo/seed0"]["flags"]
    assert rft["script"].endswith("grpo.py") and last(rft["flags"], "--accept-reward") == "1.0"
    assert last(rft["flags"], "--reward-fn") == args.reward_fn and last(rft["flags"], "--beta") == "0.0"
    assert ctl["script"].endswith("sft.py") and int(last(ctl["flags"], "--batch-size")) == 64
    assert "--max-steps" not in rft["flags"] + ctl["flags"]  # known once the row has run
    assert ctl["match"] == ["dpo/seed0"] and ctl["needs"] == ["sft/seed0", "dpo/seed0"]
    assert stages["sft-chosen@ppo/seed0"]["match"] == ["ppo/seed0"] and rft["match"] == ["grpo/seed0"]
    assert {s["via"] for n, s in stages.items() if "@" in n} == {
        "--sft-args",
        "--sft-chosen-args",
        "--rft-args",
    }
    rates = {
        last(s["flags"], "--learning-rate")
        for n, s in stages.items()
        if n.split("/")[0] not in ("sft", "reward")
    }
    assert rates == {str(args.learning_rate)} and last(dpo, "--max-steps") == "7"
    # the curves' checkpoints: every steps / (3 + 1) updates, all kept; none with --curve-points 0
    assert [last(stages[n]["flags"], "--save-every") for n in ("sft/seed0", "dpo/seed0", "grpo/seed0")] == [
        "250",
        "1",
        "1",
    ]
    assert last(dpo, "--save-total-limit") == "0" and compare.curve_flags(341, 3)[1] == "85"
    none = compare.plan(dataclasses.replace(args, curve_points=0), str(tmp_path))[0]
    assert not any("--save-every" in s["flags"] for s in none)
    toy = compare.plan(dataclasses.replace(args, task="toy"), str(tmp_path))[0]
    assert not any("--dataset" in s["flags"] for s in toy)  # the scripts' defaults: data/*.jsonl
    other = compare.plan(dataclasses.replace(args, model="gemma_2b"), str(tmp_path))[0]
    assert not any("--dataset" in s["flags"] for s in other)  # never the bundled data for a real model
    assert compare.task_prompts(args)[1] == os.path.join(data, "prompts_test.jsonl")
    assert compare.task_prompts(dataclasses.replace(args, task="toy"))[1] == os.path.join(
        ROOT, "data", "prompts_test.jsonl"
    )
    # every value of the recipe has a source
    assert all(flags and source for groups in compare.RECIPE.values() for flags, source in groups)


def test_compare_never_mixes_tasks(tmp_path):
    """The issue's command, your sft and dpo data through --sft-args / --dpo-args: it stops before any run (nothing
    written), one line naming each flag to pass: your test prompts, eval prompts and checker, your eval sets beside
    your data (else the task's held-out sets would score models trained on yours), your grpo prompts. Given them,
    every run reads yours; a real model without data is stopped the same way; the task's own data needs nothing."""
    import plumbing

    mine = ["--model", "tiny", "--methods", "sft,dpo,grpo", "--output-dir", str(tmp_path / "cmp")]
    argv = mine + ["--sft-args=--dataset my_sft.jsonl", "--dpo-args=--dataset my_prefs.jsonl"]
    with pytest.raises(plumbing.UsageError) as e:
        compare.main(plumbing.cli(compare.Args, argv))
    task = os.path.join("data", "compare")
    assert str(e.value) == (
        "sft trains on your --dataset, so every run trains and is scored on your data: "
        "pass --test-prompts FILE (your held-out prompts, scored by --reward-fn); "
        "pass --eval-prompts FILE (where --sweep chooses and the curves are scored); "
        "pass --reward-fn path.py:function (your task's score; the default scores the bundled task); "
        "--sft-args: add --eval-dataset FILE or --eval-split SPLIT (--eval-dataset '' for none), else sft is "
        f"evaluated on the task's {os.path.relpath(os.path.join(ROOT, task, 'sft_eval.jsonl'))}; "
        "--dpo-args: add --eval-dataset FILE or --eval-split SPLIT (--eval-dataset '' for none), else dpo is "
        f"evaluated on the task's {os.path.relpath(os.path.join(ROOT, task, 'prefs_eval.jsonl'))}; "
        '--grpo-args="--dataset PROMPTS" (your prompts)'
    )
    assert not (tmp_path / "cmp").exists()
    fixed = mine + [
        "--sft-args=--dataset my_sft.jsonl --eval-dataset my_sft_eval.jsonl",
        "--dpo-args=--dataset my_prefs.jsonl --eval-split test",
        "--grpo-args=--dataset my_prompts.jsonl",
        "--test-prompts",
        "my_test.jsonl",
        "--eval-prompts",
        "my_eval.jsonl",
        "--reward-fn",
        "my_checker.py:score",
    ]
    args = plumbing.cli(compare.Args, fixed)
    stages = compare.plan(args, str(tmp_path))[0]
    compare.check_data(args, stages)
    for s, (data, held_out) in zip(
        stages, [("my_sft", "my_sft_eval.jsonl"), ("my_prefs", None), ("my_prompts", None)]
    ):
        assert last(s["flags"], "--dataset") == data + ".jsonl" and s["flags"][-len(s["own"]) :] == s["own"]
        assert held_out is None or last(s["flags"], "--eval-dataset") == held_out
    with pytest.raises(plumbing.UsageError, match="--eval-prompts FILE \\(where --sweep chooses"):
        compare.check_data(dataclasses.replace(args, eval_prompts=None), stages)
    real = dataclasses.replace(args, model="gemma_2b", sft_args="", dpo_args="", grpo_args="")
    with pytest.raises(plumbing.UsageError) as e:
        compare.check_data(real, compare.plan(real, str(tmp_path))[0])
    assert str(e.value) == (
        "--model gemma_2b is not `tiny` (--dataset PAIRS derives each run's data), so every run trains and is "
        'scored on your data: --sft-args="--dataset DEMOS" (your demonstrations); --dpo-args="--dataset PAIRS" '
        '(your preference pairs); --grpo-args="--dataset PROMPTS" (your prompts)'
    )
    task_args = compare.Args(methods="sft,sft+,dpo,kto,ppo,grpo,rloo,sft-chosen,rft", seeds=1)
    compare.check_data(task_args, compare.plan(task_args, str(tmp_path))[0])  # the task's data: nothing asked


def arithmetic_task(folder, n=40):
    """A task of the user's, unlike the bundled one: sums (`What is 17 + 25?`, an `answer` column), n preference
    pairs (the sum chosen, one more rejected), 16 held-out prompts a split and a checker of the `answer` column
    (TRL passes a row's columns to reward functions) -> {name: path}."""
    rng = np.random.default_rng(0)
    sums = [(int(a), int(b)) for a, b in rng.integers(10, 50, (n + 32, 2))]
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in sums]
    pairs = [dict(r, chosen=f" {r['answer']}", rejected=f" {int(r['answer']) + 1}") for r in rows[:n]]
    paths = {name: folder / f"{name}.jsonl" for name in ("pairs", "eval", "test")}
    for name, data in (("pairs", pairs), ("eval", rows[n : n + 16]), ("test", rows[n + 16 :])):
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in data))
    paths["checker"] = folder / "checker.py"
    paths["checker"].write_text(
        "def score(prompts, completions, answer, **kwargs):\n"
        "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"
    )
    return {name: str(path) for name, path in paths.items()}


def test_compare_on_your_own_pairs(tmp_path):
    """--dataset PAIRS: `--quick` given only the pairs, the held-out prompts and a checker runs sft, dpo and
    sft-chosen on them: each run's data derived once into <output-dir>/data/ (the chosen answers as prompt +
    completion; the prompts with their other columns, for the RL rows), each run's args.json naming its file
    (the pairs themselves for dpo) and no held-out set of its own; said before any run, the epochs each run's
    steps make over its rows (sft: 20 × 32 over 40 = 16, past 10: a warning naming --sft-steps; dpo: 4 × 32 over
    40 = 3.2, none); the report, scored on the user's test prompts by the user's checker."""
    task = arithmetic_task(tmp_path)
    out = tmp_path / "cmp"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "compare.py"),
            "--quick",
            "--model",
            "tiny",
            "--dataset",
            task["pairs"],
            "--test-prompts",
            task["test"],
            "--eval-prompts",
            task["eval"],
            "--reward-fn",
            task["checker"] + ":score",
            "--methods",
            "sft,dpo,sft-chosen",
            "--sft-steps",
            "20",
            "--steps",
            "4",
            "--num-prompts",
            "8",
            "--output-dir",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        env=learning_env(),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    read = lambda path: [json.loads(line) for line in open(path)]
    pairs, chosen = read(task["pairs"]), out / "data" / "chosen.jsonl"
    assert read(chosen) == [{"prompt": p["prompt"], "completion": p["chosen"]} for p in pairs]
    assert read(out / "data" / "prompts.jsonl") == [
        {"prompt": p["prompt"], "answer": p["answer"]} for p in pairs
    ]
    for run, data in (("sft", chosen), ("dpo", task["pairs"]), ("sft-chosen@dpo", chosen)):
        run_args = json.loads((out / run / "seed0" / "args.json").read_text())
        assert run_args["dataset"] == str(data) and run_args["eval_dataset"] == "", run
    lines = proc.stdout.splitlines()
    said = [
        f"sft: 20 steps × 32 rows = 640 rows over the 40 of {chosen}: 16 epochs",
        "warning: sft: 16 epochs over 40 rows, which it may memorise: lower --sft-steps or give more rows",
        f"dpo: 4 steps × 32 rows = 128 rows over the 40 of {task['pairs']}: 3.2 epochs",
    ]
    assert [line for line in lines if " epochs" in line] == said, proc.stdout[:3000]
    assert lines.index(said[-1]) < next(i for i, line in enumerate(lines) if line.startswith("[1/"))
    md = (out / "comparison.md").read_text()
    assert [r.split("**")[1] for r in md.splitlines() if r.startswith("| **")] == [
        "sft",
        "dpo",
        "sft-chosen@dpo",
    ]
    result = json.loads((out / "dpo" / "seed0" / "eval_test" / "eval.json").read_text())
    assert result["prompts"] == task["test"] and result["num_prompts"] == 8


def test_own_pairs_ask_for_what_they_cannot_give(tmp_path):
    """--dataset PAIRS with an implicit prompt (no `prompt` field), grpo asked for too, and no held-out prompts
    or checker: one line naming each, the RL row's prompts as --grpo-args="--dataset PROMPTS", before anything
    is written. With a `prompt` field and the three given, every run has its data: the chosen answers (a chat's
    rendered as the pairs are), the pairs, the prompts with their columns (a chat's as given), `--eval-dataset
    ''` beside all but the RL rows' (which take none), and a run's own --dataset still wins."""
    implicit = tmp_path / "implicit.jsonl"
    implicit.write_text(
        "".join(
            json.dumps({"chosen": f"{a} + 1 = {a + 1}", "rejected": f"{a} + 1 = {a}"}) + "\n"
            for a in range(40)
        )
    )
    args = compare.Args(
        dataset=str(implicit), methods="sft,dpo,grpo,sft-chosen", output_dir=str(tmp_path / "cmp")
    )
    with pytest.raises(common.UsageError) as e:
        compare.main(args)
    assert str(e.value) == (
        "sft trains on your --dataset, so every run trains and is scored on your data: "
        "pass --test-prompts FILE (your held-out prompts, scored by --reward-fn); "
        "pass --eval-prompts FILE (where --sweep chooses and the curves are scored); "
        "pass --reward-fn path.py:function (your task's score; the default scores the bundled task); "
        f'--grpo-args="--dataset PROMPTS" (your prompts): {implicit}\'s pairs have no `prompt` field'
    )
    assert not (tmp_path / "cmp").exists()

    task = arithmetic_task(tmp_path)
    chat = tmp_path / "chat.jsonl"  # TRL's conversational form
    chat.write_text(
        json.dumps(
            {
                "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
                "chosen": [{"role": "assistant", "content": "5"}],
                "rejected": [{"role": "assistant", "content": "6"}],
                "answer": "5",
            }
        )
        + "\n"
    )
    for pairs in (task["pairs"], str(chat)):
        args = compare.Args(
            dataset=pairs,
            methods="sft,dpo,kto,grpo,sft-chosen,rft",
            seeds=1,
            test_prompts=task["test"],
            eval_prompts=task["eval"],
            reward_fn=task["checker"] + ":score",
            rloo_args="--beta 0",
            grpo_args="--dataset mine.jsonl",
        )
        mine, files = compare.derive(args, str(tmp_path / "cmp"))
        stages = {s["name"]: s for s in compare.plan(mine, str(tmp_path / "cmp"))[0]}
        compare.check_data(mine, list(stages.values()))
        chosen, prompts = (str(tmp_path / "cmp" / "data" / f) for f in ("chosen.jsonl", "prompts.jsonl"))
        assert list(files) == [chosen, prompts] and mine.rloo_args.endswith(" --beta 0")
        data = {
            "sft/seed0": chosen,
            "dpo/seed0": pairs,
            "kto/seed0": pairs,
            "grpo/seed0": "mine.jsonl",
            "sft-chosen@dpo/seed0": chosen,
            "rft@grpo/seed0": prompts,
        }
        for name, path in data.items():
            flags = stages[name]["flags"]
            assert last(flags, "--dataset") == path, name
            assert ("--eval-dataset" in flags) == ("grpo" not in name) and "data/compare" not in " ".join(
                flags
            )
            assert "--eval-dataset" not in flags or last(flags, "--eval-dataset") == "", name
    template = common.chat_template("tiny")
    assert files[chosen] == [
        {
            "prompt": common.render([{"role": "user", "content": "What is 2 + 3?"}], template)
            + template.model,
            "completion": "5" + template.end.rstrip("\n"),
        }
    ]
    assert files[prompts] == [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}]


def test_quick_fills_in_what_was_not_given():
    """--quick: QUICK's methods, budgets and one seed, unless a flag given says otherwise, even with the value
    that is the default (--seeds 3); a command line without --quick is left alone."""
    import plumbing

    args = plumbing.cli(compare.Args, compare.quick_argv(["--quick", "--steps", "20", "--seeds", "3"]))
    assert (args.methods, args.seeds, args.sft_steps, args.steps, args.curve_points, args.quick) == (
        "sft,dpo,grpo,sft-chosen,rft",
        3,
        150,
        20,
        0,
        True,
    )
    assert compare.quick_argv(["--seeds", "2"]) == ["--seeds", "2"]


def test_sft_plus_matches_preference_tokens():
    """A step of sft+ (64 demonstrations) and of dpo (32 pairs: prompt twice, chosen, rejected) train about the
    same number of tokens on data/compare/ (tiny tokenizer, BOS + EOS each sequence)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=common.TINY_TOKENIZER)
    n = lambda text: len(sp.encode(text))
    read = lambda name: [json.loads(line) for line in open(os.path.join(ROOT, "data", "compare", name))]
    demo = np.mean([n(r["prompt"]) + n(r["completion"]) + 2 for r in read("sft_train.jsonl")])
    pair = np.mean(
        [2 * n(r["prompt"]) + n(r["chosen"]) + n(r["rejected"]) + 4 for r in read("prefs_train.jsonl")]
    )
    assert abs(64 * demo / (32 * pair) - 1) < 0.05, (demo, pair)


def test_controls_match_their_rows_flops(tmp_path, monkeypatch):
    """A control's updates = its row's logged FLOPs (PPO's with its reward model) / one update's of a finished
    run of its kind: (2.5e9 + 0.5e9) / (1e9 / 10) = 30. A stand-in for the script logs 1e8 FLOPs an update, then
    1.5e8 (the estimate 50% off): the first run misses by more than MATCH and runs again at its own FLOPs a
    step, 3e9 / 1.5e8 = 20 updates, once; a run that matches is not repeated."""

    def run(name, flops, steps=None):
        d = tmp_path / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i, "charts/flops": f}) + "\n" for i, f in enumerate(flops))
        )
        (d / "args.json").write_text(json.dumps({"max_steps": steps or len(flops)}))

    run("sft-chosen@dpo/seed0", [4e8, 6e8], steps=10)
    run("ppo/seed0", [1e9, 1.5e9])
    run("reward/seed0", [0.5e9])
    ppo = {"name": "ppo/seed0", "needs": ["sft/seed0", "reward/seed0"], "recipe": "ppo", "script": "ppo.py"}
    ctl = {"recipe": "sft-chosen", "script": "sft.py", "needs": [], "flags": ["--batch-size", "64"]}
    done = [dict(ctl, name="sft-chosen@dpo/seed0"), dict(ppo, flags=["--batch-size", "32"])]
    stage = dict(ctl, name="sft-chosen@ppo/seed0", match=["ppo/seed0"])
    assert compare.target_flops(str(tmp_path), stage, done, {}) == 3e9
    assert compare.flops_per_step(str(tmp_path / "sft-chosen@dpo/seed0")) == 1e8
    assert compare.matched_steps(3e9, 1e8) == 30 and compare.matched_steps(1.0, 1e8) == 1
    with pytest.raises(compare.RunsFailed, match="sft-chosen@ppo/seed0"):
        compare.target_flops(str(tmp_path), stage, done[:1], {})
    ran = []

    def fake(i, n, stage, output_dir):  # the script: 1.5e8 FLOPs an update
        steps = int(last(stage["flags"], "--max-steps"))
        ran.append(steps)
        run(stage["name"], [1.5e8] * steps)
        return True, 1.0

    monkeypatch.setattr(compare, "run_stage", fake)
    flags = ["--model", "base", "--batch-size", "64", "--seed", "0"]
    ok = compare.run_control(
        1, 1, dict(stage, flags=flags), str(tmp_path), done=done, walls={}, curve_points=0
    )
    assert ok == (True, 1.0) and ran == [30, 20]  # 4.5e9 is 50% over 3e9: once more, at 1.5e8 an update
    assert compare.run_cost(str(tmp_path / "sft-chosen@ppo/seed0"))[2] == 3e9
    ran.clear()
    done.append(dict(ctl, name="sft-chosen@ppo/seed0"))
    stage2 = dict(stage, name="sft-chosen@ppo/seed1", flags=flags)
    assert compare.run_control(1, 1, stage2, str(tmp_path), done=done, walls={}, curve_points=0)[0]
    assert ran == [20]  # its kind's last run's FLOPs a step: matched at once


def test_distill_counts_its_teachers_training(tmp_path):
    """distill's cost: its own logged FLOPs (2e9) and wall (10 s) plus, when its teacher is a run's model/, that
    run's logged FLOPs (3e9 + 3e9) and training seconds (tokens / tokens per second: 100/50 + 300/100 = 5 s);
    tokens trained add up too, tokens generated are the student's."""
    teacher = tmp_path / "grpo/seed0"
    (teacher / "model").mkdir(parents=True)
    rows = [
        {"step": 1, "charts/tokens": 100.0, "charts/tokens_per_sec": 50.0, "charts/flops": 3e9},
        {"step": 2, "charts/tokens": 300.0, "charts/tokens_per_sec": 100.0, "charts/flops": 3e9},
    ]
    (teacher / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    student = tmp_path / "distill/seed0"
    student.mkdir(parents=True)
    (student / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "charts/tokens": 40.0, "charts/generated_tokens": 7.0, "charts/flops": 2e9})
        + "\n"
    )
    stage = {"name": "distill/seed0", "needs": [], "flags": ["--teacher-model", str(teacher / "model")]}
    walls = {"distill/seed0": 10.0}
    assert compare.stage_cost(str(tmp_path), stage, walls) == [440.0, 7.0, 8e9, 15.0]
    assert compare.stage_cost(str(tmp_path), dict(stage, flags=[]), walls) == [40.0, 7.0, 2e9, 10.0]


def test_jobs_run_independent_runs_together(tmp_path, monkeypatch):
    """--jobs 2 (the scripts replaced): dpo and grpo run at once (dpo's run waits until grpo's has started), each
    control only after its row finished, a base before its rows; a failed row's control is skipped; under
    --keep-finished a run whose model/ exists is kept with the seconds walls.json recorded, not run again."""
    import threading

    args = compare.Args(methods="sft,dpo,grpo,sft-chosen,rft", seeds=1, jobs=2, curve_points=0)
    stages = compare.plan(args, str(tmp_path))[0]
    grpo_started = threading.Event()
    events = []

    def fake(i, n, stage, output_dir):
        name = stage["name"]
        events.append(("start", name))
        if name == "grpo/seed0":
            grpo_started.set()
        if name == "dpo/seed0":
            assert grpo_started.wait(timeout=60), "grpo never ran beside dpo"
        d = tmp_path / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "charts/flops": 1e9}) + "\n")
        (d / "args.json").write_text(json.dumps({"max_steps": 1}))
        events.append(("end", name))
        return name != "grpo/seed0", 2.0  # grpo fails

    monkeypatch.setattr(compare, "run_stage", fake)
    ok, walls = compare.run_stages(args, stages, str(tmp_path))
    assert ok == {
        "sft/seed0": True,
        "dpo/seed0": True,
        "grpo/seed0": False,
        "sft-chosen@dpo/seed0": True,
        "rft@grpo/seed0": False,
    }
    at = {e: events.index(e) for e in events}
    assert at["end", "sft/seed0"] < at["start", "dpo/seed0"] and ("start", "rft@grpo/seed0") not in at
    assert at["end", "dpo/seed0"] < at["start", "sft-chosen@dpo/seed0"] and walls["rft@grpo/seed0"] == 0.0
    (tmp_path / "sft/seed0/model").mkdir()
    events.clear()
    keep = dataclasses.replace(args, methods="sft", keep_finished=True)
    assert compare.run_stages(keep, compare.plan(keep, str(tmp_path))[0], str(tmp_path)) == (
        {"sft/seed0": True},
        {"sft/seed0": 2.0},
    )
    assert events == []


def test_delta_against_control_worked_example(tmp_path, monkeypatch):
    """The report from synthetic per-prompt scores (3 seeds × 4 prompts, the evaluation replaced): dpo − sft
    = 0.25 everywhere (± 0); dpo − sft-chosen@dpo = [0, .5, 0, 1] on every seed -> mean 0.375; identical seeds
    leave the prompts' spread: var = s²/P with s² = (.375² + .125² + .375² + .625²)/3, df 3 -> ± t_.975(3)·√(s²/4).
    grpo is read against rft@grpo, the controls against sft only. The score-against-FLOPs curve of a grpo seed
    (eval split): its base's point (logged 5e9 FLOPs, score 0.625), a checkpoint at step 1 (5e9 + grpo's 2e9 so
    far, the checkpoint's 0.9), the end (8e9, 1.0). The summary, one Holm correction over the report's 14
    claims (each of 4 rows against sft, beats and falls below: 8; dpo and grpo against their controls, both
    ways: 4; the matrix's 2 ordered pairs), one-sided p: dpo − sft and grpo − rft 0 (no spread); the smallest
    after them, rft@grpo below sft (−[.75, .75, .25, .75] on every seed: t = .625 / .125 = 5 on 3 df, p =
    0.0077 > 0.025 / 12), stops it; grpo − sft [.25, .25, .75, .25]: t = 3, p = 0.029; dpo − sft-chosen 0.11:
    dpo beats sft but not sft-chosen, grpo clears rft, nothing else; the Δ matrix grpo − dpo = [0, 0, .5, 0]:
    +0.125 ± t_.975(3)·√(.0625/4), not bold; the test split read once; at one seed no claim."""
    args = compare.Args(methods="sft,dpo,grpo,sft-chosen,rft", seeds=3, output_dir=str(tmp_path))
    args = dataclasses.replace(
        args, **dict(zip(("eval_prompts", "test_prompts"), compare.task_prompts(args)))
    )
    stages, bases, seeds, grid = compare.plan(args, str(tmp_path))
    scores = {
        "sft": [0.75, 0.75, 0.25, 0.75],
        "sft-chosen@dpo": [1.0, 0.5, 0.5, 0.0],
        "dpo": [1.0, 1.0, 0.5, 1.0],
        "rft@grpo": [0.0, 0.0, 0.0, 0.0],
        "grpo": [1.0, 1.0, 1.0, 1.0],
    }
    arrays = lambda row: {k: np.array(scores[row]) for k in ("score", "score_sampled")} | {"kl": np.zeros(4)}
    read = []  # the prompt files evaluated, in order

    def evaluate_models(a, prompts, b, jobs, d):
        read.append(prompts)
        return {k: arrays(k.split("/")[0]) for k, *_ in jobs}

    monkeypatch.setattr(compare, "evaluate_models", evaluate_models)
    monkeypatch.setattr(
        compare, "checkpoint_scores", lambda a, b, dirs: {d: [(1, 0.9)] for d in dirs if "grpo/" in d}
    )
    for seed in seeds:
        (tmp_path / f"sft/seed{seed}").mkdir(parents=True)
        (tmp_path / f"sft/seed{seed}/metrics.jsonl").write_text(
            json.dumps({"step": 5, "train/loss": 1.0, "charts/flops": 5e9})
        )
        (tmp_path / f"grpo/seed{seed}").mkdir(parents=True)
        (tmp_path / f"grpo/seed{seed}/metrics.jsonl").write_text(
            "".join(
                json.dumps({"step": i, "reward": 0.5 + 0.1 * i + 0.01 * seed, "charts/flops": 1e9}) + "\n"
                for i in range(3)
            )
        )
    ok = {s["name"]: True for s in stages}
    md = compare.evaluate_and_report(
        args, str(tmp_path), stages, bases=bases, seeds=seeds, grid=grid, ok=ok, walls={}, t_start=0.0
    )
    assert read == [args.eval_prompts, args.test_prompts]  # every run on eval; test once, at the end
    cells = {
        r.split("**")[1]: [c.strip() for c in r.split("|")[2:-1]]
        for r in md.splitlines()
        if r.startswith("| **")
    }
    s2 = (0.375**2 + 0.125**2 + 0.375**2 + 0.625**2) / 3
    h = compare.t_quantile(0.975, 3) * np.sqrt(s2 / 4)
    assert abs(h - 3.182446 * np.sqrt(s2 / 4)) < 1e-5
    assert cells["dpo"][2] == f"0.375 ± {h:.3f} (sft-chosen@dpo)" and cells["dpo"][1] == "0.250 ± 0.000"
    assert (
        cells["grpo"][2] == "1.000 ± 0.000 (rft@grpo)"
        and cells["sft-chosen@dpo"][2] == cells["sft"][2] == "–"
    )
    assert list(cells) == ["sft", "dpo", "sft-chosen@dpo", "grpo", "rft@grpo"]  # each row, then its control
    assert (
        cells["dpo"][-1]
        == f"beats sft (Δ +0.250 ± 0.000); within noise of sft-chosen@dpo (Δ +0.375 ± {h:.3f} covers 0)"
    )
    assert abs(compare.p_above_zero(np.tile([0.25, 0.25, 0.75, 0.25], (3, 1))) - 0.02883) < 1e-4
    assert md.splitlines()[1:5] == [
        "- **Against the control matched in information** (a preference row must clear sft-chosen, a checker "
        f"row rft): cleared by grpo; dpo − sft-chosen@dpo +0.375 ± {h:.3f}",
        "- **dpo** beats sft (Δ +0.250 ± 0.000), at – FLOPs, 0 s a run",
        "- **grpo** beats rft@grpo (Δ +1.000 ± 0.000), at 3.00e09 FLOPs, 0 s a run",
        "- no claim holds for sft-chosen@dpo, rft@grpo",
    ]
    assert "Holm's correction over the report's 14 claims" in md.splitlines()[0]
    p_below = compare.p_above_zero(np.tile([0.75, 0.75, 0.25, 0.75], (3, 1)))  # rft@grpo below sft
    assert 0.025 / 12 < p_below < 0.0078 and abs(compare.t_quantile(1 - p_below, 3) - 5.0) < 1e-6
    report = (tmp_path / "comparison.md").read_text()
    hm = compare.t_quantile(0.975, 3) * np.sqrt(0.0625 / 4)  # grpo − dpo: s² of [0, 0, .5, 0] = .0625
    assert (
        f"| **grpo** | +0.125 ± {hm:.3f} | – |" in report and f"| **dpo** | – | -0.125 ± {hm:.3f} |" in report
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert (
        results["matrix"]["grpo − dpo"][:2] == pytest.approx([0.125, hm])
        and not results["matrix"]["grpo − dpo"][3]
    )
    assert results["rows"]["dpo"]["stats"]["versus"]["sft-chosen@dpo"]["delta"] == pytest.approx([0.375, h])
    assert all(
        f and src
        for f, src in ((g["flags"], g["source"]) for gs in results["recipe"]["flags"].values() for g in gs)
    )
    npz = np.load(tmp_path / "scores.npz")
    np.testing.assert_array_equal(npz["dpo/seed1|score"], scores["dpo"])  # each cell recomputable
    one = compare.evaluate_and_report(
        dataclasses.replace(args, seeds=1),
        str(tmp_path),
        [s for s in stages if s["seed"] == 0],
        bases=bases,
        seeds=[0],
        grid=grid,
        ok=ok,
        walls={},
        t_start=0.0,
    )
    assert one.startswith("**Summary: 1 seed(s), needs ≥ 3 seeds.** The intervals are over prompts only")
    assert "beats" not in one.split("\n\n")[0] and "grpo +0.375 ± 0.398" in one  # ranked by Δ vs sft
    assert "needs ≥ 3 seeds vs sft (Δ +0.250 ± 0.000); needs ≥ 3 seeds vs sft-chosen@dpo (Δ +0.375" in one
    assert "beats" not in one and "within noise" not in one
    assert (tmp_path / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves = json.loads((tmp_path / "results.json").read_text())["curves_eval"]
    np.testing.assert_allclose(curves["grpo"], [[[5e9, 0.625], [7e9, 0.9], [8e9, 1.0]]])
    np.testing.assert_allclose(curves["sft"], [[[5e9, 0.625]]])  # seed 0's base, no checkpoint: its end
    assert "dpo" not in curves  # its FLOPs were never logged: no curve


def test_holm_by_hand_and_p_values_agree_with_the_intervals():
    """Holm at 5% over p = (.01, .04, .03, .005): sorted .005 <= .05/4 and .01 <= .05/3 hold, .03 > .05/2 stops
    the rest. A lone claim holds at 2.5% one-sided exactly when its 95% interval lies above 0."""
    assert compare.holm([0.01, 0.04, 0.03, 0.005], 0.05) == [True, False, False, True]
    assert compare.holm([0.02], 0.025) == [True] and compare.holm([], 0.025) == []
    rng = np.random.default_rng(1)
    for delta in (-0.05, 0.0, 0.02, 0.03, 0.05, 0.1):
        diff = synthetic(rng, delta, prompts=100)[0]["score"] - 0.5
        d, h = compare.mean_interval(diff)
        assert (d - h > 0) == (compare.p_above_zero(diff) <= 0.025), delta
    assert compare.verdict((0.1, 0.01), "sft") == "beats sft (Δ +0.100 ± 0.010)"
    assert compare.verdict((0.1, 0.01), "sft", seeds=1) == "needs ≥ 3 seeds vs sft (Δ +0.100 ± 0.010)"


def test_seed_band_aligns_the_ends():
    """Seeds with 4 and 3 points (one checkpoint more): the first 2 points and each end, averaged."""
    runs = [np.array([[0, 0.5], [1, 0.6], [2, 0.7], [3, 0.8]]), np.array([[0, 0.5], [1, 0.4], [2.5, 0.9]])]
    x, mean, low, high = compare.seed_band(runs)
    for got, expected in zip(
        (x, mean, low, high), ([0, 1, 2.75], [0.5, 0.5, 0.85], [0.5, 0.4, 0.8], [0.5, 0.6, 0.9])
    ):
        np.testing.assert_allclose(got, expected)


def test_test_split_is_disjoint():
    read = lambda name: [json.loads(line)["prompt"] for line in open(os.path.join(ROOT, "data", name))]
    test, held, train = read("prompts_test.jsonl"), read("prompts_eval.jsonl"), read("prompts_train.jsonl")
    assert len(test) == len(set(test)) == 500 and len(held) == 200
    assert not set(test) & (set(held) | set(train)) and not set(held) & set(train)


def test_compare_task_data(tmp_path, monkeypatch):
    """data/compare/: the annotator's habit (a repeated digit written once) in the stated share of the lists
    that have one, and no other mistake in the demonstrations; every preference pair ranked by the checker;
    disjoint splits; the generator rewrites the files byte for byte."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "data"))
    import generate
    import toy

    read = lambda name: [json.loads(line) for line in open(os.path.join(ROOT, "data", "compare", name))]
    demos = read("sft_train.jsonl")
    right = [toy.answer(d["prompt"]).split() for d in demos]
    repeated = [(r, d["completion"].split()) for r, d in zip(right, demos) if len(set(r)) < len(r)]
    wrong = [(r, w) for r, w in repeated if w != r]
    n, habit = len(repeated), generate.HABIT
    assert len(demos) == 4000 and abs(len(wrong) / n - habit) < 3 * np.sqrt(habit * (1 - habit) / n)  # 3σ
    assert all(
        toy.answer(d["prompt"]).split() == d["completion"].split()
        for d in demos
        if len(set(toy.parse_digits(d["prompt"]))) == len(toy.parse_digits(d["prompt"]))
    )
    # each wrong one: a repeated digit written once, i.e. the sorted list with one copy of it removed
    drop = lambda r, w: any(r[:i] + r[i + 1 :] == w for i in range(len(r)) if r[i] in r[:i] + r[i + 1 :])
    assert all(drop(r, w) for r, w in wrong) and not drop(["1", "2", "3"], ["1", "3"])
    assert 0.25 < len(wrong) / len(demos) < 0.35  # the share docs/compare.md states: about 30%
    assert all(toy.score(d["prompt"], d["completion"]) == 1.0 for d in read("sft_eval.jsonl"))
    for split in ("train", "eval"):
        pairs = read(f"prefs_{split}.jsonl")
        assert all(toy.score(p["prompt"], p["chosen"]) > toy.score(p["prompt"], p["rejected"]) for p in pairs)
        kto = read(f"kto_{split}.jsonl")
        assert [k["completion"] for k in kto] == [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    lengths = {len(toy.parse_digits(p["prompt"])) for p in read("prompts_test.jsonl")}
    assert lengths == set(range(generate.COMPARE_LEN[0], generate.COMPARE_LEN[1] + 1))
    prompts = {s: [p["prompt"] for p in read(f"prompts_{s}.jsonl")] for s in ("train", "eval", "test")}
    assert len(set(prompts["test"])) == 500 and len(set(prompts["eval"])) == 200
    assert not set(prompts["test"]) & (set(prompts["eval"]) | set(prompts["train"]))
    assert not set(prompts["eval"]) & set(prompts["train"])
    assert [d["prompt"] for d in demos] == prompts["train"]
    monkeypatch.setattr(generate, "HERE", str(tmp_path))
    generate.compare_task()
    for name in os.listdir(os.path.join(ROOT, "data", "compare")):
        assert (tmp_path / "compare" / name).read_bytes() == open(
            os.path.join(ROOT, "data", "compare", name), "rb"
        ).read(), name


# ---------------------------------------------------------------------------
# compare.py: plan and end to end
# ---------------------------------------------------------------------------
def test_compare_plan_reward_model_for_ppo(tmp_path):
    args = compare.Args(
        methods="sft,dpo,ppo",
        dpo_args="--beta 0.2 --learning-rate 1e-5",
        steps=7,
        seeds=1,
        output_dir=str(tmp_path),
    )
    stages, bases, _, _ = compare.plan(args, str(tmp_path))
    names = [s["name"] for s in stages]
    assert names == ["sft/seed0", "reward/seed0", "dpo/seed0", "ppo/seed0", "ppo_fn/seed0"]
    base = bases[0]
    assert base == str(tmp_path / "sft" / "seed0" / "model")
    dpo, ppo, ppo_fn = stages[2]["flags"], stages[3]["flags"], stages[4]["flags"]
    assert dpo[dpo.index("--model") + 1] == base and dpo[dpo.index("--max-steps") + 1] == "7"
    assert dpo[-4:] == ["--beta", "0.2", "--learning-rate", "1e-5"]  # pass-through comes last: it overrides
    assert [line for line in compare.before_running(stages) if "replaces" in line] == [  # and main says what
        "--dpo-args: --beta 0.2 replaces the recipe's '0.1'",  # it replaced, by hand from the recipe
        "--dpo-args: --learning-rate 1e-5 replaces the recipe's '5e-05'",
    ]
    assert ppo[ppo.index("--reward-model") + 1] == str(tmp_path / "reward" / "seed0" / "model")
    # compare's rate, not ppo.py's real-model default (3e-6): the RL rows are not controls
    assert last(ppo, "--learning-rate") == last(ppo_fn, "--learning-rate") == str(args.learning_rate)
    assert stages[3]["needs"] == ["sft/seed0", "reward/seed0"] and stages[4]["needs"] == ["sft/seed0"]
    assert ppo_fn[ppo_fn.index("--reward-fn") + 1] == args.reward_fn and "--reward-model" not in ppo_fn
    only_fn = compare.plan(compare.Args(methods="ppo", ppo_reward="fn", seeds=1), str(tmp_path))[0]
    assert [s["name"] for s in only_fn] == ["ppo/seed0"] and "--model" in only_fn[0]["flags"]
    assert only_fn[0]["flags"][only_fn[0]["flags"].index("--model") + 1] == "tiny"  # no sft: from --model
    grpo = compare.plan(
        compare.Args(methods="sft,grpo", grpo_steps=5, grpo_args="--beta 0", seeds=1), str(tmp_path)
    )[0][1]
    assert grpo["name"] == "grpo/seed0" and grpo["needs"] == ["sft/seed0"]
    assert grpo["flags"][grpo["flags"].index("--max-steps") + 1] == "5" and grpo["flags"][-2:] == [
        "--beta",
        "0",
    ]
    assert grpo["flags"][grpo["flags"].index("--reward-fn") + 1] == compare.Args().reward_fn
    rloo = compare.plan(
        compare.Args(methods="sft,rloo", rloo_steps=6, rloo_args="--beta 0", seeds=1), str(tmp_path)
    )[0][1]
    assert (
        rloo["name"] == "rloo/seed0" and rloo["needs"] == ["sft/seed0"] and rloo["script"].endswith("rloo.py")
    )
    assert rloo["flags"][rloo["flags"].index("--max-steps") + 1] == "6" and rloo["flags"][-2:] == [
        "--beta",
        "0",
    ]
    assert rloo["flags"][rloo["flags"].index("--reward-fn") + 1] == compare.Args().reward_fn


def test_plan_distill_row_needs_a_teacher(tmp_path):
    """distill: from the base, --steps updates on the task's prompts, graded by --teacher-model; read against
    sft+ at its FLOPs; without a teacher the plan refuses before anything runs."""
    args = compare.Args(
        methods="sft,sft+,distill",
        steps=7,
        seeds=1,
        teacher_model="runs/teacher/model",
        distill_args="--beta 0.5",
    )
    stages = {s["name"]: s for s in compare.plan(args, str(tmp_path))[0]}
    assert list(stages) == ["sft/seed0", "distill/seed0", "sft+@distill/seed0"]
    flags = stages["distill/seed0"]["flags"]
    assert stages["distill/seed0"]["script"].endswith("distill.py") and stages["distill/seed0"]["needs"] == [
        "sft/seed0"
    ]
    assert last(flags, "--teacher-model") == "runs/teacher/model" and last(flags, "--max-steps") == "7"
    assert last(flags, "--model") == str(tmp_path / "sft" / "seed0" / "model") and flags[-2:] == [
        "--beta",
        "0.5",
    ]
    assert last(flags, "--dataset") == os.path.join(ROOT, "data", "compare", "prompts_train.jsonl")
    assert "--eval-dataset" not in flags and last(flags, "--learning-rate") == str(args.learning_rate)
    assert "teacher" in compare.CONTROLS["sft+"] and "distill" not in compare.Args().methods
    with pytest.raises(common.UsageError, match="--teacher-model"):
        compare.plan(dataclasses.replace(args, teacher_model=None), str(tmp_path))


def test_compare_failed_run_ends_in_runs_failed(tmp_path, monkeypatch, capsys):
    """A script that exits non-zero: its log tail is printed, the report still written over the rest,
    then RunsFailed (plumbing.launch: one line on stderr, exit code 1) naming the run."""
    bad = tmp_path / "broken.py"
    bad.write_text("print('broken on purpose')\nraise SystemExit(3)\n")
    reports = []
    monkeypatch.setattr(
        compare, "evaluate_and_report", lambda *a, ok, **kw: reports.append(ok) or "| table |"
    )
    with pytest.raises(compare.RunsFailed, match=r"^1 of 1 runs failed or were skipped \(broken/seed0\)"):
        compare.main(compare.Args(methods="", extra=(str(bad),), seeds=1, output_dir=str(tmp_path / "cmp")))
    out = capsys.readouterr().out
    assert "FAILED (exit 3)" in out and "broken on purpose" in out and "| table |" in out
    assert reports == [{"broken/seed0": False}]  # the report was still made, with the run marked failed
    assert (tmp_path / "cmp" / "broken" / "seed0.log").read_text().strip() == "broken on purpose"


def test_compare_end_to_end_tiny_budget(tmp_path):
    """sft 20 steps for each of 2 seeds, then a forked dpo (--extra) 4 steps with a 2-value --sweep: rows with
    intervals and costs, the setting picked on the eval split and only it scored on the test split, the image,
    the eval curves from one checkpoint a run (--curve-points 1: two saves a run, not four). The runs
    skip their own evaluations and the fork trains on batches of 8, by pass-through flags (they override the
    recipe): 83 -> 62 CPU-s, the comparison's steps unchanged."""
    fork = tmp_path / "mydpo.py"
    fork.write_text(open(os.path.join(ROOT, "dpo.py")).read())
    out = tmp_path / "cmp"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "compare.py"),
            "--model",
            "tiny",
            "--methods",
            "sft",
            "--extra",
            str(fork),
            "--sft-steps",
            "20",
            "--steps",
            "4",
            "--num-prompts",
            "16",
            "--seeds",
            "2",
            "--sweep",
            "mydpo.learning_rate=1e-5,1e-3",
            "--output-dir",
            str(out),
            "--curve-points",
            "1",
            "--sft-args=--eval-dataset ''",
            "--extra-args=--eval-dataset '' --batch-size 8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        env=learning_env(),
    )  # its evaluation samples 16 prompts × 2 seeds × 3 models
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    md = (out / "comparison.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| **")]
    cells = {r.split("**")[1].split(" ")[0]: [c.strip() for c in r.split("|")[2:-1]] for r in rows}
    assert list(cells) == ["sft", "mydpo"]
    assert cells["sft"][1] == "0.000 ± 0.000" and cells["sft"][4:6] == ["0.500 ± 0.000", "0.00 ± 0.00"]
    assert all(" ± " in c for r in cells.values() for c in r[:2] + r[3:7])  # every score cell an interval
    assert cells["mydpo"][2] == cells["sft"][2] == "–"  # no sft+ ran: no control to read against
    # the sweep: every setting's eval-split score in the report, the best mean kept, the test split reported
    load = lambda d: np.load(d / "scores.npz")["score"]
    evals = {
        v: np.mean([load(out / "mydpo" / f"learning_rate_{v}" / f"seed{s}" / "eval_eval") for s in (0, 1)])
        for v in ("1e-5", "1e-3")
    }
    kept = max(evals, key=evals.get)
    assert f"| mydpo | `learning_rate_{kept}` | {evals[kept]:.3f} ± " in md and md.count("**kept**") == 1
    assert rows[1].startswith(f"| **mydpo (`learning_rate_{kept}`)**")
    for s in (0, 1):
        run = out / "mydpo" / f"learning_rate_{kept}" / f"seed{s}"
        run_args = json.loads((run / "args.json").read_text())
        assert run_args["learning_rate"] == float(kept)  # the swept flag reached it
        assert run_args["batch_size"] == 8 and not run_args["eval_dataset"]  # and the pass-through flags
        result = json.loads((run / "eval_test" / "eval.json").read_text())
        assert result["num_prompts"] == 16 and result["prompts"].endswith("prompts_test.jsonl")
        assert result["seed"] == s and np.isclose(load(run / "eval_test").mean(), result["score"])
    assert not json.loads((out / "sft" / "seed0" / "args.json").read_text())[
        "eval_dataset"
    ]  # --sft-args reached sft
    other = "1e-5" if kept == "1e-3" else "1e-3"
    assert not (
        out / "mydpo" / f"learning_rate_{other}" / "seed0" / "eval_test"
    ).exists()  # only the kept one
    # the paired difference: mean over seeds and prompts of (mydpo − sft) on the test split
    runs = [out / "mydpo" / f"learning_rate_{kept}" / f"seed{s}" for s in (0, 1)]
    diff = np.mean(
        [load(r / "eval_test") - load(out / "sft" / f"seed{s}" / "eval_test") for s, r in enumerate(runs)]
    )
    assert cells["mydpo"][1].startswith(f"{diff:+.3f} ± ".lstrip("+"))
    # costs: the runs' own logged counts, mean over seeds
    cost = np.mean([compare.run_cost(str(r)) for r in runs], 0)
    value = lambda c: float(c[:-1]) * 1e6 if c.endswith("M") else float(c)  # the column's unit: maybe sft's
    assert [value(c) for c in cells["mydpo"][7:10]] == pytest.approx(cost, rel=0.01, abs=5e3)
    assert cost[0] > 0 and cost[1] == 0 and ("M" in cells["mydpo"][7]) == ("M" in cells["sft"][7])
    assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| **sft**" in proc.stdout  # the table is printed at the end
    assert re.search(r"^      step \d+/\d+, \d+ s$", proc.stdout, re.M)  # progress inside the runs
    claims = md.split("## Method against method")[0]  # the summary and the table (below: the matrix's legend)
    assert md.count("needs ≥ 3 seeds vs sft") == 1 and "beats" not in claims  # 2 seeds: no claim
    # the curves on the eval split (one point: at half of each run): each seed's sft's checkpoint 10 and its end;
    # each kept run from its seed's sft's end, its checkpoint 2, its end (its eval score), FLOPs rising
    curves = json.loads((out / "results.json").read_text())["curves_eval"]
    assert [len(c) for c in curves["sft"]] == [2, 2] and [len(c) for c in curves["mydpo"]] == [3, 3]
    for s, (run, curve) in enumerate(zip(runs, curves["mydpo"])):
        assert curve[0] == curves["sft"][s][-1] and np.all(np.diff([x for x, _ in curve]) > 0)
        assert curve[-1][1] == pytest.approx(load(run / "eval_eval").mean())
    # a checkpoint's weights are what is scored: sft's, on another base (tiny's random init), score the same
    copy = tmp_path / "sft_copy"
    shutil.copytree(out / "sft" / "seed0", copy)
    (copy / "args.json").write_text(json.dumps({"max_steps": 21}))  # its last checkpoint (20) is scored too
    import orbax.checkpoint as ocp
    from ppo import PPOParams

    with ocp.CheckpointManager(str(copy / "checkpoints")) as manager:
        weights = manager.restore(20, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state[0]
    ppo_like = (
        tmp_path / "ppo_like"
    )  # a ppo run's checkpoint: policy, value model and head; the policy answers
    with ocp.CheckpointManager(str(ppo_like / "checkpoints")) as manager:
        manager.save(
            20,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave((PPOParams(weights, weights, {"bias": np.zeros(())}), {}))
            ),
        )
    (ppo_like / "args.json").write_text(json.dumps({"max_steps": 21}))
    args = compare.Args(num_prompts=16, eval_prompts=compare.task_prompts(compare.Args())[0])
    got = compare.checkpoint_scores(args, "tiny", [str(copy), str(ppo_like)])
    assert [s for s, _ in got[str(copy)]] == [10, 20] and [s for s, _ in got[str(ppo_like)]] == [20]
    np.testing.assert_allclose([v for _, v in got[str(copy)]], [v for _, v in curves["sft"][0]], atol=1e-9)
    assert got[str(ppo_like)][0][1] == pytest.approx(curves["sft"][0][-1][1], abs=1e-9)


def test_evaluate_pads_each_batch_to_its_own_bucket(tmp_path):
    """Short and long prompts in separate batches: each batch generates at its own bucket's width (the short
    one at 32 columns, not the run's 128) and samples exactly what the run-wide width samples, key for key."""
    short = [{"prompt": "Sort: 3 1 2"}] * 8
    long = [{"prompt": "Sort: " + " ".join(str(i % 10) for i in range(60))}] * 8
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in short + long))
    args = evaluate.Args(model="tiny", prompts=str(path), num_prompts=0, max_new_tokens=6, batch_size=8)
    mesh = common.make_mesh(None)
    policy = evaluate.load_policy("tiny", mesh, args)
    prompts, rows, _ = evaluate.check_args(args, mesh)
    data = evaluate.prepare(args, mesh, prompts, rows, policy.model.preprocessor.tokenizer)
    assert data["queries"].shape[1] == 128 and data["query_mask"][:8].sum(1).max() < 32
    key = jax.random.key(3)
    out = evaluate.respond(policy, data, "sampled", key, 8, mesh)
    assert policy.fns["sampled"]._cache_size() == 2  # widths 32 and 128
    on_data = NamedSharding(mesh, P("data"))
    for i in range(2):  # the run-wide width, as before buckets
        rows_i = slice(8 * i, 8 * i + 8)
        wide = policy.fns["sampled"](
            policy.params,
            policy.frozen,
            jax.device_put(data["queries"][rows_i], on_data),
            jax.device_put(data["query_mask"][rows_i], on_data),
            jax.random.fold_in(key, i),
        )[0]
        wide, _ = evaluate.truncate_response(wide, data["stops"], data["pad"])
        np.testing.assert_array_equal(out["responses"][rows_i], np.asarray(wide))
