"""The samplers of grpo.py, ppo.py and rloo.py (each script keeps its own; evaluate.py imports grpo.py's):
stopping once every sequence has sampled its EOS gives, for the same key, the tokens of the fixed-length
sampler it replaced (kept below as the reference), ends before R, and compiles once; the sampling filters
(grpo.py's and rloo.py's filter_logits: top-k, then top-p, then min-p) keep the tokens worked out by hand
here and by a float64 NumPy re-derivation of transformers' warpers; and evaluate.py's responses to the
bundled prompts are grpo.py's sampler's."""

import functools
import importlib

import numpy as np
import pytest

import common  # first: KERAS_BACKEND=jax
import jax
import jax.numpy as jnp
import keras

SCRIPTS = ("grpo", "ppo", "rloo")  # evaluate.py's is grpo.py's (test_evaluate_samples_with_grpos_sampler)
FILTERING = (
    "grpo",
    "rloo",
    "ppo",
)  # ppo.py samples at temperature only, as TRL's PPOConfig, with the same functions


# ---------------------------------------------------------------------------
# filter_logits: hand-computed cases and a float64 re-derivation
# ---------------------------------------------------------------------------
P5 = np.array([0.05, 0.40, 0.10, 0.25, 0.20])  # token i's probability; sorted: 1 (0.40), 3, 4, 2, 0 (0.05)


@pytest.mark.parametrize("script", FILTERING)
@pytest.mark.parametrize(
    "flags, kept",
    [
        ({}, [0, 1, 2, 3, 4]),  # every filter off
        ({"top_k": 2}, [1, 3]),  # the two largest: 0.40, 0.25
        ({"top_k": 1}, [1]),
        # top-p drops the least likely tokens while their summed probability stays ≤ 1 − p = 0.2:
        # 0.05 (token 0), 0.05 + 0.10 = 0.15 (token 2); 0.15 + 0.20 = 0.35 > 0.2, so token 4 stays
        # (0.40 + 0.25 = 0.65 < 0.8, + 0.20 = 0.85 ≥ 0.8: the token that crosses p is kept)
        ({"top_p": 0.8}, [1, 3, 4]),
        ({"top_p": 0.6}, [1, 3]),  # dropped while ≤ 0.4: 0.05, 0.15, 0.35; 0.60 > 0.4
        ({"min_p": 0.2}, [1, 2, 3, 4]),  # p ≥ 0.2 × 0.40 = 0.08: only 0.05 is below
        ({"min_p": 0.6}, [1, 3]),  # p ≥ 0.6 × 0.40 = 0.24
        # all three, in transformers' order: top-k leaves 0.40, 0.25, renormalised 0.40 / 0.65 = 0.615 and
        # 0.385; top-p 0.8 drops while ≤ 0.2: nothing (0.385 > 0.2); min-p: 0.2 × 0.615 = 0.123 < 0.385
        ({"top_k": 2, "top_p": 0.8, "min_p": 0.2}, [1, 3]),
        # top-p after top-k sees the renormalised 0.385 ≤ 1 − 0.6 = 0.4 and drops it; on the whole
        # distribution (the row above) top-p 0.6 keeps token 3: the order matters
        ({"top_k": 2, "top_p": 0.6}, [1]),
        (
            {"top_k": 2, "min_p": 0.7},
            [1],
        ),  # 0.7 × 0.615 = 0.431 > 0.385 (a ratio to the top: 0.7 × 0.40 > 0.25)
    ],
)
def test_filter_logits_keeps_the_hand_computed_tokens(script, flags, kept):
    filter_logits = importlib.import_module(script).filter_logits
    logits = np.log(np.stack([P5, P5[::-1]])).astype(np.float32) + np.float32([[0.0], [3.0]])  # [B=2, V=5]
    out = np.asarray(filter_logits(jnp.asarray(logits), **flags))
    for i, keep in enumerate([kept, sorted(4 - j for j in kept)]):  # row 2: P5 reversed, logits shifted by 3
        assert np.flatnonzero(np.isfinite(out[i])).tolist() == keep
        np.testing.assert_array_equal(out[i, keep], logits[i, keep])  # what is kept is left as it was
    # sampling renormalises over what is kept: softmax of the filtered logits = P5 restricted, ÷ its sum
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(out[0]))[kept], P5[kept] / P5[kept].sum(), rtol=1e-6)


