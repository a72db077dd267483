"""reward.py and ppo.py beyond their losses (those are in test_losses.py): response truncation,
one PPO update's direction on a real rollout, weight decay (ppo's and grpo's optimizers), KV-cached
sampling (== uncached greedy, compiled once), the CLIs, and learning on the toy task."""

import importlib
import json
import os

import numpy as np
import pytest

import common  # noqa: F401  (first: KERAS_BACKEND=jax)
import jax
import jax.numpy as jnp
import optax
import plumbing

from helpers import assert_same_rows, learning_env, metrics, preempt_then_resume, run_script as run
from ppo import (
    Args,
    Pair,
    PPOParams,
    advantages_of,
    generate,
    response_logps,
    rollout_stats,
    train_step,
    truncate_response,
)


# ---------------------------------------------------------------------------
# ppo.py: response processing and one update
# ---------------------------------------------------------------------------
def test_truncate_response_after_first_eos():
    eos, pad = 1, 0
    responses = jnp.array([[5, 1, 7, 1], [5, 6, 7, 8], [1, 9, 9, 9]])
    out, lengths = truncate_response(responses, eos, pad)
    np.testing.assert_array_equal(out, [[5, 1, 0, 0], [5, 6, 7, 8], [1, 0, 0, 0]])
    np.testing.assert_array_equal(lengths, [1, 3, 0])  # index of the EOS, or R-1 without one


