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
FILTERING = ("grpo", "rloo")  # ppo.py samples with temperature only, as TRL's PPOConfig


# ---------------------------------------------------------------------------
# filter_logits: hand-computed cases and a float64 re-derivation
# ---------------------------------------------------------------------------
P5 = np.array([0.05, 0.40, 0.10, 0.25, 0.20])  # token i's probability; sorted: 1 (0.40), 3, 4, 2, 0 (0.05)


@pytest.mark.parametrize("script", FILTERING)
@pytest.mark.parametrize("flags, kept", [
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
    ({"top_k": 2, "min_p": 0.7}, [1]),  # 0.7 × 0.615 = 0.431 > 0.385 (a ratio to the top: 0.7 × 0.40 > 0.25)
])
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


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 0.9, None), (10, 1.0, None), (0, 1.0, 0.1), (20, 0.7, 0.05),
                                                 (5, 0.95, 0.3), (0, 0.3, None)])
def test_filter_logits_matches_a_float64_numpy_rederivation(top_k, top_p, min_p):
    import grpo
    logits = np.random.default_rng(0).normal(0, 2, (32, 64)).astype(np.float32)  # [B, V], no ties
    out = np.asarray(grpo.filter_logits(jnp.asarray(logits), top_k, top_p, min_p))
    ref = transformers_filters64(logits, top_k, top_p, min_p)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref))
    np.testing.assert_array_equal(out[np.isfinite(out)], logits[np.isfinite(out)])
    assert 1 <= np.isfinite(out).sum(1).min() and np.isfinite(out).sum(1).max() < 64  # every row filtered, none empty


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

        _, tokens = jax.lax.scan(step, (logits[:, -1], cache, jnp.int32(q), key), None, length=response_length)
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
        queries[i, 16 - len(x):], query_mask[i, 16 - len(x):] = x, True
    return model.backbone, params, frozen, queries, query_mask, tok.end_token_id, tok.pad_token_id


EOS_BIAS = 4.0  # added to the EOS logit: random `tiny` then ends its sequences within ~16 tokens, at varied steps


@pytest.mark.parametrize("script", SCRIPTS)
def test_early_stop_samples_the_fixed_length_tokens_and_ends_when_all_have_ended(script, tiny, monkeypatch):
    module = importlib.import_module(script)
    backbone, params, frozen, queries, query_mask, eos, pad = tiny
    logits = common.logits  # every sampler's logits come from common.logits (inside common.cached_forward)
    monkeypatch.setattr(common, "logits", lambda bb, h: logits(bb, h).at[..., eos].add(EOS_BIAS))
    r = 64
    new = jax.jit(lambda p, qs, qm, k: module.generate(backbone, p, frozen, qs, qm, k, r, 1.0, eos, pad))
    old = jax.jit(lambda p, qs, qm, k: fixed_length_generate(backbone, p, frozen, qs, qm, k, r, 1.0))
    ends = []
    for k in range(2):  # two batches of one shape: other prompts (rows rolled), another key
        qs, qm, key = np.roll(queries, k, 0), np.roll(query_mask, k, 0), jax.random.key(k)
        tokens, steps = jax.device_get(new(params, qs, qm, key))
        expected, first_eos = jax.device_get(module.truncate_response(old(params, qs, qm, key), eos, pad))
        # the same tokens up to and with each EOS, PAD after it: what truncate_response made of them before
        np.testing.assert_array_equal(tokens, expected)
        assert (tokens == eos).any(1).all() and len(set(first_eos)) > 2  # all ended, at different steps
        assert steps == first_eos.max() + 1 < r  # the loop stopped at the last EOS, long before R
        ends.append(int(steps))
    assert ends[0] != ends[1]  # the two batches ran different numbers of steps ...
    assert new._cache_size() == 1  # ... in one compiled program


@pytest.mark.parametrize("script, flags", [("grpo", {"top_k": 1}), ("grpo", {"top_p": 1e-6}),
                                           ("grpo", {"min_p": 1.0}), ("rloo", {"top_k": 1})])
def test_a_filter_that_keeps_one_token_samples_the_greedy_tokens(script, flags, tiny):
    module = importlib.import_module(script)
    backbone, params, frozen, queries, query_mask, eos, pad = tiny
    gen = lambda t, **f: jax.device_get(jax.jit(lambda p, qs, qm, k: module.generate(
        backbone, p, frozen, qs, qm, k, 8, t, eos, pad, **f))(params, queries, query_mask, jax.random.key(1))[0])
    np.testing.assert_array_equal(gen(1.0, **flags), gen(0.0))


def test_evaluate_samples_with_grpos_sampler():
    """evaluate.py has no sampler of its own: grpo.py's functions, and on the bundled held-out prompts its
    queries and sampled (top-k, top-p) responses are those grpo.py's sampler gives for the same
    prompts and key (batch i: fold_in(key, i); evaluate cuts a batch to its bucket, which samples the same
    tokens: tests/test_compare.py)."""
    import evaluate
    import grpo
    assert all(getattr(evaluate, f) is getattr(grpo, f) for f in ("generate", "tokenize_prompts",
                                                                  "truncate_response"))
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
    sample = functools.partial(grpo.generate, policy.model.backbone, response_length=6, temperature=1.0,
                               eos_id=data["eos"], pad_id=data["pad"], top_k=5, top_p=0.9)
    tokens, _ = jax.jit(sample)(policy.params, policy.frozen, queries, query_mask, jax.random.fold_in(key, 0))
    expected, _ = grpo.truncate_response(tokens, data["eos"], data["pad"])
    np.testing.assert_array_equal(out["responses"], np.asarray(expected))
    assert len({tuple(r) for r in out["responses"]}) > 1  # sampled: the prompts' responses differ