def softmax64(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def transformers_filters64(logits, top_k, top_p, min_p):
    """transformers' TopK, TopP and MinP warpers in float64, in its order: sort, cumulative sum from the
    least likely, scatter the removals back; min-p against the top probability."""
    x = logits.astype(np.float64)
    if top_k:
        x = np.where(x < np.sort(x, -1)[:, -top_k][:, None], -np.inf, x)
    if top_p < 1.0:
        order = np.argsort(x, -1)  # ascending
        remove = np.cumsum(softmax64(np.take_along_axis(x, order, -1)), -1) <= 1 - top_p
        remove[:, -1] = False  # min_tokens_to_keep = 1
        unsorted = np.zeros_like(remove)
        np.put_along_axis(unsorted, order, remove, -1)
        x = np.where(unsorted, -np.inf, x)
    if min_p is not None:
        p = softmax64(x)
        x = np.where(p < min_p * p.max(-1, keepdims=True), -np.inf, x)
    return x


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [(0, 0.9, None), (10, 1.0, None), (0, 1.0, 0.1), (20, 0.7, 0.05), (5, 0.95, 0.3), (0, 0.3, None)],
)
def test_filter_logits_matches_a_float64_numpy_rederivation(top_k, top_p, min_p):
    import grpo

    logits = np.random.default_rng(0).normal(0, 2, (32, 64)).astype(np.float32)  # [B, V], no ties
    out = np.asarray(grpo.filter_logits(jnp.asarray(logits), top_k, top_p, min_p))
    ref = transformers_filters64(logits, top_k, top_p, min_p)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
    np.testing.assert_array_equal(out[np.isfinite(out)], logits[np.isfinite(out)])
    assert (
        1 <= np.isfinite(out).sum(1).min() and np.isfinite(out).sum(1).max() < 64
    )  # every row filtered, none empty


@pytest.mark.parametrize("filters", [{}, {"top_k": 3}, {"top_p": 0.7}])
def test_the_draw_is_jax_random_categoricals(filters):
    """common.categorical, every sampler's draw: for final hidden states and a key, the tokens
    jax.random.categorical(key, filter(logits / T)) draws (ties at the max: the first index, as its arg-max), and
    log q = log softmax(filter(logits / T))[token], against a float64 NumPy log-softmax."""
    import grpo

    model = common.load_model("tiny", common.make_mesh(None), "float32", seed=0)
    backbone, (params, frozen) = model.backbone, common.split_variables(model.backbone)
    hidden = jax.random.normal(jax.random.key(3), (64, backbone.hidden_dim))
    keep = functools.partial(grpo.filter_logits, **filters) if filters else None
    with common.weights(backbone, params, frozen):
        kept = (keep or (lambda x: x))(common.logits(backbone, hidden) / 0.7)  # [B, V]
        for seed in range(3):
            key = jax.random.key(seed)
            token, logq = jax.jit(lambda h, k: common.categorical(backbone, h, k, 0.7, keep))(hidden, key)
            np.testing.assert_array_equal(token, jax.random.categorical(key, kept))
            z = np.asarray(kept, np.float64)
            log_softmax = z - (np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1))[:, None]
            np.testing.assert_allclose(logq, log_softmax[np.arange(64), np.asarray(token)], atol=2e-6)
    assert len(set(np.asarray(token).tolist())) > 5  # sampled, not one token
    tie = jnp.array([[0.0, 3.0, 3.0, 1.0], [jnp.nan, 0.0, 5.0, 5.0], [2.0, 2.0, 2.0, 2.0]])
    np.testing.assert_array_equal(common.first_max(tie), [1, 4, 0])  # the first max; a NaN row: V


# ---------------------------------------------------------------------------
# generate: stops early, same tokens as the fixed-length sampler, compiled once
# ---------------------------------------------------------------------------
def fixed_length_generate(backbone, params, frozen, queries, query_mask, key, response_length, temperature):
    """The sampler the scripts had before early stopping: prefill, then a `lax.scan` over all R steps,
    one key split per step; tokens after an EOS are sampled too (truncate_response cuts them)."""
    b, q = queries.shape
    padding_mask = jnp.concatenate([query_mask, jnp.ones((b, response_length), bool)], 1)
    state = zip(backbone.trainable_variables + backbone.non_trainable_variables, params + frozen)
    with keras.StatelessScope(state_mapping=state):
        cache = common.empty_cache(backbone, b, q + response_length)
        logits, cache = common.cached_forward(backbone, queries, padding_mask, cache, 0)

        def step(carry, _):
            logits, cache, index, key = carry
            key, sample_key = jax.random.split(key)
            token = jax.random.categorical(sample_key, logits / temperature).astype(jnp.int32)
            logits, cache = common.cached_forward(backbone, token[:, None], padding_mask, cache, index)
            return (logits[:, -1], cache, index + 1, key), token

        _, tokens = jax.lax.scan(
            step, (logits[:, -1], cache, jnp.int32(q), key), None, length=response_length
        )
    return tokens.T


