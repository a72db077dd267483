"""grpo.py beyond its loss and advantages (those are in test_losses.py): inconsistent flags refused,
the CLI end to end (several weighted reward functions, a reward model, preemption + resume, two
processes, bad input), and learning on the toy task."""

import os
import subprocess
import sys

import numpy as np
import pytest

import common  # noqa: F401  (first: KERAS_BACKEND=jax)

from grpo import Args, check_args
from helpers import (
    ROOT,
    assert_same_rows,
    env_with_devices,
    learning_env,
    metrics,
    one_device_env,
    preempt_then_resume,
    run_script,
    run_two_processes,
    usage_error,
)


# `tiny` from scratch (the defaults are TRL's for real models: β 0, lr 1e-6): the values these tests measured
TINY = [
    "--learning-rate",
    "3e-4",
    "--beta",
    "0.04",
    "--max-prompt-length",
    "64",
    "--lr-scheduler-type",
    "constant_with_warmup",
]  # the schedule the rewards below were measured with


def run(*flags, env=None):
    return run_script("grpo.py", *flags, env=env)


# ---------------------------------------------------------------------------
# CLI: bad flags, end to end, resume, learning
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, message",
    [
        ({"batch_size": 12, "num_generations": 8}, "multiple of --num-generations"),
        ({"batch_size": 8, "num_generations": 1}, "multiple of --num-generations"),
        ({"batch_size": 16, "num_mini_batches": 4}, "divisible by the data axis"),
        ({"num_mini_batches": 0}, "--num-mini-batches 0: must be >= 1"),
        ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, "not with vespo"),
        ({"top_entropy_quantile": 1.5}, "--top-entropy-quantile in"),
        ({"sapo_temperature_neg": 0.0}, "--sapo-temperature-neg 0.0: must be > 0"),
        ({"top_p": 0.0}, "--top-p must be in"),
        ({"top_k": -1}, "--top-k -1: must be >= 0"),
        ({"min_p": 1.5}, "--min-p and"),
    ],
)
def test_inconsistent_flags_are_refused(flags, message):
    mesh = common.make_mesh(None)  # 8 simulated devices on `data`
    with pytest.raises(common.UsageError, match=message):
        check_args(Args(**flags), mesh)


@pytest.mark.parametrize("flags", [["--loss-type", "sum"], ["--scale-rewards", "std"]])
def test_a_choice_not_offered_is_refused_by_the_cli(flags):
    """--loss-type, --scale-rewards: Literal choices, which the command line refuses in one line naming them."""
    import plumbing

    with pytest.raises(common.UsageError, match=flags[0]):
        plumbing.cli(Args, flags)


def test_a_reward_function_needing_a_missing_column_is_refused_before_the_model_loads(tmp_path):
    import grpo

    f = tmp_path / "f.py"
    f.write_text("def accuracy(completions, solution, **kwargs):\n    return [0.0] * len(completions)\n")
    message = usage_error(grpo, "--reward-fn", f"{f}:accuracy", "--output-dir", str(tmp_path / "out"))
    assert message == (
        f"reward function accuracy ({f}:1) takes 'solution', which is not a column of --dataset "
        "(its columns: answer, prompt)"
    )
    assert not (tmp_path / "out").exists()


