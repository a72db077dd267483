"""tpu_kernels.py's fused draw gives what the plain JAX it replaces gives: threefry_bits and gumbel are
jax.random.bits' and jax.random.gumbel's to the bit (and threefry2x32's published known answer), and
`categorical` draws jax.random.categorical's tokens from the output layer's logits, tied or not, with log q
to a float64 NumPy re-derivation. On CPU the kernel runs in Pallas' interpreter; on a TPU chip
benchmarks/decode.py checks its tokens against XLA's draw (tpu_check.sh)."""

import types

import numpy as np
import pytest

import common  # noqa: F401  (first: KERAS_BACKEND=jax)
import jax
import jax.numpy as jnp
import keras_hub

import tpu_kernels


def test_threefry_gives_the_published_known_answer():
    """Random123's known answer for threefry2x32 (20 rounds): key (0, 0), counter (0, 0) -> words
    0x6b200159 and 0x99ba4efe; jax.random.bits' 32-bit word is their xor, 0xf29a4fa7."""
    zero = jnp.int32(0)
    bits = tpu_kernels.threefry_bits(zero, zero, jnp.zeros((1,), jnp.int32))
    assert int(jax.lax.bitcast_convert_type(bits, jnp.uint32)[0]) == 0x6B200159 ^ 0x99BA4EFE == 0xF29A4FA7


@pytest.mark.parametrize("shape", [(1, 7), (3, 1000), (8, 4096)])
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_threefry_bits_and_gumbel_are_jax_randoms(shape, seed):
    key = jax.random.key(seed)
    words = jax.lax.bitcast_convert_type(jax.random.key_data(key), jnp.int32)
    counter = jnp.arange(np.prod(shape), dtype=jnp.int32).reshape(shape)
    bits = tpu_kernels.threefry_bits(words[0], words[1], counter)
    np.testing.assert_array_equal(jax.lax.bitcast_convert_type(bits, jnp.uint32), jax.random.bits(key, shape))
    np.testing.assert_array_equal(tpu_kernels.gumbel(bits), jax.random.gumbel(key, shape))


def output_layer(vocab, dim, tied, seed=0):
    """A model stand-in with KerasHub's output layer (ReversibleEmbedding), random weights of scale 1."""
    layer = keras_hub.layers.ReversibleEmbedding(vocab, dim, tie_weights=tied)
    layer.build((None,))
    for i, v in enumerate(layer.weights):
        v.assign(jax.random.normal(jax.random.key(seed + i), v.shape))
    return types.SimpleNamespace(token_embedding=layer, vocabulary_size=vocab)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("vocab, temperature", [(1000, 1.0), (1024, 0.7)])
def test_categorical_draws_jax_random_categoricals_tokens(tied, vocab, temperature):
    """5 rows (padded to 8 inside), blocks of 256 vocabulary rows: 1,000 leaves the last block part empty,
    1,024 fills it. The tokens are jax.random.categorical's for the layer's logits / T, key by key; log q is
    logit / T − logsumexp(logits / T) in float64 NumPy."""
    model = output_layer(vocab, 32, tied)
    hidden = jax.random.normal(jax.random.key(7), (5, 32))
    logits = model.token_embedding(hidden, reverse=True)  # [5, V] float32
    draw = jax.jit(lambda h, k: tpu_kernels.categorical(model, h, k, temperature, block=256))
    z = np.asarray(logits, np.float64) / temperature
    for seed in range(4):
        key = jax.random.key(seed)
        token, logq = draw(hidden, key)
        np.testing.assert_array_equal(token, jax.random.categorical(key, logits / temperature))
        top = z.max(1, keepdims=True)
        expected = z[np.arange(5), token] - (top[:, 0] + np.log(np.exp(z - top).sum(1)))
        np.testing.assert_allclose(logq, expected, rtol=1e-6, atol=1e-5)


def test_categorical_of_equal_logits_is_uniform_by_hand():
    """Hidden states of zero make every logit 0: log q = −log V exactly (V = 300: −5.7038), whatever the
    token, and over 64 rows × 4 keys the tokens spread over the vocabulary as uniform draws do: 256 of 300
    equally likely tokens give 300 · (1 − (299/300)^256) ≈ 172 distinct ones on average (sd ≈ 6)."""
    model = output_layer(300, 16, tied=True)
    tokens = []
    for seed in range(4):
        token, logq = tpu_kernels.categorical(
            model, jnp.zeros((64, 16)), jax.random.key(seed), 1.0, block=128
        )
        np.testing.assert_allclose(logq, -np.log(300), rtol=0, atol=1e-6)
        assert -5.7039 < float(logq[0]) < -5.7037
        tokens += list(np.asarray(token))
    assert 0 <= min(tokens) and max(tokens) < 300 and len(set(tokens)) >= 150


def test_the_fused_draw_fits_only_one_chip_and_a_plain_output_layer(monkeypatch):
    """fits: off a TPU never; on one chip (made true here) for T > 0 and an output layer without a soft cap;
    greedy, Gemma 2's soft cap, B · V ≥ 2^32 or the switch off keep XLA's draw (a filter too: common.categorical
    asks only without one, tests/test_sampling.py)."""
    model = output_layer(1000, 32, tied=True)
    assert not tpu_kernels.fits(model, 8, 1.0)  # this CPU
    monkeypatch.setattr(tpu_kernels, "on_chip", lambda backbone: True)
    assert tpu_kernels.fits(model, 8, 1.0) and tpu_kernels.fits(model, 8, 0.7)
    assert not tpu_kernels.fits(model, 8, 0.0)  # greedy: an arg-max of the logits, no noise
    assert not tpu_kernels.fits(model, 2**23, 1.0)  # B · V ≥ 2^32: the counter's high word
    monkeypatch.setattr(model.token_embedding, "logit_soft_cap", 30.0)
    assert not tpu_kernels.fits(model, 8, 1.0)
    monkeypatch.setattr(model.token_embedding, "logit_soft_cap", None)
    monkeypatch.setattr(tpu_kernels, "FUSED_DRAW", False)
    assert not tpu_kernels.fits(model, 8, 1.0)
