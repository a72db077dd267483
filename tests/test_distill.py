"""distill.py: the generalized JSD by hand (a 3-token vocabulary, β = 0, 0.5, 1, two temperatures) and in
float64 NumPy (random logits, masks, padding), its direction; the chunked projection against the full logits;
the start-up checks (a mismatched or reward-model teacher, β, τ: exit 2 before weights load); the CLI end to
end with SIGTERM + --resume; on the toy task, the divergence falling and a weak student's task score moving
toward its teacher's."""

import math
import os
from functools import partial

import numpy as np
import pytest

import common  # noqa: F401  (first: KERAS_BACKEND=jax)
import jax
import jax.numpy as jnp
import distill
import plumbing
import keras
from distill import distill_loss, generalized_jsd
from helpers import ROOT, assert_same_rows, preempt_then_resume, run_script, usage_error

log = math.log


# ---------------------------------------------------------------------------
# The loss: by hand, float64 NumPy, direction
# ---------------------------------------------------------------------------
# Logits 2·log(w): at τ = 2 the distributions are w / Σw, at τ = 1 they are w² / Σw².
STUDENT_LOGITS = [2 * log(2), 0.0, 0.0]  # τ = 2: p_S = (1/2, 1/4, 1/4);  τ = 1: (4/6, 1/6, 1/6)
TEACHER_LOGITS = [0.0, 2 * log(3), 2 * log(4)]  # τ = 2: p_T = (1/8, 3/8, 1/2);  τ = 1: (1/26, 9/26, 16/26)
BY_HAND = {
    # τ = 2.  β = 0: KL(p_T ‖ p_S) = Σ p_T log(p_T / p_S)
    (2.0, 0.0): 1 / 8 * log((1 / 8) / (1 / 2))
    + 3 / 8 * log((3 / 8) / (1 / 4))
    + 1 / 2 * log((1 / 2) / (1 / 4)),
    # β = 1: KL(p_S ‖ p_T) = Σ p_S log(p_S / p_T)
    (2.0, 1.0): 1 / 2 * log((1 / 2) / (1 / 8))
    + 1 / 4 * log((1 / 4) / (3 / 8))
    + 1 / 4 * log((1 / 4) / (1 / 2)),
    # β = 0.5: m = (p_S + p_T) / 2 = (5/16, 5/16, 6/16); ½·KL(p_T ‖ m) + ½·KL(p_S ‖ m)
    (2.0, 0.5): 0.5
    * (1 / 8 * log((1 / 8) / (5 / 16)) + 3 / 8 * log((3 / 8) / (5 / 16)) + 1 / 2 * log((1 / 2) / (6 / 16)))
    + 0.5
    * (1 / 2 * log((1 / 2) / (5 / 16)) + 1 / 4 * log((1 / 4) / (5 / 16)) + 1 / 4 * log((1 / 4) / (6 / 16))),
    # τ = 1: p_S = (4/6, 1/6, 1/6), p_T = (1/26, 9/26, 16/26)
    (1.0, 0.0): 1 / 26 * log((1 / 26) / (4 / 6))
    + 9 / 26 * log((9 / 26) / (1 / 6))
    + 16 / 26 * log((16 / 26) / (1 / 6)),
    (1.0, 1.0): 4 / 6 * log((4 / 6) / (1 / 26))
    + 1 / 6 * log((1 / 6) / (9 / 26))
    + 1 / 6 * log((1 / 6) / (16 / 26)),
    # m = (4/6 + 1/26, 1/6 + 9/26, 1/6 + 16/26) / 2
    (1.0, 0.5): 0.5
    * (
        1 / 26 * log((1 / 26) / ((4 / 6 + 1 / 26) / 2))
        + 9 / 26 * log((9 / 26) / ((1 / 6 + 9 / 26) / 2))
        + 16 / 26 * log((16 / 26) / ((1 / 6 + 16 / 26) / 2))
    )
    + 0.5
    * (
        4 / 6 * log((4 / 6) / ((4 / 6 + 1 / 26) / 2))
        + 1 / 6 * log((1 / 6) / ((1 / 6 + 9 / 26) / 2))
        + 1 / 6 * log((1 / 6) / ((1 / 6 + 16 / 26) / 2))
    ),
}