@pytest.fixture(scope="module")
def tiny():
    """`tiny` (random init, seed 0), its values as the scripts pass them, and 8 left-padded prompts."""
    model = common.load_model("tiny", common.make_mesh(None), "float32", seed=0)
    params, frozen = common.split_variables(model.backbone)
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p))(params)  # as main does: committed, with the mesh
    tok = model.preprocessor.tokenizer
    prompts = ["Sort: 3 1 2", "Sort: 9 8 7 6 5 4", "Sort: 1", "Sort: 5 5 0 2"] * 2
    ids = [[tok.start_token_id] + list(x) for x in tok.tokenize(prompts)]
    queries, query_mask = np.zeros((8, 16), np.int32), np.zeros((8, 16), bool)
    for i, x in enumerate(ids):
        queries[i, 16 - len(x) :], query_mask[i, 16 - len(x) :] = x, True
    return model.backbone, params, frozen, queries, query_mask, tok.end_token_id, tok.pad_token_id


EOS_BIAS = (
    4.0  # added to the EOS logit: random `tiny` then ends its sequences within ~16 tokens, at varied steps
)


def with_eos_bias(monkeypatch, eos):
    """Every sampler's logits come from common.logits (inside common.cached_forward): EOS_BIAS on the EOS."""
    logits = common.logits
    monkeypatch.setattr(
        common, "logits", lambda bb, h, raw=False: logits(bb, h, raw).at[..., eos].add(EOS_BIAS)
    )


