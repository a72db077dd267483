"""SFT loss vs hand-computed values, masking/shift checks, and log-prob correctness.

The preference and RL losses are tested beside their scripts' other tests
(test_preference.py, test_rlhf.py); this file holds the SFT loss and the
chunked log-prob helper every script copies.
"""

import math

import numpy as np
import pytest

import common
import jax
import jax.numpy as jnp
from sft import sft_loss, token_logps


def test_sft_loss_hand_computed():
    # tokens:     t0   t1   t2   t3   (t0 = BOS, t1 prompt, t2-t3 completion)
    # loss_mask:   F    F    T    T   -> logps positions 1, 2 score tokens t2, t3
    logps = jnp.log(jnp.array([[0.9, 0.5, 0.25]]))  # [B=1, T-1=3]; position 0 scores t1 (prompt)
    loss_mask = jnp.array([[False, False, True, True]])
    loss, aux = sft_loss(logps, loss_mask, num_loss_tokens=2)
    expected = (math.log(2) + math.log(4)) / 2  # mean of -log 0.5 and -log 0.25
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert int(aux["num_tokens"]) == 2


def test_sft_loss_float64_rederivation():
    rng = np.random.default_rng(0)
    b, t = 4, 9
    logps = np.log(rng.uniform(0.01, 1.0, (b, t - 1)))
    loss_mask = rng.uniform(size=(b, t)) < 0.5
    n = loss_mask[:, 1:].sum()
    expected = sum(-logps[i, j - 1] for i in range(b) for j in range(1, t) if loss_mask[i, j]) / n
    loss, _ = sft_loss(jnp.asarray(logps, jnp.float32), jnp.asarray(loss_mask), n)
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_sft_loss_ignores_unmasked_positions_and_shift():
    logps = jnp.log(jnp.full((1, 4), 0.5))
    loss_mask = jnp.array([[False, False, True, False, False]])  # only token 2 -> logps[:, 1]
    base, _ = sft_loss(logps, loss_mask, 1)
    for j in (0, 2, 3):  # changing any other position leaves the loss alone
        assert float(sft_loss(logps.at[0, j].set(-9.0), loss_mask, 1)[0]) == pytest.approx(float(base))
    assert float(sft_loss(logps.at[0, 1].set(-9.0), loss_mask, 1)[0]) == pytest.approx(9.0)


def test_sft_loss_whole_batch_token_mean_under_accumulation():
    # Two micro-batches with different token counts: the sum of the per-micro losses,
    # each divided by the WHOLE batch count, equals the token mean over everything.
    rng = np.random.default_rng(1)
    logps = jnp.asarray(np.log(rng.uniform(0.05, 1, (4, 6))), jnp.float32)
    loss_mask = jnp.asarray(rng.uniform(size=(4, 7)) < 0.6)
    n = loss_mask[:, 1:].sum()
    whole = sft_loss(logps, loss_mask, n)[0]
    split = sft_loss(logps[:1], loss_mask[:1], n)[0] + sft_loss(logps[1:], loss_mask[1:], n)[0]
    assert float(split) == pytest.approx(float(whole), rel=1e-6)


@pytest.fixture(scope="module")
def tiny():
    mesh = common.make_mesh()
    model = common.load_model("tiny", mesh, "float32", seed=0)
    params, frozen = common.split_variables(model.backbone)
    return model, params, frozen


def test_token_logps_match_full_logits_and_padding(tiny):
    model, params, frozen = tiny
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 300, (2, 11)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    mask[1, 7:] = False  # row 1 is right-padded
    logps = token_logps(model.backbone, params, frozen, ids, mask, chunk=4)  # chunks: 4+4+2
    # Reference: full [B, T, V] logits from the KerasHub model itself, float64 log-softmax.
    logits = np.asarray(model({"token_ids": ids, "padding_mask": mask}), np.float64)
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    ref = np.take_along_axis(ref[:, :-1], ids[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(logps)[0], ref[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(logps)[1, :6], ref[1, :6], rtol=1e-4, atol=1e-4)
    # Padding invariance: the same row with more right padding gives the same log-probs.
    longer = np.pad(ids[1:, :7], ((0, 0), (0, 9)))
    longer_mask = np.pad(mask[1:, :7], ((0, 0), (0, 9)))
    padded = token_logps(model.backbone, params, frozen, longer, longer_mask)
    np.testing.assert_allclose(np.asarray(padded)[0, :6], np.asarray(logps)[1, :6], rtol=1e-5, atol=1e-5)
