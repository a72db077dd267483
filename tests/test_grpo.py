"""grpo.py: group-relative advantages, the k3 KL estimator and the clipped loss in each aggregation
mode, by hand and in float64 NumPy; the CLI end to end (several weighted reward functions, a
reward model, preemption + resume, bad flags); and learning on the toy task."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import common  # noqa: F401  (first: KERAS_BACKEND=jax)
import jax
import jax.numpy as jnp

from conftest import one_device_env
from grpo import Args, aggregate, check_args, group_advantages, grpo_loss, k3_kl
from test_reliability import env_with_devices
from test_rlhf import TIMING, assert_same_rows, preempt_then_resume

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPS = 1e-4  # group_advantages' default ε


def run(*flags, env=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, "grpo.py"), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=env)


def metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------
def test_group_advantages_worked_example():
    # two groups of G=4: rewards 1, 0, 0, 1 (mean ½) and 0.5 × 4 (all equal: no signal)
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv, std = group_advantages(rewards, 4)
    s = np.sqrt(4 * 0.5 ** 2 / 3)  # sample std (÷ G-1) of 1, 0, 0, 1
    a = 0.5 / (s + EPS)
    np.testing.assert_allclose(adv, [a, -a, -a, a, 0, 0, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(std, [s, 0.0], rtol=1e-6)
    # Dr. GRPO: no division, the raw centred rewards
    np.testing.assert_allclose(group_advantages(rewards, 4, "none")[0], [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    # batch: ÷ the std of all eight rewards (mean 0.5; four deviations of ±0.5, four of 0)
    sb = np.sqrt(4 * 0.5 ** 2 / 7)
    np.testing.assert_allclose(group_advantages(rewards, 4, "batch")[0],
                               np.array([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (sb + EPS), rtol=1e-6)


def test_group_advantages_numpy_float64():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=48)
    grouped = rewards.reshape(6, 8)
    centred = grouped - grouped.mean(1, keepdims=True)
    expected = {"group": centred / (grouped.std(1, ddof=1, keepdims=True) + EPS),
                "batch": centred / (rewards.std(ddof=1) + EPS), "none": centred}
    for scale, want in expected.items():
        got, std = group_advantages(jnp.array(rewards, jnp.float32), 8, scale)
        np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-4, atol=1e-5, err_msg=scale)
    np.testing.assert_allclose(std, grouped.std(1, ddof=1), rtol=1e-5)
    # every group's advantages sum to zero: the group mean is the baseline
    np.testing.assert_allclose(np.asarray(got).reshape(6, 8).sum(1), 0, atol=1e-5)


# ---------------------------------------------------------------------------
# The k3 KL estimator
# ---------------------------------------------------------------------------
def test_k3_by_hand_and_unbiased_on_samples_from_pi():
    # π(y) = 0.5, π_ref(y) = 0.25: ratio π_ref/π = 0.5, k3 = 0.5 − log 0.5 − 1 = log 2 − 0.5
    np.testing.assert_allclose(k3_kl(jnp.log(0.5), jnp.log(0.25)), np.log(2) - 0.5, rtol=1e-6)
    assert k3_kl(jnp.log(0.3), jnp.log(0.3)) == 0.0  # identical models: exactly 0
    # E_{y~π}[k3] = KL(π ‖ π_ref): check the mean over 200k samples against the exact float64 KL
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
    y = rng.choice(6, size=200_000, p=p)
    k3 = np.asarray(k3_kl(jnp.log(jnp.array(p[y], jnp.float32)), jnp.log(jnp.array(q[y], jnp.float32))))
    exact = np.sum(p * np.log(p / q))
    assert (k3 >= 0).all()
    np.testing.assert_allclose(k3.mean(), exact, rtol=0.03)


# ---------------------------------------------------------------------------
# The loss: hand cases per aggregation mode, clipping, NumPy, direction
# ---------------------------------------------------------------------------
def _loss(logps, old, advantages, mask, ref=None, beta=0.0, loss_type="dapo", eps=0.2, eps_high=0.2):
    arr = lambda x: None if x is None else jnp.array(x, jnp.float32)
    return grpo_loss(arr(logps), arr(old), arr(ref), arr(advantages), jnp.array(mask, bool), eps, eps_high,
                     beta, loss_type)


def test_aggregation_modes_by_hand():
    # ratio 1 everywhere, advantages 1 and 2: per-token losses -1, -1 (2 real tokens) and -2 (1 real
    # token, the rest padding that holds garbage and must not count)
    lp = [[-1.0, -2.0, -9.0], [-1.0, -9.0, -9.0]]
    mask = [[True, True, False], [True, False, False]]
    by_mode = {"dapo": (-1 - 1 - 2) / 3,  # token mean over the batch's 3 real tokens
               "grpo": (-(1 + 1) / 2 - 2 / 1) / 2,  # each completion's mean, then the mean of those
               "dr_grpo": (-1 - 1 - 2) / (2 * 3)}  # ÷ (B × R), fixed
    for mode, want in by_mode.items():
        loss, m = _loss(lp, lp, [1.0, 2.0], mask, loss_type=mode)
        np.testing.assert_allclose(loss, want, rtol=1e-6, err_msg=mode)
        assert m["clip_ratio"] == 0.0 and "kl" not in m  # β = 0: no KL term, no reference


def test_clipping_by_hand():
    # ratio e^0.5 ≈ 1.65, advantage +1: clipped at 1+ε → loss −1.2; with ε_high 0.28 → −1.28
    loss, m = _loss([[0.5]], [[0.0]], [1.0], [[True]])
    np.testing.assert_allclose(loss, -1.2, rtol=1e-6)
    assert m["clip_ratio/high_mean"] == 1.0 and m["clip_ratio"] == 1.0
    np.testing.assert_allclose(_loss([[0.5]], [[0.0]], [1.0], [[True]], eps_high=0.28)[0], -1.28, rtol=1e-6)
    # ratio e^-0.5 ≈ 0.61, advantage −1: min(−0.61, −0.8) = −0.8 → loss +0.8, clipped from below
    loss, m = _loss([[-0.5]], [[0.0]], [-1.0], [[True]])
    np.testing.assert_allclose(loss, 0.8, rtol=1e-6)
    assert m["clip_ratio/low_mean"] == 1.0
    # ratio e^0.5 with advantage −1: the pessimistic min keeps the unclipped e^0.5, not clipped
    loss, m = _loss([[0.5]], [[0.0]], [-1.0], [[True]])
    np.testing.assert_allclose(loss, np.exp(0.5), rtol=1e-6)
    assert m["clip_ratio"] == 0.0


def test_kl_term_by_hand():
    # π = 0.5, π_ref = 0.25 on one token, ratio 1, advantage 0: loss = β · (log 2 − 0.5)
    loss, m = _loss([[np.log(0.5)]], [[np.log(0.5)]], [0.0], [[True]], ref=[[np.log(0.25)]], beta=0.04)
    np.testing.assert_allclose(loss, 0.04 * (np.log(2) - 0.5), rtol=1e-5)
    np.testing.assert_allclose(m["kl"], np.log(2) - 0.5, rtol=1e-5)


def test_loss_numpy_float64_every_mode():
    rng = np.random.default_rng(1)
    b, r, eps, eps_high, beta = 6, 7, 0.2, 0.28, 0.1
    lp, old, ref = (rng.normal(-2, 0.3, (b, r)) for _ in range(3))
    adv = rng.normal(size=b)
    mask = rng.random((b, r)) > 0.3
    mask[:, 0] = True
    ratio = np.exp(lp - old)
    per_token = -np.minimum(ratio * adv[:, None], np.clip(ratio, 1 - eps, 1 + eps_high) * adv[:, None])
    per_token += beta * (np.exp(ref - lp) - (ref - lp) - 1)
    x = np.where(mask, per_token, 0.0)
    want = {"dapo": x.sum() / mask.sum(), "grpo": np.mean(x.sum(1) / mask.sum(1)), "dr_grpo": x.sum() / (b * r)}
    for mode, w in want.items():
        loss, _ = _loss(lp, old, adv, mask, ref=ref, beta=beta, loss_type=mode, eps=eps, eps_high=eps_high)
        np.testing.assert_allclose(loss, w, rtol=1e-5, err_msg=mode)


def test_loss_direction_and_clipped_tokens_have_no_gradient():
    """A positive advantage raises the token's log-prob; a clipped token gets no gradient; with
    old = stop_gradient(new) (one update per batch) the gradient is the plain policy gradient −A."""
    def grad(lp, old, adv):
        return jax.grad(lambda x: _loss(x, old, adv, [[True, True]])[0])(jnp.array(lp))
    g = np.asarray(grad([[0.0, 0.5]], [[0.0, 0.0]], [1.0]))
    assert g[0, 0] < 0 and g[0, 1] == 0.0  # token 2 sits above 1+ε with A > 0: clipped, no gradient
    on_policy = jax.grad(lambda x: _loss(x, jax.lax.stop_gradient(x), [2.0], [[True, True]])[0])(jnp.zeros((1, 2)))
    np.testing.assert_allclose(on_policy, [[-2.0 / 2, -2.0 / 2]], rtol=1e-6)  # −A / (number of tokens)


def test_aggregate_ignores_padding_values():
    x = jnp.array([[1.0, 2.0, 5.0]])
    mask = jnp.array([[True, True, False]])
    for mode in ("dapo", "grpo", "dr_grpo"):
        assert aggregate(x, mask, mode) == aggregate(x.at[0, 2].set(1e9), mask, mode)


# ---------------------------------------------------------------------------
# CLI: bad flags, end to end, resume, learning
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    ({"batch_size": 12, "num_generations": 8}, "multiple of --num-generations"),
    ({"batch_size": 8, "num_generations": 1}, "multiple of --num-generations"),
    ({"batch_size": 16, "num_mini_batches": 4}, "divisible by the data axis"),
    ({"num_mini_batches": 0}, "--num-mini-batches"),
    ({"loss_type": "bnpo"}, "--loss-type"),
    ({"scale_rewards": "std"}, "--scale-rewards"),
    ({"reward_weights": (1.0, 2.0)}, "2 weights for 1 --reward-fn"),
])
def test_inconsistent_flags_are_refused(flags, message):
    mesh = common.make_mesh(None)  # 8 simulated devices on `data`
    with pytest.raises(common.UsageError, match=message):
        check_args(Args(**flags), mesh)


def test_bad_input_exits_2_before_any_output(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Sort: 1 2"}\n{"prompt": 7}\n')
    out = run("--dataset", str(bad), "--loss-type", "bnpo", "--output-dir", str(tmp_path / "a"))
    assert out.returncode == 2 and "--loss-type" in out.stderr, out.stderr  # flags first: no model loaded
    out = run("--dataset", str(bad), "--output-dir", str(tmp_path / "b"))
    assert out.returncode == 2 and f"{bad}:2" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_end_to_end_weighted_rewards_off_policy_updates(tmp_path):
    """Two reward functions (the toy checker + a constant 1 with weight 0.5), two iterations of two
    mini-batches per generation batch (π_old from the rollout), the Dr. GRPO variant."""
    const = tmp_path / "const.py"
    const.write_text("def one(prompts, responses):\n    return [1.0] * len(prompts)\n")
    out_dir = tmp_path / "run"
    out = run("--model", "tiny", "--max-steps", "3", "--batch-size", "16", "--num-generations", "4",
              "--num-iterations", "2", "--num-mini-batches", "2", "--response-length", "8",
              "--scale-rewards", "none", "--loss-type", "dr_grpo", "--epsilon-high", "0.28",
              "--reward-fn", os.path.join(ROOT, "data", "toy.py") + ":batch_score", f"{const}:one",
              "--reward-weights", "1.0", "0.5", "--sample-every", "2", "--output-dir", str(out_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(out_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["rewards/one/mean"] == 1.0
        assert r["reward"] == pytest.approx(r["rewards/batch_score/mean"] + 0.5, abs=1e-6)
        assert r["charts/generate_compilations"] == 1  # the sampler compiled once
        assert 0 <= r["frac_reward_zero_std"] <= 1 and 0 <= r["completions/clipped_ratio"] <= 1
    for k in ("reward_std", "kl", "clip_ratio", "completions/mean_length", "charts/tokens_per_sec",
              "entropy", "train/loss", "charts/mfu", "charts/update_time"):
        assert k in rows[-1], k
    assert "sample:" in out.stdout + out.stderr
    assert (out_dir / "model" / "config.json").exists()


def test_with_reward_model_and_no_reference(reward_run, tmp_path):
    """--reward-model scores the completions; β = 0 builds no reference (no `kl` logged)."""
    out = run("--model", "tiny", "--reward-model", os.path.join(reward_run, "model"), "--beta", "0",
              "--max-steps", "2", "--batch-size", "16", "--num-generations", "4", "--response-length", "8",
              "--output-dir", str(tmp_path), env=one_device_env())
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(tmp_path)
    assert "rewards/reward_model/mean" in rows[-1] and "kl" not in rows[-1]
    assert rows[-1]["reward"] == pytest.approx(rows[-1]["rewards/reward_model/mean"], rel=1e-5)


def test_sigterm_then_resume_equals_uninterrupted(tmp_path):
    flags = ["--model", "tiny", "--max-steps", "4", "--save-every", "2", "--batch-size", "16",
             "--num-generations", "4", "--response-length", "8", "--sample-every", "0", "--seed", "3"]
    clean, resumed, stopped = preempt_then_resume("grpo.py", flags, 2, tmp_path)
    assert 2 <= stopped < 4
    assert [r["step"] for r in clean] == [1, 2, 3, 4]
    assert_same_rows(clean, resumed)
    # on one device too, the sampler compiles once (the initial params are committed like updated ones)
    assert all(r["charts/generate_compilations"] == 1 for r in clean + resumed)


def test_two_processes_match_one(tmp_path):
    """jax.distributed with 2 processes × 4 CPU devices == 1 process × 8 devices: the rollout goes
    in with put_global and comes out with to_host (an allgather), the same rows are logged."""
    port = socket.socket()
    port.bind(("localhost", 0))
    address = f"localhost:{port.getsockname()[1]}"
    port.close()
    flags = [sys.executable, os.path.join(ROOT, "grpo.py"), "--model", "tiny", "--max-steps", "2",
             "--batch-size", "16", "--num-generations", "4", "--response-length", "8", "--num-mini-batches", "2",
             "--mask-truncated-completions", "--sample-every", "0", "--seed", "5"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    procs = [subprocess.Popen(flags + ["--output-dir", one], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, env=env_with_devices(8))]
    procs += [subprocess.Popen(flags + ["--output-dir", two, "--coordinator-address", address, "--num-processes",
                                        "2", "--process-id", str(i)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env_with_devices(4))
              for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
    assert_same_rows(strip(metrics(one)), strip(metrics(two)))
    assert os.path.exists(os.path.join(two, "model", "config.json"))


def test_grpo_raises_toy_reward_from_scratch(tmp_path):
    """`python grpo.py --model tiny --max-steps 30` raises `reward` (on one device: the sharded
    path is covered above, and 8 simulated devices on 2 cores take twice as long)."""
    out = run("--model", "tiny", "--max-steps", "30", "--sample-every", "0", "--output-dir", str(tmp_path),
              env=one_device_env())
    assert out.returncode == 0, out.stderr[-3000:]
    rewards = [r["reward"] for r in metrics(tmp_path)]
    # measured (seeds 0, 1, 2 on one device): first five 0.043, 0.033, 0.033 -> last five 0.083, 0.085, 0.096
    assert np.mean(rewards[-5:]) > max(1.5 * np.mean(rewards[:5]), np.mean(rewards[:5]) + 0.025), rewards