@pytest.fixture(scope="module")
def fixed_length_tokens(tiny):
    """[the fixed-length sampler's tokens [8, R] for batch k (rows rolled by k, key k) for k in 0, 1] under
    EOS_BIAS, R = 64: the reference each script's sampler is checked against, sampled once for all three."""
    backbone, params, frozen, queries, query_mask, eos, _ = tiny
    old = jax.jit(lambda p, qs, qm, k: fixed_length_generate(backbone, p, frozen, qs, qm, k, 64, 1.0))
    with pytest.MonkeyPatch.context() as monkeypatch:
        with_eos_bias(monkeypatch, eos)
        return [
            old(params, np.roll(queries, k, 0), np.roll(query_mask, k, 0), jax.random.key(k))
            for k in range(2)
        ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_early_stop_samples_the_fixed_length_tokens_and_ends_when_all_have_ended(
    script, tiny, fixed_length_tokens, monkeypatch
):
    module = importlib.import_module(script)
    backbone, params, frozen, queries, query_mask, eos, pad = tiny
    with_eos_bias(monkeypatch, eos)
    r = 64
    settings = {"response_length": r, "temperature": 1.0, "stop_ids": eos, "pad_id": pad}
    new = jax.jit(lambda p, qs, qm, k: module.generate(backbone, p, frozen, qs, qm, key=k, **settings))
    ends = []
    for k in range(2):  # two batches of one shape: other prompts (rows rolled), another key
        qs, qm, key = np.roll(queries, k, 0), np.roll(query_mask, k, 0), jax.random.key(k)
        tokens, steps = jax.device_get(new(params, qs, qm, key))[:2]  # grpo, ppo, rloo: and their log q
        expected, first_eos = jax.device_get(module.truncate_response(fixed_length_tokens[k], eos, pad))
        # the same tokens up to and with each EOS, PAD after it: what truncate_response made of them before
        np.testing.assert_array_equal(tokens, expected)
        assert (tokens == eos).any(1).all() and len(set(first_eos)) > 2  # all ended, at different steps
        assert steps == first_eos.max() + 1 < r  # the loop stopped at the last EOS, long before R
        ends.append(int(steps))
    assert ends[0] != ends[1]  # the two batches ran different numbers of steps ...
    assert new._cache_size() == 1  # ... in one compiled program


@pytest.mark.parametrize("script", ("grpo", "rloo"))
def test_a_group_prefills_its_prompt_once_and_samples_the_same_tokens(script, tiny, monkeypatch):
    """generate(group=G), as the scripts call it on B/G prompts of G rows each: every prompt prefilled once,
    its cache and logits copied to its rows, gives group=1's tokens and steps for the same rows and key, and
    its log q to float32 rounding (the prefill's matmuls over B/G rows, not B, round apart in the last bit:
    ≤ 2e-6 here). On the 8-device mesh, 4 prompts of 4 rows: a group spans two devices, and the 4
    prefilled prompts do not divide over 8."""
    module = importlib.import_module(script)
    backbone, params, frozen, queries, query_mask, eos, pad = tiny
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    on_data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    rows = np.repeat([0, 1, 2, 3], 4)  # [16]: prompts of 4, 7, 2 and 5 tokens (left-padded), 4 rows each
    qs, qm = common.put_global(queries[rows], on_data), common.put_global(query_mask[rows], on_data)
    settings = {"response_length": 12, "temperature": 1.0, "stop_ids": eos, "pad_id": pad, "top_p": 0.9}
    forward, calls = common.cached_forward, []  # the [rows, positions] of each forward, as traced
    monkeypatch.setattr(
        common, "cached_forward", lambda bb, x, *a, **k: calls.append(x.shape) or forward(bb, x, *a, **k)
    )
    out = {}
    for g in (1, 4):
        sample = jax.jit(functools.partial(module.generate, backbone, group=g, **settings))
        out[g] = jax.device_get(sample(params, frozen, qs, qm, jax.random.key(3)))
    assert calls == [(16, 16), (16, 1), (4, 16), (16, 1)]  # prefill, step; group 4: the prefill on 4 rows
    (tokens, steps, logq), (tokens1, steps1, logq1) = out[4], out[1]  # [16, 12], (), [16, 12]
    np.testing.assert_array_equal(tokens, tokens1)
    assert steps == steps1 == 12
    np.testing.assert_allclose(logq, logq1, rtol=0, atol=1e-5)
    assert (logq1 != 0).mean() > 0.9  # sampled tokens (log q 0: after a row's end)
    assert len({tuple(t) for t in tokens}) > 8  # a group's rows differ: its cache is copied, not its draw


def test_the_fused_draw_samples_the_plain_draws_tokens(tiny, monkeypatch):
    """On one TPU chip (tpu_kernels.on_chip, made true here: the kernel runs in Pallas' interpreter) the sampler
    draws through tpu_kernels.categorical, the output layer and the draw in one kernel, when no filter is on:
    its tokens and steps are the plain draw's for the same key, its log q the same to float32 rounding (its
    log-sum-exp is taken block by block). With top-p on, the plain draw runs (its sort needs the logits)."""
    import grpo
    import tpu_kernels

    backbone, params, frozen, queries, query_mask, eos, pad = tiny
    categorical, shapes = tpu_kernels.categorical, []
    monkeypatch.setattr(
        tpu_kernels, "categorical", lambda *a, **k: shapes.append(a[1].shape) or categorical(*a, **k)
    )
    out = {}
    for fused, top_p in ((False, 1.0), (True, 1.0), (True, 0.9)):
        monkeypatch.setattr(tpu_kernels, "on_chip", lambda backbone, fused=fused: fused)
        settings = {"response_length": 12, "temperature": 0.8, "stop_ids": eos, "pad_id": pad, "top_p": top_p}
        sample = jax.jit(functools.partial(grpo.generate, backbone, **settings))
        out[fused, top_p] = jax.device_get(sample(params, frozen, queries, query_mask, jax.random.key(5)))
    assert shapes == [(8, 192), (8, 192)]  # the first token's draw and the loop's: the kernel's, once each
    (tokens, steps, logq), (plain, plain_steps, plain_logq) = out[True, 1.0], out[False, 1.0]
    np.testing.assert_array_equal(tokens, plain)
    assert steps == plain_steps and (logq != 0).mean() > 0.5
    np.testing.assert_allclose(logq, plain_logq, rtol=0, atol=1e-5)
    assert not (out[True, 0.9][0] == plain).all()  # top-p 0.9 draws from another distribution


@pytest.mark.parametrize(
    "script, flags",
    [("grpo", {"top_k": 1}), ("grpo", {"top_p": 1e-6}), ("grpo", {"min_p": 1.0}), ("rloo", {"top_k": 1})],
)
def test_a_filter_that_keeps_one_token_samples_the_greedy_tokens(script, flags, tiny):
    module = importlib.import_module(script)
    backbone, params, frozen, queries, query_mask, eos, pad = tiny

    def gen(t, **f):  # the tokens sampled at temperature t with the filters f
        settings = {"response_length": 8, "temperature": t, "stop_ids": eos, "pad_id": pad, **f}
        sample = jax.jit(lambda p, qs, qm, k: module.generate(backbone, p, frozen, qs, qm, key=k, **settings))
        return jax.device_get(sample(params, queries, query_mask, jax.random.key(1))[0])

    np.testing.assert_array_equal(gen(1.0, **flags), gen(0.0))


def test_evaluate_samples_with_grpos_sampler():
    """evaluate.py has no sampler of its own: grpo.py's functions, and on the bundled held-out prompts its
    queries and sampled (top-k, top-p) responses are those grpo.py's sampler gives for the same
    prompts and key (batch i: fold_in(key, i); evaluate cuts a batch to its bucket, which samples the same
    tokens: tests/test_compare.py)."""
    import evaluate
    import grpo

    assert all(
        getattr(evaluate, f) is getattr(grpo, f)
        for f in ("generate", "tokenize_prompts", "truncate_response")
    )
    args = evaluate.Args(model="tiny", num_prompts=8, max_new_tokens=6, batch_size=8, top_k=5, top_p=0.9)
    mesh = common.make_mesh(None)
    policy = evaluate.load_policy("tiny", mesh, args)
    prompts, rows, _ = evaluate.check_args(args, mesh)
    tokenizer = policy.model.preprocessor.tokenizer
    data = evaluate.prepare(args, mesh, prompts, rows, tokenizer)
    queries, query_mask = grpo.tokenize_prompts(prompts, tokenizer, args.max_prompt_length)
    np.testing.assert_array_equal(data["queries"], queries)
    np.testing.assert_array_equal(data["query_mask"], query_mask)
    key = jax.random.key(7)
    out = evaluate.respond(policy, data, "sampled", key, 8, mesh)  # greedy: the same call at temperature 0
    sample = functools.partial(
        grpo.generate,
        policy.model.backbone,
        response_length=6,
        temperature=1.0,
        stop_ids=data["stops"],
        pad_id=data["pad"],
        top_k=5,
        top_p=0.9,
    )
    tokens, _, _ = jax.jit(sample)(
        policy.params, policy.frozen, queries, query_mask, jax.random.fold_in(key, 0)
    )
    expected, _ = grpo.truncate_response(tokens, data["stops"], data["pad"])
    np.testing.assert_array_equal(out["responses"], np.asarray(expected))
    assert len({tuple(r) for r in out["responses"]}) > 1  # sampled: the prompts' responses differ


# ---------------------------------------------------------------------------
# filtered_logps: the log-probs of the distribution sampled from (hand-computed, ties, float64, as before)
# ---------------------------------------------------------------------------
RL = ("grpo", "rloo", "ppo")


def test_the_three_samplers_are_one_copy():
    """grpo.py, rloo.py, ppo.py and distill.py each keep the sampler (forkable alone), and keep it the same."""
    import inspect

    names = (
        "filter_logits",
        "filtered_logps",
        "generate",
        "truncate_response",
        "response_logps",
        "mismatch",
        "rollout",
    )
    grpo, rloo, ppo, distill = (importlib.import_module(s) for s in RL + ("distill",))
    for name in names:
        assert (
            inspect.getsource(getattr(grpo, name))
            == inspect.getsource(getattr(rloo, name))
            == inspect.getsource(getattr(ppo, name))
        ), name
        if (
            name != "response_logps"
        ):  # distill.py's copy (its student's log q comes in its divergence's chunks)
            assert inspect.getsource(getattr(distill, name)) == inspect.getsource(getattr(grpo, name)), name


@pytest.mark.parametrize("script", RL)
def test_filtered_logps_renormalise_over_the_kept_tokens(script):
    filtered_logps = importlib.import_module(script).filtered_logps
    logits = jnp.asarray(np.log(P5)[None].repeat(5, 0), jnp.float32)  # [5, V=5]: one row per token scored
    tokens = jnp.arange(5)
    lq = lambda t=1.0, **f: np.asarray(filtered_logps(logits, tokens, t, **f)[0], np.float64)
    entropy = lambda t=1.0, **f: np.asarray(filtered_logps(logits, tokens, t, **f)[1], np.float64)
    # filters off: log P5, entropy −Σ p log p
    np.testing.assert_allclose(lq(), np.log(P5), rtol=1e-6)
    np.testing.assert_allclose(entropy()[0], -np.sum(P5 * np.log(P5)), rtol=1e-6)
    # top-p 0.8 keeps tokens 1, 3, 4 (test_filter_logits_keeps_the_hand_computed_tokens), mass 0.40 + 0.25 +
    # 0.20 = 0.85: q = p / 0.85. A token outside (0, 2) is scored as if kept too: p / (0.85 + p)
    q = np.array([0.05 / 0.90, 0.40 / 0.85, 0.10 / 0.95, 0.25 / 0.85, 0.20 / 0.85])
    np.testing.assert_allclose(lq(top_p=0.8), np.log(q), rtol=1e-6)
    kept = np.array([0.40, 0.25, 0.20]) / 0.85
    np.testing.assert_allclose(entropy(top_p=0.8)[1], -np.sum(kept * np.log(kept)), rtol=1e-6)
    # temperature 2 then top-k 2: q ∝ √p over tokens 1 and 3: √0.40 / (√0.40 + √0.25)
    np.testing.assert_allclose(
        lq(2.0, top_k=2)[[1, 3]], np.log(np.sqrt([0.40, 0.25]) / (0.4**0.5 + 0.5)), rtol=1e-6
    )
    # direction: raising token 3's logit raises its log q and lowers token 1's, under the filter too
    up = np.asarray(filtered_logps(logits.at[:, 3].add(0.1), tokens, 1.0, top_p=0.8)[0])
    assert up[3] > lq(top_p=0.8)[3] and up[1] < lq(top_p=0.8)[1]


@pytest.mark.parametrize("flags", [{"top_k": 1}, {"top_p": 0.5}, {"top_p": 0.3}, {"top_k": 1, "min_p": 0.9}])
def test_ties_at_the_cut_stay_in_sampling_and_in_scoring(flags):
    """p = (0.3, 0.3, 0.2, 0.2): top-k 1 keeps both 0.3s (a tie with the k-th); top-p 0.5 drops while the
    ascending sum stays ≤ 0.5 (0.2, 0.4) and top-p 0.3 while ≤ 0.7 (0.2, 0.4, 0.7: the cut falls inside
    the tie), and each keeps both 0.3s. The sampler draws from filter_logits' support, filtered_logps gives
    each of its tokens q = 0.3 / 0.6 = 1/2: over that support the renormalised probabilities sum to 1."""
    import grpo

    logits = jnp.log(jnp.array([[0.3, 0.3, 0.2, 0.2]] * 4, jnp.float32))
    support = np.isfinite(np.asarray(grpo.filter_logits(logits, **flags)))[0]
    assert support.tolist() == [True, True, False, False]
    logq = np.asarray(grpo.filtered_logps(logits, jnp.arange(4), 1.0, **flags)[0])
    np.testing.assert_allclose(logq[:2], np.log(0.5), rtol=1e-6)
    np.testing.assert_allclose(np.exp(logq[support]).sum(), 1.0, rtol=1e-6)
    draws = jax.random.categorical(jax.random.key(0), grpo.filter_logits(logits[:1], **flags), shape=(400,))
    assert set(np.asarray(draws).tolist()) == {0, 1}  # both tied tokens are sampled, nothing else


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(0.7, 0, 0.9, None), (1.0, 10, 1.0, None), (1.3, 0, 1.0, 0.1), (0.9, 20, 0.7, 0.05)],
)
def test_filtered_logps_match_a_float64_numpy_rederivation(temperature, top_k, top_p, min_p):
    import grpo

    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (32, 64)).astype(np.float32)  # [B, V]
    kept = transformers_filters64(logits / np.float64(temperature), top_k, top_p, min_p)
    q = softmax64(kept)
    tokens = np.array([rng.choice(64, p=row) for row in q])  # sampled from q: always inside its support
    tokens[:4] = np.argmin(logits[:4], -1)  # the least likely: outside it (counted as kept, p / (Z + p))
    with_token = np.where(np.arange(64) == tokens[:, None], logits / np.float64(temperature), kept)
    expected = (with_token - np.log(np.exp(with_token).sum(-1, keepdims=True)))[np.arange(32), tokens]
    filters = {"top_k": top_k, "top_p": top_p, "min_p": min_p}
    logq, entropy = jax.device_get(
        grpo.filtered_logps(jnp.asarray(logits), jnp.asarray(tokens), temperature, **filters)
    )
    np.testing.assert_allclose(logq, expected, rtol=1e-5, atol=1e-5)
    p = softmax64(with_token)
    np.testing.assert_allclose(
        entropy, -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1), rtol=1e-5, atol=1e-5
    )
    # and the gradient stays finite where tokens are dropped (-inf logits): 0 · -inf is kept out
    grad = jax.grad(lambda x: grpo.filtered_logps(x, jnp.asarray(tokens), temperature, **filters)[1].sum())(
        jnp.asarray(logits)
    )
    assert np.isfinite(np.asarray(grad)).all()


