"""reward.py and ppo.py: losses by hand and in float64 NumPy, GAE, whitening, reward placement,
KV-cached sampling (== uncached greedy, compiled once), the CLIs, and learning on the toy task."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import common  # noqa: F401  (first: KERAS_BACKEND=jax)
import jax
import jax.numpy as jnp
import optax

from ppo import (Args, advantages_of, compute_gae, compute_rewards, generate, hidden_states, ppo_loss,
                 response_logps, rollout_stats, train_step, truncate_response, whiten)
from reward import reward_loss
from conftest import one_device_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *flags, env=None):
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=env)


def metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------
# reward.py: Bradley–Terry loss
# ---------------------------------------------------------------------------
def test_reward_loss_by_hand_numpy_and_direction():
    loss, m = reward_loss(jnp.array([1.0, 0.0]), jnp.array([1.0, 2.0]))
    # margins 0 and -2: mean of -log σ(0) = log 2 and -log σ(-2) = log(1 + e^2)
    np.testing.assert_allclose(loss, (np.log(2) + np.log(1 + np.exp(2))) / 2, rtol=1e-6)
    np.testing.assert_allclose([m["rewards/accuracies"], m["rewards/margins"]], [0.0, -1.0])
    rng = np.random.default_rng(0)
    c, r = rng.normal(size=64) * 5, rng.normal(size=64) * 5
    expected = np.mean(-np.log(1 / (1 + np.exp(-(c - r)))))  # float64
    np.testing.assert_allclose(reward_loss(jnp.array(c), jnp.array(r))[0], expected, rtol=1e-5)
    grad = jax.grad(lambda x: reward_loss(x, jnp.zeros(3))[0])(jnp.zeros(3))
    assert (grad < 0).all()  # raising the chosen score lowers the loss


# ---------------------------------------------------------------------------
# ppo.py: response processing, rewards, GAE, whitening, losses
# ---------------------------------------------------------------------------
def test_truncate_response_after_first_eos():
    eos, pad = 1, 0
    responses = jnp.array([[5, 1, 7, 1], [5, 6, 7, 8], [1, 9, 9, 9]])
    out, lengths = truncate_response(responses, eos, pad)
    np.testing.assert_array_equal(out, [[5, 1, 0, 0], [5, 6, 7, 8], [1, 0, 0, 0]])
    np.testing.assert_array_equal(lengths, [1, 3, 0])  # index of the EOS, or R-1 without one


def test_reward_placement_and_kl():
    logprobs = jnp.array([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = jnp.array([[-1.5, -1.0, -0.5, -9.0], [-2.0, -1.0, -1.0, -1.0]])
    scores, lengths = jnp.array([2.0, -1.0]), jnp.array([2, 3])
    rewards, kl, nsr = compute_rewards(scores, logprobs, ref, lengths, kl_coef=0.1)
    # k1 = logπ - logπref on real tokens; 0 after the EOS (row 0, position 3)
    np.testing.assert_allclose(kl, [[0.5, -1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    # score added on the last real token only: -0.1·kl + score there
    np.testing.assert_allclose(rewards, [[-0.05, 0.1, 2.0, 0.0], [-0.1, 0.0, 0.0, -1.0]], rtol=1e-6)
    np.testing.assert_allclose(nsr, -0.1 * np.asarray(kl))
    _, kl3, _ = compute_rewards(scores, logprobs, ref, lengths, 0.1, "k3")
    logr = np.array([[-0.5, 1.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(kl3, np.expm1(logr) - logr, rtol=1e-6)
    assert (np.asarray(kl3) >= 0).all()


def test_gae_worked_example():
    rewards, values = jnp.array([[0.0, 0.0, 1.0]]), jnp.array([[0.5, 0.5, 0.5]])
    adv, ret = compute_gae(rewards, values, jnp.ones((1, 3), bool), gamma=0.9, lam=0.5)
    d2 = 1.0 + 0.9 * 0.0 - 0.5  # the value after the last token is 0
    d1 = d0 = 0.0 + 0.9 * 0.5 - 0.5
    a2 = d2
    a1 = d1 + 0.9 * 0.5 * a2
    a0 = d0 + 0.9 * 0.5 * a1
    np.testing.assert_allclose(adv, [[a0, a1, a2]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[a0 + 0.5, a1 + 0.5, a2 + 0.5]], rtol=1e-6)


def test_gae_matches_python_loop_and_ignores_padding():
    rng = np.random.default_rng(1)
    b, t, gamma, lam = 4, 7, 0.97, 0.9
    rewards, values = rng.normal(size=(b, t)), rng.normal(size=(b, t))
    lengths = np.array([6, 3, 0, 4])
    mask = np.arange(t)[None] <= lengths[:, None]
    expected = np.zeros((b, t))
    for i in range(b):  # TRL's loop, on the real tokens only
        last = 0.0
        for j in reversed(range(lengths[i] + 1)):
            next_value = values[i, j + 1] if j < lengths[i] else 0.0
            last = rewards[i, j] + gamma * next_value - values[i, j] + gamma * lam * last
            expected[i, j] = last
    adv, ret = compute_gae(jnp.array(rewards), jnp.array(values), jnp.array(mask), gamma, lam)
    np.testing.assert_allclose(np.where(mask, adv, 0), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.where(mask, ret, 0), np.where(mask, expected + values, 0), rtol=1e-4, atol=1e-5)
    garbage = np.where(mask, values, 1e3)  # padded values must not leak in
    adv2, _ = compute_gae(jnp.array(np.where(mask, rewards, 1e3)), jnp.array(garbage), jnp.array(mask), gamma, lam)
    np.testing.assert_allclose(np.where(mask, adv2, 0), expected, rtol=1e-4, atol=1e-5)


def test_masked_whitening():
    rng = np.random.default_rng(2)
    x = rng.normal(3.0, 2.0, size=(3, 5))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)
    w = np.asarray(whiten(jnp.array(np.where(mask, x, 1e6)), jnp.array(mask)))
    v = x[mask]
    np.testing.assert_allclose(w[mask], (v - v.mean()) / v.std(ddof=1), rtol=1e-4)
    assert (w[~mask] == 0).all()
    kept = np.asarray(whiten(jnp.array(x), jnp.array(mask), shift_mean=False))
    np.testing.assert_allclose(kept[mask], (v - v.mean()) / v.std(ddof=1) + v.mean(), rtol=1e-4)


def _loss(new_lp, new_v, lp, v, adv, ret, mask=None, **kw):
    args = [jnp.array([x], jnp.float32) for x in (new_lp, new_v, lp, v, adv, ret)]
    mask = jnp.ones((1, len(new_lp)), bool) if mask is None else jnp.array([mask])
    return ppo_loss(*args, mask, cliprange=kw.get("c", 0.2), cliprange_value=kw.get("cv", 0.2), vf_coef=0.1)


def test_ppo_policy_loss_hand_cases():
    # ratio e^0.5 ≈ 1.65 outside [0.8, 1.2], advantage +1: the clipped term wins, -1.2
    _, m = _loss([0.5], [0.0], [0.0], [0.0], [1.0], [0.0])
    np.testing.assert_allclose(m["loss/policy_avg"], -1.2, rtol=1e-6)
    assert m["policy/clipfrac_avg"] == 1.0
    # same ratio, advantage -1: the pessimistic max keeps the unclipped e^0.5
    _, m = _loss([0.5], [0.0], [0.0], [0.0], [-1.0], [0.0])
    np.testing.assert_allclose(m["loss/policy_avg"], np.exp(0.5), rtol=1e-6)
    assert m["policy/clipfrac_avg"] == 0.0
    # ratio e^0.1 inside the range, advantage 2: plain -2·e^0.1; approxkl = ½·0.1²
    _, m = _loss([0.1], [0.0], [0.0], [0.0], [2.0], [0.0])
    np.testing.assert_allclose([m["loss/policy_avg"], m["policy/approxkl_avg"]], [-2 * np.exp(0.1), 0.005],
                               rtol=1e-5)


def test_ppo_value_loss_hand_cases():
    # new value 0.5 moves 0.5 from the rollout value 0 > cliprange_value 0.2: clipped 0.2,
    # (0.2 - 1)² = 0.64 > (0.5 - 1)² = 0.25, the max is 0.64, loss ½·0.64
    loss, m = _loss([0.0], [0.5], [0.0], [0.0], [0.0], [1.0])
    np.testing.assert_allclose(m["loss/value_avg"], 0.5 * 0.64, rtol=1e-6)
    np.testing.assert_allclose(loss, 0.1 * 0.32, rtol=1e-6)
    assert m["val/clipfrac_avg"] == 1.0
    # inside the clip range: ½·(0.1 - 1)²
    _, m = _loss([0.0], [0.1], [0.0], [0.0], [0.0], [1.0])
    np.testing.assert_allclose(m["loss/value_avg"], 0.5 * 0.81, rtol=1e-6)
    assert m["val/clipfrac_avg"] == 0.0
    # a padded token counts nowhere
    _, m = _loss([0.0, 3.0], [0.1, 9.0], [0.0, 0.0], [0.0, 0.0], [0.0, 5.0], [1.0, -9.0], mask=[True, False])
    np.testing.assert_allclose([m["loss/value_avg"], m["loss/policy_avg"]], [0.5 * 0.81, 0.0], atol=1e-6)


def test_ppo_loss_numpy_and_direction():
    rng = np.random.default_rng(3)
    shape = (4, 6)
    new_lp, lp = rng.normal(-2, 0.3, shape), rng.normal(-2, 0.3, shape)
    new_v, v, adv, ret = (rng.normal(size=shape) for _ in range(4))
    mask = rng.random(shape) > 0.3
    ratio = np.exp(new_lp - lp)
    pg = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))[mask].mean()
    vc = v + np.clip(new_v - v, -0.2, 0.2)
    vf = 0.5 * np.maximum((new_v - ret) ** 2, (vc - ret) ** 2)[mask].mean()
    args = [jnp.array(x, jnp.float32) for x in (new_lp, new_v, lp, v, adv, ret)]
    loss, m = ppo_loss(*args, jnp.array(mask), 0.2, 0.2, 0.1)
    np.testing.assert_allclose([m["loss/policy_avg"], m["loss/value_avg"], loss], [pg, vf, pg + 0.1 * vf], rtol=1e-5)
    # direction: with a positive advantage, raising the token's log-prob lowers the loss
    grad = jax.grad(lambda x: ppo_loss(x, *[jnp.zeros((1, 1))] * 3, jnp.ones((1, 1)), jnp.zeros((1, 1)),
                                       jnp.ones((1, 1), bool), 0.2, 0.2, 0.1)[0])(jnp.zeros((1, 1)))
    assert grad[0, 0] < 0


def test_ppo_update_moves_logprobs_along_advantages():
    """One PPO epoch on a real rollout: tokens with positive advantage gain log-prob, negative lose."""
    mesh = common.make_mesh(None)
    model = common.load_model("tiny", mesh, "float32", seed=0)
    bb = model.backbone
    params, frozen = common.split_variables(bb)
    head = {"weight": jnp.zeros((bb.hidden_dim, 1)), "bias": jnp.zeros(())}
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p))((params, (params, head)))
    args = Args(learning_rate=1e-3, temperature=1.0)
    q, r = 8, 6
    rng = np.random.default_rng(0)
    queries = jnp.array(rng.integers(3, 300, (8, q)), jnp.int32)
    responses = jnp.array(rng.integers(3, 300, (8, r)), jnp.int32)
    batch = {"query_responses": jnp.concatenate([queries, responses], 1),
             "padding_mask": jnp.ones((8, q + r), bool), "response_mask": jnp.ones((8, r), bool)}
    lp, ref, values = rollout_stats((bb, bb), params, params[0], (frozen, frozen), batch, q, 1.0)
    scores = jnp.array(rng.normal(size=8), jnp.float32)
    adv, ret, _ = advantages_of(scores, lp, ref, values, jnp.full((8,), r - 1), args)
    batch.update(logprobs=lp, values=values, advantages=adv, returns=ret)
    optimizer = optax.adam(1e-3)
    state = (params, optimizer.init(params), (frozen, frozen))
    state, m = jax.jit(lambda s, b: train_step((bb, bb), optimizer, s, b, q, args))(state, batch)
    new_lp, _ = response_logps(bb, state[0][0], frozen, batch["query_responses"], batch["padding_mask"], q, 1.0)
    delta = np.asarray(new_lp - lp)
    assert np.sum(delta * np.asarray(adv)) > 0
    assert np.corrcoef(delta.ravel(), np.asarray(adv).ravel())[0, 1] > 0.3


# ---------------------------------------------------------------------------
# KV-cached sampling: == uncached greedy decoding, compiled once
# ---------------------------------------------------------------------------
def test_cached_generation_matches_uncached_greedy_and_compiles_once():
    mesh = common.make_mesh(None)
    model = common.load_model("tiny", mesh, "float32", seed=0)
    bb = model.backbone
    params, frozen = common.split_variables(bb)
    tok = model.preprocessor.tokenizer
    prompts = ["Sort: 3 1 2", "Sort: 9 8 7 6 5 4", "Sort: 1", "Sort: 5 5 0 2"] * 2
    ids = [[2] + list(x) for x in tok.tokenize(prompts)]
    q, r = 16, 6
    queries, qmask = np.zeros((8, q), np.int32), np.zeros((8, q), bool)
    for i, x in enumerate(ids):  # left padding, different lengths
        queries[i, q - len(x):], qmask[i, q - len(x):] = x, True
    # as ppo.main does: values through one jit first, so they carry the mesh in their types
    # like every updated version of them will
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p))(params)
    gen = jax.jit(lambda p, qs, qm, k: generate(bb, p, frozen, qs, qm, k, r, 0.0))
    cached = np.asarray(gen(params, queries, qmask, jax.random.key(0)))

    seq, mask = np.concatenate([queries, np.zeros((8, r), np.int32)], 1), np.concatenate([qmask, np.zeros((8, r), bool)], 1)
    logits_fn = jax.jit(lambda s, m: bb.token_embedding(hidden_states(bb, params, frozen, s, m), reverse=True))
    for t in range(r):  # uncached: the whole sequence again for each new token
        nxt = np.argmax(np.asarray(logits_fn(seq, mask))[:, q + t - 1], -1)
        seq[:, q + t], mask[:, q + t] = nxt, True
    np.testing.assert_array_equal(cached, seq[:, q:])

    # new params (as an update makes them) and new prompts: the same executable is reused
    new_params = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.01, p))(params)
    for k in range(2):
        gen(new_params, np.roll(queries, k + 1, 0), np.roll(qmask, k + 1, 0), jax.random.key(k))
    assert gen._cache_size() == 1


# ---------------------------------------------------------------------------
# CLIs: bad input, end to end, learning on the toy task
# ---------------------------------------------------------------------------
def test_bad_input_fails_fast_with_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Sort: 1 2"}\n{"prompt": ""}\n')
    out = run("ppo.py", "--dataset", str(bad), "--output-dir", str(tmp_path / "p"))
    assert out.returncode == 2 and f"{bad}:2" in out.stderr, out.stderr
    bad.write_text('{"prompt": "Sort: 1 2", "chosen": " 1 2", "rejected": " 2 1"}\n{"prompt": "x", "chosen": 3, "rejected": "y"}\n')
    out = run("reward.py", "--dataset", str(bad), "--output-dir", str(tmp_path / "r"))
    assert out.returncode == 2 and f"{bad}:2" in out.stderr and "chosen" in out.stderr, out.stderr


def test_reward_model_learns_and_saves_head(reward_run):
    rows = metrics(reward_run)
    acc = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert acc[-1] >= 0.75, acc
    train = [r for r in rows if "train/loss" in r]
    assert train[-1]["train/loss"] < train[0]["train/loss"]
    for k in ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected", "charts/mfu"):
        assert k in train[-1]
    model_dir = os.path.join(reward_run, "model")
    with np.load(os.path.join(model_dir, "reward_head.npz")) as f:
        assert f["weight"].shape == (192, 1) and f["bias"].shape == ()
    with open(os.path.join(model_dir, "reward_head.json")) as f:
        info = json.load(f)
    assert info["normalized"] and "chosen responses" in info["reference_set"]


# ---------------------------------------------------------------------------
# Reliability: SIGTERM (preemption) checkpoints and exits 0; --resume ends where an
# uninterrupted run ends (same per-step rows, same final loss)
# ---------------------------------------------------------------------------
TIMING = ("charts/tokens_per_sec", "charts/mfu", "charts/generate_tokens_per_sec", "charts/generate_time",
          "charts/score_time", "charts/update_time")




def preempt_then_resume(script, flags, first_checkpoint, tmp_path):
    """Runs `flags` uninterrupted and (concurrently) a copy that gets SIGTERM once checkpoint
    `first_checkpoint` exists, then resumes the copy; -> (clean rows, resumed rows, stop step)."""
    clean, cut = str(tmp_path / "clean"), str(tmp_path / "cut")
    argv = lambda out: [sys.executable, os.path.join(ROOT, script), *flags, "--output-dir", out]
    env = one_device_env()
    runs = [subprocess.Popen(argv(out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env) for out in (clean, cut)]
    start = time.time()
    while not os.path.exists(os.path.join(cut, "checkpoints", str(first_checkpoint))):
        assert runs[1].poll() is None, "run ended before it could be interrupted"
        assert time.time() - start < 600
        time.sleep(0.1)
    runs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=600) for p in runs]
    assert [p.returncode for p in runs] == [0, 0], outs[1][1][-2000:] + outs[0][1][-2000:]
    line = [s for s in outs[1][0].splitlines() if s.startswith("SIGTERM: checkpoint saved at step ")]
    assert line and line[0].endswith("continue with --resume"), outs[1][0][-2000:]
    stopped = int(line[0].split("step ")[1].split(";")[0])
    assert not os.path.exists(os.path.join(cut, "model"))  # stopped early, nothing final written
    res = subprocess.run(argv(cut) + ["--resume"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resumed from step {stopped}" in res.stdout
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
    return strip(metrics(clean)), strip(metrics(cut)), stopped


def assert_same_rows(a, b, rel=1e-5):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert rb[k] == pytest.approx(ra[k], rel=rel, abs=1e-7), (ra["step"], k)


def test_reward_sigterm_then_resume_equals_uninterrupted(tmp_path):
    """--log-every 1: every row is one step, so the row the stopped run logs at its stop step is
    also a row of the uninterrupted run (with --log-every 5 it would average a partial interval)."""
    flags = ["--model", "tiny", "--max-steps", "20", "--save-every", "5", "--batch-size", "8",
             "--log-every", "1", "--eval-dataset", "", "--seed", "3"]
    clean, resumed, stopped = preempt_then_resume("reward.py", flags, 5, tmp_path)
    assert 5 <= stopped < 20
    assert [r["step"] for r in clean] == list(range(1, 21))
    assert_same_rows(clean, resumed)
    assert resumed[-1]["train/loss"] == pytest.approx(clean[-1]["train/loss"], rel=1e-5)


def test_reward_nonfinite_loss_stops_naming_the_step(tmp_path):
    out = run("reward.py", "--model", "tiny", "--max-steps", "6", "--batch-size", "8", "--log-every", "3",
              "--learning-rate", "1e30", "--warmup-steps", "1", "--eval-dataset", "",
              "--output-dir", str(tmp_path))
    assert out.returncode == 1 and "error: non-finite train/loss at step " in out.stderr, out.stderr[-2000:]
    assert not os.path.exists(tmp_path / "model")


def test_ppo_sigterm_then_resume_equals_uninterrupted(tmp_path):
    """Restored: policy and value params, the optimizer, the sampling key and the mini-batch
    shuffler; the resumed run samples the same responses (same scores, KL) and the sampler
    still compiles once."""
    flags = ["--model", "tiny", "--max-steps", "4", "--save-every", "2", "--batch-size", "8",
             "--response-length", "8", "--sample-every", "0", "--seed", "3"]
    clean, resumed, stopped = preempt_then_resume("ppo.py", flags, 2, tmp_path)
    assert 2 <= stopped < 4
    assert [r["step"] for r in clean] == [1, 2, 3, 4]
    assert_same_rows(clean, resumed)
    assert all(r["charts/generate_compilations"] == 1 for r in resumed)


def ppo_scores(output_dir):
    rows = metrics(output_dir)
    for k in ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
              "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
              "val/clipfrac_avg", "val/num_eos_tokens", "charts/generate_tokens_per_sec"):
        assert k in rows[-1], k
    assert rows[-1]["charts/generate_compilations"] == 1  # no recompilation after the first rollout
    return [r["objective/scores"] for r in rows]


def test_ppo_raises_toy_score_from_scratch(tmp_path):
    """`tiny` from random init rarely ends with EOS (score ≈ -0.9 after the missing-EOS
    penalty); PPO with the programmatic reward learns to stop within a few iterations."""
    out = run("ppo.py", "--model", "tiny", "--max-steps", "12", "--output-dir", str(tmp_path), env=one_device_env())
    assert out.returncode == 0, out.stderr[-2000:]
    scores = ppo_scores(str(tmp_path))
    assert np.mean(scores[-2:]) > scores[0] + 0.3, scores
    assert os.path.exists(tmp_path / "model" / "config.json")
    assert "sample:" in out.stdout + out.stderr  # decoded samples with their scores


def test_ppo_with_reward_model(reward_run, tmp_path):
    """--reward-model: scores from reward.py's model, value model initialised from it."""
    out = run("ppo.py", "--model", "tiny", "--reward-model", os.path.join(reward_run, "model"),
              "--max-steps", "2", "--batch-size", "16", "--output-dir", str(tmp_path), env=one_device_env())
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(ppo_scores(str(tmp_path))) == 2