def test_ppo_update_moves_logprobs_along_advantages():
    """One PPO epoch on a real rollout: tokens with positive advantage gain log-prob, negative lose. On one
    device: nothing here is sharded, and the 8 simulated devices compile slower."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    model = common.load_model("tiny", mesh, "float32", seed=0)
    bb = model.backbone
    params, frozen = common.split_variables(bb)
    head = {"weight": jnp.zeros((bb.hidden_dim, 1)), "bias": jnp.zeros(())}
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p))(PPOParams(params, params, head))
    models, frozen = Pair(bb, bb), Pair(frozen, frozen)  # the value model: a copy of the policy
    args = Args(learning_rate=1e-3, temperature=1.0, num_mini_batches=2)
    q, r = 8, 6
    rng = np.random.default_rng(0)
    queries = jnp.array(rng.integers(3, 300, (8, q)), jnp.int32)
    responses = jnp.array(rng.integers(3, 300, (8, r)), jnp.int32)
    batch = {
        "query_responses": jnp.concatenate([queries, responses], 1),
        "padding_mask": jnp.ones((8, q + r), bool),
        "response_mask": jnp.ones((8, r), bool),
    }
    lp, ref, values = rollout_stats(
        models, params, params.policy, frozen, batch, context_length=q, temperature=1.0
    )
    scores = jnp.array(rng.normal(size=8), jnp.float32)
    adv, ret, _ = advantages_of(scores, lp, ref, values, jnp.full((8,), r - 1), args=args)
    batch.update(logprobs=lp, values=values, advantages=adv, returns=ret)
    optimizer = optax.adam(1e-3)
    state = (params, optimizer.init(params))
    step = jax.jit(lambda s, f, b: train_step(models, optimizer, args, s, f, batch=b, context_length=q))
    state, m = step(state, frozen, batch)
    forward = jax.jit(
        lambda p, f, ids, m: response_logps(bb, p, f, ids, m, context_length=q, temperature=1.0)[:2]
    )  # see test_preference
    new_lp, _ = forward(state[0].policy, frozen.policy, batch["query_responses"], batch["padding_mask"])
    delta = np.asarray(new_lp - lp)
    assert np.sum(delta * np.asarray(adv)) > 0
    assert np.corrcoef(delta.ravel(), np.asarray(adv).ravel())[0, 1] > 0.3


@pytest.mark.parametrize("script", ["ppo", "grpo"])
def test_weight_decay_is_off_by_default_and_on_matrices_only(script):
    """--weight-decay (TRL's 0.0 by default) decays matrices only. With zero gradients Adam's step is 0,
    so what changes a weight is its decay alone: at the default nothing changes (optax.adamw's own default,
    1e-4 on every parameter, would shrink both), and at 0.1 the matrix shrinks by lr·0.1·w, the vector not."""
    module = importlib.import_module(script)
    lr = 0.1  # large, so that a decay of 1e-4 would move a float32 weight by many ulps
    params = {"matrix": jnp.full((4, 3), 2.0), "vector": jnp.full((3,), 2.0)}
    zeros = jax.tree.map(jnp.zeros_like, params)

    def one_update(**flags):
        optimizer, schedule, _ = plumbing.make_optimizer(module.Args(learning_rate=lr, **flags), 10)
        assert float(schedule(0)) == pytest.approx(lr)
        updates, _ = optimizer.update(zeros, optimizer.init(params), params)
        return jax.device_get(optax.apply_updates(params, updates))

    new = one_update()
    np.testing.assert_array_equal(new["matrix"], params["matrix"])
    np.testing.assert_array_equal(new["vector"], params["vector"])
    new = one_update(weight_decay=0.1)
    np.testing.assert_allclose(new["matrix"], params["matrix"] * (1 - lr * 0.1), rtol=1e-6)
    np.testing.assert_array_equal(new["vector"], params["vector"])


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
        queries[i, q - len(x) :], qmask[i, q - len(x) :] = x, True
    # as ppo.main does: values through one jit first, so they carry the mesh in their types
    # like every updated version of them will
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p))(params)
    eos, pad = tok.end_token_id, tok.pad_token_id
    settings = {"response_length": r, "temperature": 0.0, "stop_ids": eos, "pad_id": pad}
    gen = jax.jit(lambda p, qs, qm, k: generate(bb, p, frozen, qs, qm, key=k, **settings)[0])
    cached = np.asarray(gen(params, queries, qmask, jax.random.key(0)))

    seq, mask = (
        np.concatenate([queries, np.zeros((8, r), np.int32)], 1),
        np.concatenate([qmask, np.zeros((8, r), bool)], 1),
    )
    logits_fn = jax.jit(
        lambda s, m: bb.token_embedding(common.forward(bb, params, frozen, s, m)[0], reverse=True)
    )
    for t in range(r):  # uncached: the whole sequence again for each new token
        nxt = np.argmax(np.asarray(logits_fn(seq, mask))[:, q + t - 1], -1)
        seq[:, q + t], mask[:, q + t] = nxt, True
    np.testing.assert_array_equal(cached, truncate_response(seq[:, q:], eos, pad)[0])  # PAD after an EOS

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
    bad.write_text(
        '{"prompt": "Sort: 1 2", "chosen": " 1 2", "rejected": " 2 1"}\n{"prompt": "x", "chosen": 3, "rejected": "y"}\n'
    )
    out = run("reward.py", "--dataset", str(bad), "--output-dir", str(tmp_path / "r"))
    assert out.returncode == 2 and f"{bad}:2" in out.stderr and "chosen" in out.stderr, out.stderr


def test_reward_tokenizes_pairs_as_dpo(tmp_path):
    """reward.py scores what dpo.py trains on: the same prompt / response texts go to the
    tokenizer and the same ids come out. An implicit prompt splits with the space going to the
    responses ('Sort: 9 2' + ' 8 9' / ' 5 9'; reward.py's own os.path.commonprefix split gave
    'Sort: 9 2 ' + '8 9'), and chats render as dpo.py renders them."""
    import dpo
    import reward

    class Recording:  # the tiny tokenizer, keeping the texts it was given
        def __init__(self):
            self.inner = common.keras_hub.models.GemmaTokenizer(proto=common.TINY_TOKENIZER)
            self.start_token_id, self.end_token_id, self.texts = (
                self.inner.start_token_id,
                self.inner.end_token_id,
                [],
            )

        def tokenize(self, texts):
            self.texts.append(list(texts))
            return self.inner.tokenize(texts)

    turn = lambda role, text: {"role": role, "content": text}
    rows = [
        {"chosen": "Sort: 9 2 8 9", "rejected": "Sort: 9 2 5 9"},
        {
            "chosen": [turn("user", "Sort: 3 1"), turn("assistant", " 1 3")],
            "rejected": [turn("user", "Sort: 3 1"), turn("assistant", " 3 1")],
        },
        {
            "prompt": [turn("user", "Sort: 2 1")],
            "chosen": [turn("assistant", " 1 2")],
            "rejected": [turn("assistant", " 2 1")],
        },
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    triples = common.read_dataset(str(path), "preference", common.chat_template("tiny"))  # as both mains do
    assert triples[0] == ("Sort: 9 2", " 8 9", " 5 9")
    ours, theirs = Recording(), Recording()
    pairs, counts = reward.tokenize_pairs(triples, ours, 512, str(path))
    dpo_pairs, _ = dpo.tokenize_dataset(triples, theirs, 512, str(path))
    assert ours.texts == theirs.texts and ours.texts[0][:3] == ["Sort: 9 2", " 8 9", " 5 9"]
    assert counts == {"examples": 3, "truncated": 0, "dropped": 0}
    for (chosen, rejected), ((dpo_chosen, _), (dpo_rejected, _)) in zip(pairs, dpo_pairs, strict=True):
        np.testing.assert_array_equal(chosen, dpo_chosen)
        np.testing.assert_array_equal(rejected, dpo_rejected)


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
def test_reward_sigterm_then_resume_equals_uninterrupted(tmp_path):
    """--log-every 1: every row is one step, so the row the stopped run logs at its stop step is
    also a row of the uninterrupted run (with --log-every 5 it would average a partial interval)."""
    flags = [
        "--model",
        "tiny",
        "--max-steps",
        "20",
        "--save-every",
        "5",
        "--batch-size",
        "8",
        "--log-every",
        "1",
        "--eval-dataset",
        "",
        "--seed",
        "3",
    ]
    clean, resumed, stopped, _ = preempt_then_resume("reward.py", flags, 5, tmp_path, env=learning_env())
    assert 5 <= stopped < 20
    assert [r["step"] for r in clean] == list(range(1, 21))
    assert_same_rows(clean, resumed)
    assert resumed[-1]["train/loss"] == pytest.approx(clean[-1]["train/loss"], rel=1e-5)


def test_reward_nonfinite_loss_stops_naming_the_step(tmp_path):
    """In this process (the exit-1 line is test_reliability.py's, on sft.py): reward.main raises
    NonFiniteLoss naming the step, writes no model/, and gives SIGINT/SIGTERM back as they were."""
    import signal
    import plumbing
    import reward

    before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    args = plumbing.cli(
        reward.Args,
        [
            "--model",
            "tiny",
            "--max-steps",
            "6",
            "--batch-size",
            "8",
            "--log-every",
            "3",
            "--learning-rate",
            "1e30",
            "--warmup-steps",
            "1",
            "--eval-dataset",
            "",
            "--output-dir",
            str(tmp_path),
        ],
    )
    with pytest.raises(plumbing.NonFiniteLoss, match="non-finite train/loss at step [1-3];"):
        reward.main(args)
    assert not os.path.exists(tmp_path / "model") and os.path.exists(tmp_path / "metrics.jsonl")
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == before


@pytest.fixture(scope="module")
def ppo_with_rm(reward_run, tmp_path_factory):
    """ppo.py scored by reward.py's model (which also initialises the value model): 4 steps run
    uninterrupted and, beside it, stopped by SIGTERM after the step-2 checkpoint and resumed."""
    flags = [
        "--model",
        "tiny",
        "--reward-model",
        os.path.join(reward_run, "model"),
        "--max-steps",
        "4",
        "--save-every",
        "2",
        "--batch-size",
        "8",
        "--response-length",
        "8",
        "--sample-every",
        "0",
        "--seed",
        "3",
        *TINY_PPO,
    ]
    tmp_path = tmp_path_factory.mktemp("ppo_rm")
    return tmp_path / "clean", preempt_then_resume("ppo.py", flags, 2, tmp_path)


def test_ppo_sigterm_then_resume_equals_uninterrupted(ppo_with_rm):
    """Restored: policy and value params, the optimizer, the sampling key and the mini-batch
    shuffler; the resumed run samples the same responses (same scores, KL) and the sampler
    still compiles once."""
    _, (clean, resumed, stopped, _) = ppo_with_rm
    assert 2 <= stopped < 4
    assert [r["step"] for r in clean] == [1, 2, 3, 4]
    assert_same_rows(clean, resumed)
    assert all(r["charts/generate_compilations"] == 1 for r in resumed)


# `tiny` from scratch (the defaults are TRL's, for real models): the values these tests were measured with
TINY_PPO = [
    "--learning-rate",
    "3e-4",
    "--num-mini-batches",
    "2",
    "--missing-eos-penalty",
    "1.0",
    "--max-prompt-length",
    "64",
]


def ppo_scores(output_dir):
    rows = metrics(output_dir)
    for k in (
        "objective/kl",
        "objective/entropy",
        "objective/non_score_reward",
        "objective/rlhf_reward",
        "policy/approxkl_avg",
        "policy/clipfrac_avg",
        "loss/policy_avg",
        "loss/value_avg",
        "val/clipfrac_avg",
        "val/num_eos_tokens",
        "charts/generate_tokens_per_sec",
    ):
        assert k in rows[-1], k
    assert rows[-1]["charts/generate_compilations"] == 1  # no recompilation after the first rollout
    return [r["objective/scores"] for r in rows]


def test_ppo_raises_toy_score_from_scratch(tmp_path):
    """`tiny` from random init rarely ends with EOS (score ≈ -0.9 after the missing-EOS
    penalty); PPO with the programmatic reward learns to stop within 14 iterations (measured, seed 0:
    -0.885 at step 1, -0.370 and -0.197 at steps 13 and 14; the mean of the last two clears step 1 + 0.3 by
    0.30, 0.60 and 0.57 at seeds 0, 1, 2, where 10 steps cleared it by 0.04, -0.08 and 0.29)."""
    out = run(
        "ppo.py",
        "--model",
        "tiny",
        "--max-steps",
        "14",
        "--batch-size",
        "32",
        "--response-length",
        "16",
        *TINY_PPO,
        "--output-dir",
        str(tmp_path),
        env=learning_env(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    scores = ppo_scores(str(tmp_path))
    assert np.mean(scores[-2:]) > scores[0] + 0.3, scores
    assert os.path.exists(tmp_path / "model" / "config.json")
    assert "sample:" in out.stdout + out.stderr  # decoded samples with their scores
    last = out.stdout.strip().splitlines()[-1]  # plumbing.Run's summary line
    assert (
        last.startswith("done: 14 steps in ")
        and "objective/scores " in last
        and f"outputs in {tmp_path}" in last
    )


def test_ppo_with_reward_model(ppo_with_rm):
    """--reward-model: scores from reward.py's model, value model initialised from it."""
    out_dir, _ = ppo_with_rm
    assert len(ppo_scores(str(out_dir))) == 4
    assert (out_dir / "model" / "config.json").exists()


def test_ppo_resumes_on_the_mesh_after_a_failing_reward_function(tmp_path):
    """On 8 devices, in this process: a TRL-form reward function (reading the prompts' `answer`) that
    raises at the second rollout stops the run with a UsageError naming it, the step-1 checkpoint kept;
    fixed, --resume runs the step that failed, 2 (the restored sampling key is no longer committed to one
    device: on every multi-device run, ppo.py and grpo.py --resume failed there)."""
    import plumbing
    import ppo

    judge = tmp_path / "judge.py"
    judge.write_text(
        "calls = []\n\ndef judge(completions, answer, **kwargs):\n    calls.append(1)\n"
        "    assert len(calls) != 2, 'no verdict'\n"
        "    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]\n"
    )
    out = tmp_path / "run"
    argv = [
        "--model",
        "tiny",
        "--max-steps",
        "2",
        "--save-every",
        "1",
        "--batch-size",
        "16",
        "--response-length",
        "8",
        "--sample-every",
        "0",
        *TINY_PPO,
        "--reward-fn",
        f"{judge}:judge",
        "--output-dir",
        str(out),
    ]
    with pytest.raises(
        plumbing.UsageError, match=rf"reward function judge \({judge}:3\) raised AssertionError"
    ):
        ppo.main(plumbing.cli(ppo.Args, argv))
    assert sorted(os.listdir(out / "checkpoints")) == ["1"]
    judge.write_text(judge.read_text().replace("len(calls) != 2", "True"))
    ppo.main(plumbing.cli(ppo.Args, argv + ["--resume"]))
    assert [r["step"] for r in metrics(out)] == [1, 2] and (out / "model" / "config.json").exists()