def test_filters_off_give_todays_log_probs_bit_for_bit():
    """At top-k 0, top-p 1, min-p None: the arithmetic the scripts had before (log-softmax of logits / T
    and its entropy), to the last bit, so an unfiltered run computes what it did."""
    import grpo

    logits = jnp.asarray(np.random.default_rng(2).normal(0, 3, (16, 320)), jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 320, 16))

    def before(logits, y):  # the position() of response_logps before filtered_logps
        logits = logits / 0.7
        logz = jax.nn.logsumexp(logits, -1)
        entropy = logz - jnp.sum(jax.nn.softmax(logits, -1) * logits, -1)
        return jnp.take_along_axis(logits, y[:, None], -1)[:, 0] - logz, entropy

    now = jax.jit(lambda x, y: grpo.filtered_logps(x, y, 0.7))(logits, tokens)
    for a, b in zip(jax.device_get(now), jax.device_get(jax.jit(before)(logits, tokens))):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------
# the mismatch meter: the sampler's own log q against the trainer's forward of the same weights
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [{"top_p": 0.8}, {"top_k": 5}])
def test_the_sampler_and_the_trainer_take_the_same_distribution(flags, tiny):
    """mismatch/ratio_mean is 1 within 1e-5 and ratio_max within 1e-4 at top-p 0.8 and at top-k 5, on 8
    simulated devices (the batch over `data`) as on 1; with the trainer unfiltered, as TRL and this
    project's main before, the ratio is the kept mass, far below 1."""
    import grpo

    backbone, params, frozen, queries, query_mask, eos, pad = tiny
    r, q = 12, queries.shape[1]

    def meter(params, queries, query_mask, trainer_flags):
        tokens, _, logq = grpo.generate(
            backbone,
            params,
            frozen,
            queries,
            query_mask,
            key=jax.random.key(3),
            response_length=r,
            temperature=1.0,
            stop_ids=(eos,),
            pad_id=pad,
            **flags,
        )
        responses, lengths = grpo.truncate_response(tokens, (eos,), pad)
        mask = jnp.arange(r)[None] <= lengths[:, None]
        ids, padding = jnp.concatenate([queries, responses], 1), jnp.concatenate([query_mask, mask], 1)
        logps = grpo.response_logps(
            backbone, params, frozen, ids, padding, context_length=q, temperature=1.0, **trainer_flags
        )[0]
        return grpo.mismatch(logps, logq, mask)

    on_data = jax.sharding.NamedSharding(common.make_mesh(None), jax.sharding.PartitionSpec("data"))
    one = jax.devices()[0]
    for where in (on_data, one):
        inputs = jax.device_put(
            (params, queries, query_mask), (None if where is on_data else one, where, where)
        )
        m = jax.device_get(jax.jit(lambda p, qs, qm: meter(p, qs, qm, flags))(*inputs))
        assert abs(m["mismatch/ratio_mean"] - 1) < 1e-5 and abs(m["mismatch/ratio_max"] - 1) < 1e-4, m
        assert abs(m["mismatch/ratio_min"] - 1) < 1e-4 and m["mismatch/frac_outside_10pct"] == 0, m
    unfiltered = jax.device_get(jax.jit(lambda p, qs, qm: meter(p, qs, qm, {}))(params, queries, query_mask))
    assert unfiltered["mismatch/ratio_max"] < 0.9, unfiltered
    assert unfiltered["mismatch/frac_outside_10pct"] == 1, unfiltered