def test_bad_input_exits_2_before_any_output(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Sort: 1 2"}\n{"prompt": 7}\n')
    out = run("--dataset", str(bad), "--loss-type", "sum", "--output-dir", str(tmp_path / "a"))
    assert out.returncode == 2 and "--loss-type" in out.stderr, out.stderr  # flags first: no model loaded
    out = run("--dataset", str(bad), "--output-dir", str(tmp_path / "b"))
    assert out.returncode == 2 and f"{bad}:2" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.fixture(scope="module")
def weighted(tmp_path_factory):
    """Two reward functions of one name, batch_score (the toy checker + a constant 1 with weight 0.5: one
    score each, by position, logged by module), two iterations of two mini-batches per generation batch
    (π_old from the rollout), the Dr. GRPO variant: 4 steps run
    uninterrupted and, beside it, stopped by SIGTERM after the step-2 checkpoint and resumed."""
    tmp_path = tmp_path_factory.mktemp("weighted")
    const = tmp_path / "const.py"
    const.write_text("def batch_score(prompts, responses):\n    return [1.0] * len(prompts)\n")
    flags = [
        "--model",
        "tiny",
        "--max-steps",
        "4",
        "--save-every",
        "2",
        "--batch-size",
        "16",
        "--num-generations",
        "4",
        "--num-iterations",
        "2",
        "--num-mini-batches",
        "2",
        "--response-length",
        "8",
        "--scale-rewards",
        "none",
        "--loss-type",
        "dr_grpo",
        "--epsilon-high",
        "0.28",
        "--reward-fn",
        os.path.join(ROOT, "data", "toy.py") + ":batch_score",
        f"{const}:batch_score",
        "--reward-weights",
        "1.0",
        "0.5",
        "--sample-every",
        "2",
        "--seed",
        "3",
        *TINY,
    ]
    return tmp_path / "clean", preempt_then_resume("grpo.py", flags, 2, tmp_path)


def test_end_to_end_weighted_rewards_off_policy_updates(weighted):
    out_dir, (_, _, _, stdout) = weighted
    rows = metrics(out_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["rewards/const.batch_score/mean"] == 1.0
        assert r["reward"] == pytest.approx(r["rewards/toy.batch_score/mean"] + 0.5, abs=1e-6)
        assert r["charts/generate_compilations"] == 1  # the sampler compiled once
        assert 0 <= r["frac_reward_zero_std"] <= 1 and 0 <= r["completions/clipped_ratio"] <= 1
    for k in (
        "reward_std",
        "kl",
        "clip_ratio",
        "completions/mean_length",
        "charts/tokens_per_sec",
        "entropy",
        "train/loss",
        "charts/mfu",
        "charts/update_time",
    ):
        assert k in rows[-1], k
    for r in rows:  # tokens/s and MFU count real tokens: the prompts' (from their padding share of B·Qb) and
        # the completions' through each EOS, of the step's B·(Qb+R), for the query bucket Qb it padded to
        b, resp = 16, 8
        completions = b * (r["completions/mean_length"] + 1 - r["completions/clipped_ratio"])
        qb = [
            q
            for q in range(8, 65, 8)
            if r["charts/tokens"]
            == pytest.approx(b * q * (1 - r["charts/query_padding_fraction"]) + completions)
        ]
        assert r["charts/generated_tokens"] == pytest.approx(completions)  # sampled, through each EOS
        padded = b * (qb[0] + resp) if len(qb) == 1 else None
        assert padded and r["charts/padding_fraction"] == pytest.approx(1 - r["charts/tokens"] / padded)
    assert "sample:" in stdout
    assert (out_dir / "model" / "config.json").exists()
    last = stdout.strip().splitlines()[-1]  # plumbing.Run's summary line
    assert last.startswith("done: 4 steps in ") and "reward " in last and f"outputs in {out_dir}" in last


def test_with_reward_model_and_no_reference(reward_run, tmp_path):
    """--reward-model scores the completions; β = 0 builds no reference (no `kl` logged)."""
    out = run(
        "--model",
        "tiny",
        "--reward-model",
        os.path.join(reward_run, "model"),
        "--beta",
        "0",
        "--max-steps",
        "2",
        "--batch-size",
        "16",
        "--num-generations",
        "4",
        "--response-length",
        "8",
        "--output-dir",
        str(tmp_path),
        env=one_device_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(tmp_path)
    assert "rewards/reward_model/mean" in rows[-1] and "kl" not in rows[-1]
    assert rows[-1]["reward"] == pytest.approx(rows[-1]["rewards/reward_model/mean"], rel=1e-5)


def test_sigterm_then_resume_equals_uninterrupted(weighted):
    """Restored: the policy, the optimizer, the sampling key and the mini-batch shuffler (two
    iterations of two mini-batches); the resumed run samples the same completions (same rewards)."""
    _, (clean, resumed, stopped, _) = weighted
    assert 2 <= stopped < 4
    assert [r["step"] for r in clean] == [1, 2, 3, 4]
    assert_same_rows(clean, resumed)
    # on one device too, the sampler compiles once (the initial params are committed like updated ones)
    assert all(r["charts/generate_compilations"] == 1 for r in clean + resumed)


def test_two_processes_match_one(tmp_path):
    """jax.distributed with 2 processes × 2 CPU devices == 1 process × 4 devices: the rollout goes
    in with put_global and comes out with to_host (an allgather), the same rows are logged. β = 0: at
    step 1 the policy is the reference, the k3 KL's gradient is float noise (the two collectives round
    differently), and Adam scales noise up to full-size steps; tiny's completions that end at its turn end
    (<end_of_turn>) give step 1 real tokens, where before every one was cut and masked."""
    flags = [
        sys.executable,
        os.path.join(ROOT, "grpo.py"),
        "--model",
        "tiny",
        "--max-steps",
        "2",
        "--batch-size",
        "16",
        "--num-generations",
        "4",
        "--response-length",
        "8",
        "--num-mini-batches",
        "2",
        "--mask-truncated-completions",
        "--sample-every",
        "0",
        "--seed",
        "5",
        *TINY,
        "--beta",
        "0",
    ]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    subprocess.run(
        flags + ["--output-dir", one], check=True, capture_output=True, env=env_with_devices(4), timeout=600
    )  # first: the pair then has the cores to itself
    run_two_processes(flags, two, env_with_devices(2))
    assert_same_rows(metrics(one), metrics(two))
    assert os.path.exists(os.path.join(two, "model", "config.json"))


def test_grpo_raises_toy_reward_from_scratch(tmp_path):
    """`python grpo.py --model tiny --max-steps 40` raises `reward` (on one device: the sharded
    path is covered above, and 8 simulated devices on 2 cores take twice as long). The reward is a
    TRL-form function reading the prompts' `answer` column (data/toy.py's accuracy: the same scores
    as the default two-argument batch_score, so the numbers measured with it hold)."""
    out = run(
        "--model",
        "tiny",
        "--max-steps",
        "40",
        "--batch-size",
        "64",
        "--response-length",
        "16",
        *TINY,
        "--reward-fn",
        os.path.join(ROOT, "data", "toy.py") + ":accuracy",
        "--sample-every",
        "0",
        "--output-dir",
        str(tmp_path),
        env=learning_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rewards = [r["reward"] for r in metrics(tmp_path)]
    assert "rewards/accuracy/mean" in metrics(tmp_path)[-1]
    # measured (seeds 0, 1, 2 on one device): first five 0.045, 0.032, 0.034 -> last ten 0.085, 0.092, 0.137
    # (over the bar by 0.015, 0.035, 0.078; at 30 steps the last five cleared it by 0.001, 0.029, 0.047)
    assert np.mean(rewards[-10:]) > max(1.5 * np.mean(rewards[:5]), np.mean(rewards[:5]) + 0.025), rewards


def test_a_failing_reward_function_stops_keeping_the_checkpoints_then_resumes(tmp_path):
    """A TRL-form function that raises at the third rollout: a UsageError naming it (plumbing.launch:
    `error: ...`, exit 2), the step-1 and step-2 checkpoints intact; fixed, --resume finishes the run (its last
    step, 3: the one whose rollout failed)."""
    import grpo
    import plumbing

    judge = tmp_path / "judge.py"
    judge.write_text(
        "calls = []\n\ndef judge(completions, answer, **kwargs):\n    calls.append(1)\n"
        "    if len(calls) == 3:\n        raise ValueError('no verdict')\n"
        "    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]\n"
    )
    out = tmp_path / "run"
    argv = [
        "--model",
        "tiny",
        "--max-steps",
        "3",
        "--save-every",
        "1",
        "--batch-size",
        "16",
        "--num-generations",
        "4",
        "--response-length",
        "8",
        "--sample-every",
        "0",
        *TINY,
        "--reward-fn",
        f"{judge}:judge",
        "--output-dir",
        str(out),
    ]
    with pytest.raises(
        plumbing.UsageError, match=rf"reward function judge \({judge}:3\) raised ValueError: no verdict"
    ):
        grpo.main(plumbing.cli(grpo.Args, argv))
    assert sorted(os.listdir(out / "checkpoints")) == ["1", "2"] and not (out / "model").exists()
    judge.write_text(judge.read_text().replace("len(calls) == 3", "False"))
    grpo.main(plumbing.cli(grpo.Args, argv + ["--resume"]))
    assert [r["step"] for r in metrics(out)] == [1, 2, 3] and (out / "model" / "config.json").exists()
    assert all("rewards/judge/mean" in r for r in metrics(out))
