"""rloo.py beyond its loss and advantages (those are in test_losses.py): inconsistent flags and bad rows
refused in-process, the CLI end to end (weighted reward functions, off-policy updates with the KL
folded into the reward, preemption + resume), and learning on the toy task."""

import os

import numpy as np
import pytest

import common  # noqa: F401  (first: KERAS_BACKEND=jax)

from helpers import (
    ROOT,
    assert_same_rows,
    learning_env,
    metrics,
    preempt_then_resume,
    run_script,
    usage_error,
)
from rloo import Args, check_args

# `tiny` from scratch (the defaults are TRL's for real models: k = 2, β 0.05, lr 1e-6): the values measured
TINY = [
    "--learning-rate",
    "3e-4",
    "--num-generations",
    "8",
    "--max-prompt-length",
    "64",
    "--lr-scheduler-type",
    "constant_with_warmup",
]  # the schedule the rewards below were measured with


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"batch_size": 12, "num_generations": 8}, "multiple of --num-generations"),
        ({"batch_size": 8, "num_generations": 1}, "multiple of --num-generations"),
        ({"batch_size": 16, "num_mini_batches": 4}, "divisible by the data axis"),
        ({"num_iterations": 0}, "--num-iterations"),
        ({"reward_clip_range": (1.0, -1.0)}, "--reward-clip-range 1.0 -1.0: expected MIN < MAX"),
        ({"top_p": 0.0}, "--top-p must be in"),
    ],
)
def test_inconsistent_flags_are_refused(flags, message):
    mesh = common.make_mesh(None)  # 8 simulated devices on `data`
    with pytest.raises(common.UsageError, match=message):
        check_args(Args(**flags), mesh)


def test_bad_rows_and_flags_stop_in_process_before_any_output(tmp_path):
    """main raises the UsageError (plumbing.launch: `error: …`, exit 2) before a model loads or a file
    is written."""
    import rloo

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Sort: 1 2"}\n{"prompt": 7}\n')
    assert f"{bad}:2" in usage_error(rloo, "--dataset", str(bad), "--output-dir", str(tmp_path / "a"))
    message = usage_error(
        rloo, "--batch-size", "16", "--num-generations", "3", "--output-dir", str(tmp_path / "b")
    )
    assert "--batch-size 16 must be a multiple of --num-generations 3" in message
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.fixture(scope="module")
def weighted(tmp_path_factory):
    """Two reward functions (the toy checker + a constant 1 with weight 0.5), the KL folded into the reward
    (β 0.1), two iterations of two mini-batches (π_old from the rollout), normalised advantages, a reward
    clip range: 4 steps run uninterrupted and, beside it, stopped by SIGTERM after the step-2 checkpoint
    and resumed."""
    tmp_path = tmp_path_factory.mktemp("weighted")
    const = tmp_path / "const.py"
    const.write_text("def one(prompts, responses):\n    return [1.0] * len(prompts)\n")
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
        "--beta",
        "0.1",
        "--normalize-advantages",
        "--reward-clip-range",
        "0",
        "1.2",
        "--epsilon-high",
        "0.28",
        "--reward-fn",
        os.path.join(ROOT, "data", "toy.py") + ":batch_score",
        f"{const}:one",
        "--reward-weights",
        "1.0",
        "0.5",
        "--sample-every",
        "2",
        "--seed",
        "3",
        "--learning-rate",
        "3e-4",
        "--max-prompt-length",
        "64",
    ]
    return tmp_path / "clean", preempt_then_resume("rloo.py", flags, 2, tmp_path)


def test_end_to_end_kl_in_the_reward_off_policy_updates(weighted):
    out_dir, (_, _, _, stdout) = weighted
    rows = metrics(out_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["rewards/one/mean"] == 1.0
        # logged before the clip and the KL, as TRL
        assert r["reward"] == pytest.approx(r["rewards/batch_score/mean"] + 0.5, abs=1e-6)
        assert r["charts/generate_compilations"] == 1  # the sampler compiled once
        for k in (
            "clip_ratio/low_mean",
            "clip_ratio/high_mean",
            "clip_ratio/region_mean",
            "frac_reward_zero_std",
        ):
            assert 0 <= r[k] <= 1, k
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: π_old is the reference itself
    assert rows[-1]["kl"] != 0.0  # the policy has moved
    for k in (
        "reward_std",
        "entropy",
        "train/loss",
        "train/grad_norm",
        "completions/mean_length",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
        "charts/tokens_per_sec",
        "charts/mfu",
    ):
        assert k in rows[-1], k
    assert "sample:" in stdout and (out_dir / "model" / "config.json").exists()
    assert stdout.strip().splitlines()[-1].startswith("done: 4 steps in ")


def test_sigterm_then_resume_equals_uninterrupted(weighted):
    """Restored: the policy, the optimizer, the sampling key and the mini-batch shuffler; the reference
    is rebuilt from the initial weights (the same `tiny` seed), so the KL and the advantages match too."""
    _, (clean, resumed, stopped, _) = weighted
    assert 2 <= stopped < 4
    assert_same_rows(clean, resumed)


def test_rloo_raises_toy_reward_from_scratch(tmp_path):
    """`python rloo.py --model tiny --max-steps 30` with the module docstring's values raises `reward`
    (one device: 8 simulated devices on 2 cores take twice as long; the sharded path runs above)."""
    out = run_script(
        "rloo.py",
        "--model",
        "tiny",
        "--max-steps",
        "30",
        "--batch-size",
        "64",
        "--response-length",
        "16",
        "--beta",
        "0.01",
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
    rows = metrics(tmp_path)
    rewards = [r["reward"] for r in rows]
    assert "rewards/accuracy/mean" in rows[-1] and "kl" in rows[-1]
    # measured (seeds 0, 1, 2 on one device): first five 0.041, 0.034, 0.034 -> last ten 0.069, 0.088, 0.075
    # (over the bar by 0.013, 0.039, 0.026; the last five: 0.012, 0.028, 0.036, noisier by √2)
    assert np.mean(rewards[-10:]) > max(1.3 * np.mean(rewards[:5]), np.mean(rewards[:5]) + 0.015), rewards