# ---------------------------------------------------------------------------
# stop tokens: EOS, the chat template's turn end, --stop-token
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_tokenizers():
    """{template: a tokenizer of that family holding its turn end as one token}: tiny's SentencePiece (Gemma's
    <end_of_turn>), and Llama 3's and Qwen's (ChatML) byte-level BPE kinds learnt from the toy data."""
    import keras_hub.models as m
    from helpers import byte_bpe

    llama3 = byte_bpe(
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )
    chatml = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return {
        "gemma": common.tiny_causal_lm(0, "float32").preprocessor.tokenizer,
        "llama3": m.Llama3Tokenizer(vocabulary=llama3[0], merges=llama3[1]),
        "chatml": m.QwenTokenizer(*byte_bpe(chatml), unsplittable_tokens=chatml),
    }


def test_stop_token_ids_are_eos_the_turn_end_and_the_flags(chat_tokenizers):
    for name, tok in chat_tokenizers.items():
        turn = tok.token_to_id(common.turn_end(common.CHAT_TEMPLATES[name]))
        stops = common.stop_token_ids(tok, common.CHAT_TEMPLATES[name])
        assert stops == (tok.end_token_id, turn) and turn != tok.end_token_id, name
    tiny = chat_tokenizers["gemma"]
    # --stop-token: a token's text, else an id, each once ("1" is a token here, the digit: id 293); a turn
    # end that is no single token (tiny's vocabulary and <|eot_id|>) and Mistral's (the EOS) add nothing
    extra = ("<start_of_turn>", "300", "<start_of_turn>", "1")
    assert common.stop_token_ids(tiny, common.CHAT_TEMPLATES["gemma"], extra) == (1, 5, 4, 300, 293)
    assert common.stop_token_ids(tiny, common.CHAT_TEMPLATES["llama3"]) == (1,)
    assert common.stop_token_ids(tiny, common.CHAT_TEMPLATES["mistral"]) == (1,)
    assert common.stop_token_ids(tiny, None) == (1,)
    for bad in ("<|eot_id|>", "320", "-1"):
        with pytest.raises(common.UsageError, match=f"--stop-token '{bad}': neither a token"):
            common.stop_token_ids(tiny, None, (bad,))