@pytest.mark.parametrize("temperature, beta", list(BY_HAND))
def test_generalized_jsd_by_hand_on_three_tokens(temperature, beta):
    s, t = jnp.array([STUDENT_LOGITS]), jnp.array([TEACHER_LOGITS])
    got = generalized_jsd(s, t, jnp.array([True]), beta, temperature)
    assert float(got[0]) == pytest.approx(BY_HAND[temperature, beta], rel=1e-5)
    assert float(generalized_jsd(s, t, jnp.array([False]), beta, temperature)[0]) == 0.0  # masked: nothing


def test_the_two_kls_differ_and_jsd_is_bounded_by_log_2():
    """The numbers above are not one number thrice: forward ≠ reverse here, and the JSD (β = ½) ≤ log 2."""
    assert (
        abs(BY_HAND[2.0, 0.0] - BY_HAND[2.0, 1.0]) > 0.09
        and abs(BY_HAND[1.0, 0.0] - BY_HAND[1.0, 1.0]) > 0.09
    )
    assert 0 < BY_HAND[2.0, 0.5] < log(2) and 0 < BY_HAND[1.0, 0.5] < log(2)


def jsd64(student_logits, teacher_logits, mask, beta, temperature):
    """Float64 NumPy from the definitions: probabilities, the mixture m as probabilities, the loss as TRL
    reduces it (Σ over completion tokens ÷ their count)."""

    def probs(x):
        z = np.exp(x / temperature - (x / temperature).max(-1, keepdims=True))
        return z / z.sum(-1, keepdims=True)

    ps, pt = probs(np.float64(student_logits)), probs(np.float64(teacher_logits))
    kl = lambda p, q: (p * (np.log(p) - np.log(q))).sum(-1)
    if beta == 0:
        d = kl(pt, ps)
    elif beta == 1:
        d = kl(ps, pt)
    else:
        m = (1 - beta) * ps + beta * pt
        d = beta * kl(pt, m) + (1 - beta) * kl(ps, m)
    return (d * mask).sum() / mask.sum(), d


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_distill_loss_matches_numpy_float64_with_masks_and_padding(beta, temperature):
    rng = np.random.default_rng(int(10 * beta + temperature * 7))
    b, r, v = 3, 7, 11
    s, t = rng.normal(0, 3, (b, r, v)), rng.normal(0, 3, (b, r, v))
    mask = np.arange(r)[None] < np.array([7, 4, 1])[:, None]  # completions of 7, 4 and 1 tokens, then padding
    want, per_token = jsd64(s, t, mask, beta, temperature)
    div = generalized_jsd(jnp.float32(s), jnp.float32(t), jnp.asarray(mask), beta, temperature)
    np.testing.assert_allclose(np.asarray(div), np.where(mask, per_token, 0.0), rtol=2e-5, atol=2e-6)
    loss, metrics = distill_loss(div, jnp.asarray(mask))
    assert float(loss) == pytest.approx(want, rel=2e-5) and float(metrics["train/loss"]) == float(loss)
    # padding holds anything (huge logits included): the loss is the same
    s_pad, t_pad = np.where(mask[..., None], s, 1e4), np.where(mask[..., None], t, -1e4)
    div_pad = generalized_jsd(jnp.float32(s_pad), jnp.float32(t_pad), jnp.asarray(mask), beta, temperature)
    assert float(distill_loss(div_pad, jnp.asarray(mask))[0]) == pytest.approx(float(loss), rel=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_divergence_is_zero_at_the_teacher_and_falls_along_the_student_gradient(beta):
    rng = np.random.default_rng(1)
    s, t = jnp.float32(rng.normal(0, 2, (4, 9))), jnp.float32(rng.normal(0, 2, (4, 9)))
    mask = jnp.array([True, True, True, False])
    loss = lambda x: distill_loss(generalized_jsd(x, t, mask, beta, 1.5), mask)[0]
    assert float(loss(t)) == pytest.approx(0.0, abs=1e-6)  # the student equals the teacher
    before = float(loss(s))
    grad = jax.grad(loss)(s)
    assert np.all(np.asarray(grad[3]) == 0.0)  # a masked position gets no gradient
    assert 0 < float(loss(s - 0.5 * grad)) < before  # a small step down the student's gradient lowers it


# ---------------------------------------------------------------------------
# The chunked projection through two tiny models (student seed 0, teacher seed 1: same tokenizer)
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair():
    """(student backbone, its (params, frozen), teacher backbone, its weights, a fixed batch: 4 prompts of the
    toy task + 8 random response tokens each, the last two responses padded after 5 and 2 tokens)."""
    mesh = common.make_mesh()
    student = common.load_model("tiny", mesh, "float32", seed=0)
    teacher = common.load_model("tiny", mesh, "float32", seed=1)
    tokenizer = student.preprocessor.tokenizer
    queries, query_mask = distill.tokenize_prompts(
        ["Sort: 3 1 2", "Sort: 9 8", "Sort: 5 5 0 1", "Sort: 7"], tokenizer, 64
    )
    responses = np.random.default_rng(0).integers(3, tokenizer.vocabulary_size(), (4, 8)).astype(np.int32)
    response_mask = np.arange(8)[None] < np.array([8, 8, 5, 2])[:, None]
    batch = {
        "query_responses": jnp.asarray(np.concatenate([queries, responses], 1)),
        "padding_mask": jnp.asarray(np.concatenate([query_mask, response_mask], 1)),
        "response_mask": jnp.asarray(response_mask),
    }
    return (
        student.backbone,
        common.split_variables(student.backbone),
        teacher.backbone,
        common.split_variables(teacher.backbone),
        batch,
        queries.shape[1],
    )


def test_chunked_projection_equals_the_full_logits(pair, monkeypatch):
    """completion_divergence in chunks of 3 (--logits-chunk 3; 8 positions: the last chunk padded) == in one
    chunk == the divergence of the full [B, R, V] logits of both models; and so do the gradients."""
    backbone, (params, frozen), teacher, weights, batch, q = pair
    ids, pad, mask = batch["query_responses"], batch["padding_mask"], batch["response_mask"]

    def full(p):  # every logit materialised: the reference
        out = []
        for bb, (pp, ff) in ((backbone, (p, frozen)), (teacher, weights)):
            hidden = common.forward(bb, pp, ff, ids, pad)[0][:, q - 1 : -1]  # position Q+i-1 predicts token i
            with keras.StatelessScope(
                state_mapping=list(zip(bb.trainable_variables + bb.non_trainable_variables, pp + ff))
            ):
                out.append(common.logits(bb, hidden))
        return generalized_jsd(out[0], out[1], mask, 0.5, 1.3)

    def chunked(p, chunk):
        monkeypatch.setattr(backbone, "logits_chunk", chunk, raising=False)  # read when traced
        return distill.completion_divergence(
            backbone,
            p,
            frozen,
            teacher,
            weights,
            token_ids=ids,
            padding_mask=pad,
            response_mask=mask,
            context_length=q,
            beta=0.5,
            temperature=1.3,
        )[0]

    want = jax.jit(full)(params)
    assert float(jnp.abs(want).max()) > 0.1  # two different models: a divergence to compare
    for chunk in (3, 8):
        got = jax.jit(chunked, static_argnums=1)(params, chunk)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    loss = lambda f: jax.jit(jax.grad(lambda p: distill_loss(f(p), mask)[0]))
    g_full, g_chunk = loss(full)(params), loss(lambda p: chunked(p, 3))(params)
    for a, b in zip(g_full, g_chunk):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)


