"""The samplers of grpo.py, ppo.py and evaluate.py (each script keeps its own): stopping once every
sequence has sampled its EOS gives, for the same key, the tokens of the fixed-length sampler it
replaced (kept below as the reference), ends before R, and compiles once."""

import importlib

import numpy as np
import pytest

import common  # first: KERAS_BACKEND=jax
import jax
import jax.numpy as jnp
import keras

SCRIPTS = ("grpo", "ppo", "evaluate")


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