TURN_BIAS = 5.0  # added to the turn end's logit: random `tiny` writes it within a few tokens, then goes on


@pytest.mark.parametrize(
    "template, script", [("gemma", "grpo"), ("llama3", "grpo"), ("chatml", "grpo"), ("gemma", "distill")]
)  # distill.py: its own copy
def test_completions_end_at_the_chats_turn_end(template, script, chat_tokenizers, tiny, monkeypatch):
    """A tiny model that writes the turn end and carries on: stopped at EOS only (main before), every
    completion runs to R; stopped at the template's turn end too, each ends there: the same tokens up to it,
    PAD after, the loss mask through it, completion_ids and the text before it, clipped_ratio 0."""
    sampler = importlib.import_module(script)  # generate, rollout: the script's own copy
    backbone, params, frozen, queries, query_mask, _, pad = tiny
    tok, r = chat_tokenizers[template], 32
    stops = common.stop_token_ids(tok, common.CHAT_TEMPLATES[template])  # (EOS, the turn end)
    logits = common.logits
    monkeypatch.setattr(
        common,
        "logits",
        lambda bb, h, raw=False: (
            logits(bb, h, raw).at[..., stops[1]].add(TURN_BIAS).at[..., jnp.array([0, 1])].set(-jnp.inf)
        ),
    )  # never an EOS (tiny's is 1, the Qwen tokenizer's 0)

    @jax.jit
    def gen(p, f, qs, qm, k, s):  # s: the stop ids, an input (one compilation for both kinds)
        return sampler.generate(
            backbone, p, f, qs, qm, key=k, response_length=r, temperature=1.0, stop_ids=s, pad_id=pad
        )

    on_data = jax.sharding.NamedSharding(common.make_mesh(None), jax.sharding.PartitionSpec("data"))
    out = {}
    for kind, ids in (("eos only", (stops[0],) * 2), ("turn end", stops)):  # one shape: one compilation
        batch, lengths = sampler.rollout(
            lambda p, f, qs, qm, k: gen(p, f, qs, qm, k, jnp.asarray(ids)),
            params,
            frozen,
            queries,
            query_mask,
            key=jax.random.key(5),
            stop_ids=ids,
            pad_id=pad,
            on_data=on_data,
        )
        qb = common.query_length(batch)
        out[kind] = (jax.device_get(batch), *common.decode_completions(tok, batch, lengths, qb, ids))
    turn, (batch, texts, ids, lengths, ended) = stops[1], out["turn end"]
    carried = out["eos only"][0]["query_responses"][:, qb:]
    assert (carried[:, : r // 2] == turn).any(1).all() and (carried != pad).all()  # wrote it, and went on
    assert (
        common.reward_metrics(np.zeros(8), {}, out["eos only"][3], out["eos only"][4])[
            "completions/clipped_ratio"
        ]
        == 1.0
    )
    responses, mask = batch["query_responses"][:, qb:], batch["response_mask"]
    assert common.reward_metrics(np.zeros(8), {}, lengths, ended)["completions/clipped_ratio"] == 0.0
    for i in range(8):
        n = int(np.argmax(carried[i] == turn))  # the first turn end
        np.testing.assert_array_equal(responses[i, : n + 1], carried[i, : n + 1])  # the same tokens up to it
        assert (responses[i, n + 1 :] == pad).all() and mask[i].tolist() == [j <= n for j in range(r)]
        assert ids[i] == list(carried[i, :n]) and lengths[i] == n  # completion_ids: the tokens before it
        assert common.turn_end(common.CHAT_TEMPLATES[template]) not in texts[i]
    assert gen._cache_size() == 1


def test_rope_rotation_is_keras_hubs_to_the_bit():
    """interop.fix_rope_rotation's RoPE (rotate_half concatenated) == keras-hub's own (stacked and reshaped),
    bit for bit, in bfloat16 and float32, at positions 0 and 37."""
    from keras_hub.src.layers.modeling.rotary_embedding import RotaryEmbedding

    def keras_hubs(tensor, cos_emb, sin_emb):  # keras-hub 0.32's _apply_rotary_pos_emb
        x1, x2 = jnp.split(tensor, 2, axis=-1)
        half_rot_tensor = jnp.stack((-x2, x1), axis=-2).reshape(tensor.shape)
        return (tensor * cos_emb) + (half_rot_tensor * sin_emb)

    assert RotaryEmbedding._apply_rotary_pos_emb.__qualname__.startswith("fix_rope_rotation")  # installed
    for dtype in ("bfloat16", "float32"):
        rope = RotaryEmbedding(max_wavelength=10000, dtype=dtype)
        x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 3, 16)), dtype)  # [B, T, heads, H]
        for start in (0, 37):
            ours = rope(x, start_index=start)
            cos, sin = rope._compute_cos_sin_embedding(
                x, start
            )  # x's axes as RotaryEmbedding.call moves them
            np.testing.assert_array_equal(ours, keras_hubs(x, cos, sin))