def test_a_bfloat16_teacher_is_held_in_half_the_bytes_and_grades_alike(pair, monkeypatch):
    """--teacher-dtype bfloat16 (common.split_variables, every weight frozen): every floating teacher array held
    in bfloat16 (half the bytes, layout kept), its variables' buffers replaced, and the divergence within
    bfloat16's rounding of the float32 teacher's (a relative step of 2^-8)."""
    backbone, (params, frozen), _, weights, batch, q = pair
    teacher = common.load_model("tiny", common.make_mesh(), "float32", seed=1).backbone  # its own: recast
    held = common.split_variables(teacher, frozen_dtype="bfloat16", all_frozen=True)
    arrays, f32 = jax.tree.leaves(held), jax.tree.leaves(weights)
    assert all(a.dtype == jnp.bfloat16 and a.sharding == b.sharding for a, b in zip(arrays, f32))
    assert sum(a.nbytes for a in arrays) * 2 == sum(b.nbytes for b in f32)
    assert all(v.value.dtype == jnp.bfloat16 for v in teacher.weights)
    ids, pad, mask = batch["query_responses"], batch["padding_mask"], batch["response_mask"]
    monkeypatch.setattr(backbone, "logits_chunk", 4, raising=False)
    settings = {"beta": 1.0, "temperature": 1.0}
    inputs = {"token_ids": ids, "padding_mask": pad, "response_mask": mask, "context_length": q}
    grade = jax.jit(
        lambda w: distill.completion_divergence(backbone, params, frozen, teacher, w, **inputs, **settings)[0]
    )
    want, got = np.asarray(grade(weights)), np.asarray(grade(held))
    assert np.abs(want).max() > 0.1 and not np.array_equal(got, want)  # rounded, so not bit-equal
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.02)


def test_student_divergence_falls_on_a_fixed_batch_and_the_teacher_stays(pair):
    """Three updates on the same completions lower the divergence (reverse KL, TRL's default β = 1); the
    teacher's weights are an input only: unchanged."""
    backbone, (params, frozen), teacher, weights, batch, q = pair
    args = distill.Args(teacher_model="tiny", learning_rate=3e-3, logits_chunk=4)
    optimizer, _, _ = plumbing.make_optimizer(args, 10)
    state = (jax.tree.map(jnp.copy, params), optimizer.init(params))

    @jax.jit
    def step(s, f, b, w):
        return distill.train_step(
            backbone, optimizer, args, s, f, batch=b, context_length=q, teacher=teacher, teacher_weights=w
        )

    before = [np.asarray(w) for w in weights[0]]
    losses = []
    for _ in range(4):
        state, metrics = step(state, frozen, batch, weights)
        losses.append(float(metrics["train/loss"]))
        assert float(metrics["entropy"]) > 0
    assert losses[0] > 0 and losses[3] < losses[2] < losses[1] < losses[0], losses
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, weights[0]))


# ---------------------------------------------------------------------------
# Start-up checks: exit 2 in one line, before any weights load
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_vocabulary(tmp_path_factory):
    """A Qwen-style preset dir whose byte-level BPE tokenizer is not the tiny one, with its config.json and
    no weights at all: a script that loaded any before checking would fail otherwise."""
    import keras_hub
    from helpers import byte_bpe

    out = tmp_path_factory.mktemp("bpe_teacher")
    vocabulary, merges = byte_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    keras_hub.models.QwenBackbone(
        vocabulary_size=len(vocabulary),
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
    ).save_to_preset(str(out))
    keras_hub.models.QwenTokenizer(vocabulary=vocabulary, merges=merges).save_to_preset(str(out))
    os.remove(out / "model.weights.h5")
    return str(out), len(vocabulary)


def test_a_teacher_with_another_vocabulary_exits_2_before_any_weights_load(other_vocabulary, tmp_path):
    teacher, size = other_vocabulary
    out = run_script("distill.py", "--teacher-model", teacher, "--output-dir", str(tmp_path / "o"))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith(
        f"error: --teacher-model {teacher}: its tokenizer's vocabulary ({size} tokens) is not --model tiny's"
    ), lines
    assert not (tmp_path / "o").exists()


def test_vocabularies_are_compared_by_their_tokens_not_their_sizes(monkeypatch, tmp_path):
    """Two vocabularies of one size that differ in one token: refused, naming the first id that differs."""
    tiny = common.vocabulary("tiny")
    swapped = tiny[:5] + [tiny[6], tiny[5]] + tiny[7:]
    monkeypatch.setattr(common, "vocabulary", lambda name: tiny if name == "tiny" else swapped)
    message = usage_error(distill, "--teacher-model", str(tmp_path), "--output-dir", str(tmp_path / "o"))
    assert f"({len(tiny)} tokens) is not --model tiny's ({len(tiny)}; they differ from id 5)" in message


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--beta", "1.5"], "--beta 1.5 must be in [0, 1]"),
        (["--beta", "-0.1"], "--beta -0.1 must be in [0, 1]"),
        (["--temperature", "0"], "--temperature 0.0 > 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        ([], "--teacher-model is required"),
    ],
)
def test_flags_out_of_range_are_refused(flags, message, tmp_path):
    teacher = [] if not flags else ["--teacher-model", "tiny"]
    assert message in usage_error(distill, *teacher, *flags, "--output-dir", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_a_reward_model_teacher_is_refused(tmp_path):
    (tmp_path / "reward_head.npz").write_bytes(b"")  # reward.py's head beside the backbone: a reward model
    message = usage_error(distill, "--teacher-model", str(tmp_path), "--output-dir", str(tmp_path / "o"))
    assert message.endswith(
        "a reward model (reward.py's); the teacher is a causal LM whose next-token "
        "distributions the student learns"
    )


# ---------------------------------------------------------------------------
# The CLI end to end: a saved teacher, SIGTERM + --resume, the outputs
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A teacher (tiny, seed 1: the pair's) saved as a model dir; the tiny student (seed 0) distilled from it with
    LoRA for 4 steps uninterrupted and, beside it, stopped by SIGTERM after the step-2 checkpoint and resumed."""
    tmp_path = tmp_path_factory.mktemp("distill")
    teacher = common.load_model("tiny", common.make_mesh(), "float32", seed=1)
    common.save_model(teacher, common.split_variables(teacher.backbone)[0], str(tmp_path / "teacher"))
    flags = [
        "--model",
        "tiny",
        "--teacher-model",
        str(tmp_path / "teacher"),
        "--max-steps",
        "4",
        "--save-every",
        "2",
        "--batch-size",
        "8",
        "--response-length",
        "8",
        "--max-prompt-length",
        "64",
        "--learning-rate",
        "1e-3",
        "--lora-rank",
        "4",
        "--beta",
        "0.5",
        "--logits-chunk",
        "3",
        "--sample-every",
        "2",
    ]
    return tmp_path / "clean", preempt_then_resume("distill.py", flags, 2, tmp_path)


def test_sigterm_then_resume_equals_uninterrupted(resumed):
    out_dir, (clean, cut, stopped, stdout) = resumed
    assert 2 <= stopped < 4
    assert [r["step"] for r in clean] == [1, 2, 3, 4]
    assert_same_rows(clean, cut)
    for k in (
        "train/loss",
        "entropy",
        "train/grad_norm",
        "completions/mean_length",
        "completions/truncated_fraction",
        "charts/generated_tokens",
        "charts/padding_fraction",
        "charts/learning_rate",
        "mismatch/ratio_mean",
        "mismatch/frac_outside_10pct",
    ):
        assert k in clean[-1], k  # (tokens/s and MFU too: helpers drop timing metrics before comparing)
    assert all(r["train/loss"] > 0 for r in clean)
    assert all(abs(r["mismatch/ratio_mean"] - 1) < 1e-2 for r in clean)  # the update scores what was sampled
    assert "sample:" in stdout and (out_dir / "model" / "config.json").exists()
    assert not (out_dir / "model" / "reward_head.npz").exists()


# ---------------------------------------------------------------------------
# Learning on the toy task: a weak student distilled toward a stronger teacher (in this process, one device)
# ---------------------------------------------------------------------------
def test_distillation_moves_a_weak_student_toward_its_teacher_on_the_toy_task():
    """One short SFT run of `tiny` on data/sft_train.jsonl (30 steps of 32 at 5e-3) makes both models: the
    teacher its end, the student its step-10 weights (one tokenizer, one init). 12 distillation steps (32 train
    prompts each, reverse KL, 2e-3): the divergence falls and the student's greedy task score on 64 test
    prompts moves toward the teacher's. Measured: teacher 0.311, student 0.052 -> 0.250, the divergence
    0.34 -> 0.13 (the first three steps' mean, then the last three's). A zero gradient leaves the student
    where it was: the test fails."""
    import sft

    batch_score = common.load_reward_fn(os.path.join(ROOT, "data", "toy.py") + ":batch_score")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    model = common.load_model("tiny", mesh, "float32", seed=0)
    backbone, tokenizer, template = model.backbone, model.preprocessor.tokenizer, common.chat_template("tiny")
    rows = common.read_dataset(os.path.join(ROOT, "data", "sft_train.jsonl"), "sft", template)
    data = sft.pad_examples(sft.tokenize_dataset(rows, tokenizer, 32, True, "sft_train.jsonl")[0], 32)
    sft_args = sft.Args(
        batch_size=32, learning_rate=5e-3, warmup_steps=5, lr_scheduler_type="cosine_with_min_lr"
    )
    optimizer = plumbing.make_optimizer(sft_args, 30)[0]
    params, frozen = common.split_variables(backbone)
    state, sft_step = (
        (params, optimizer.init(params)),
        jax.jit(partial(sft.train_step, backbone, optimizer, sft_args)),
    )
    for step in range(30):
        state = sft_step(state, frozen, sft.get_batch(data, data["padding_mask"].sum(-1), step, sft_args)[0])[
            0
        ]
        if step == 9:
            student = jax.tree.map(jnp.copy, state[0])
    teacher = (state[0], frozen)

    stops, pad, on_data = (
        common.stop_token_ids(tokenizer, template, ()),
        tokenizer.pad_token_id,
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
    )

    def sampler(temperature):
        settings = {"response_length": 12, "temperature": temperature, "stop_ids": stops, "pad_id": pad}
        return jax.jit(partial(distill.generate, backbone, **settings))

    greedy, sample = sampler(0.0), sampler(1.0)
    test_prompts = common.read_prompts(os.path.join(ROOT, "data", "prompts_test.jsonl"), template)[0][:64]
    queries, query_mask = distill.tokenize_prompts(test_prompts, tokenizer, 64)

    def score(p):  # the mean greedy task score on the test prompts (data/toy.py:score, partial credit)
        batch, lengths = distill.rollout(
            greedy,
            p,
            frozen,
            queries,
            query_mask,
            key=jax.random.key(0),
            stop_ids=stops,
            pad_id=pad,
            on_data=on_data,
        )
        texts = common.decode_completions(tokenizer, batch, lengths, common.query_length(batch), stops)[0]
        return float(np.mean(batch_score(test_prompts, texts)))

    args = distill.Args(
        teacher_model="tiny", learning_rate=2e-3, warmup_steps=0, response_length=12, logits_chunk=16
    )
    optimizer = plumbing.make_optimizer(args, 12)[0]

    # the teacher is a `tiny` too: one backbone serves both models, the teacher's weights an input (tw)
    @jax.jit
    def step_fn(s, f, b, tw):
        return distill.train_step(
            backbone,
            optimizer,
            args,
            s,
            f,
            batch=b,
            context_length=common.query_length(b),
            teacher=backbone,
            teacher_weights=tw,
        )

    train_prompts = common.read_prompts(os.path.join(ROOT, "data", "prompts_train.jsonl"), template)[0][
        : 12 * 32
    ]
    train_queries, train_mask = distill.tokenize_prompts(train_prompts, tokenizer, 64)
    state, key, losses = (student, optimizer.init(student)), jax.random.key(1), []
    for step in range(12):
        key, gen_key = jax.random.split(key)
        idx = slice(32 * step, 32 * (step + 1))
        batch, _ = distill.rollout(
            sample,
            state[0],
            frozen,
            train_queries[idx],
            train_mask[idx],
            key=gen_key,
            stop_ids=stops,
            pad_id=pad,
            on_data=on_data,
        )
        state, metrics = step_fn(state, frozen, batch, teacher)
        losses.append(float(metrics["train/loss"]))
    before, after, target = score(student), score(state[0]), score(teacher[0])
    assert target > before + 0.15, (before, target)  # a gap to close
    assert after > before + 0.1 and after <= target + 0.05, (before, after, target)
    assert np.mean(losses[-3:]) < 0.6 * np.mean(losses[:3]), losses
