"""distill.py: the generalized JSD by hand (a 3-token vocabulary, β = 0, 0.5, 1, two temperatures) and in
float64 NumPy (random logits, masks, padding), its direction; the chunked projection against the full logits;
the start-up checks (a mismatched or reward-model teacher, β, τ: exit 2 before weights load); the CLI end to
end with SIGTERM + --resume; the divergence falling on the toy task."""

import math

import numpy as np
import pytest

import common  # noqa: F401  (first: KERAS_BACKEND=jax)
import jax
import jax.numpy as jnp
from distill import distill_loss, generalized_jsd

log = math.log


# ---------------------------------------------------------------------------
# The loss: by hand, float64 NumPy, direction
# ---------------------------------------------------------------------------
# Logits 2·log(w): at τ = 2 the distributions are w / Σw, at τ = 1 they are w² / Σw².
STUDENT_LOGITS = [2 * log(2), 0.0, 0.0]  # τ = 2: p_S = (1/2, 1/4, 1/4);  τ = 1: (4/6, 1/6, 1/6)
TEACHER_LOGITS = [0.0, 2 * log(3), 2 * log(4)]  # τ = 2: p_T = (1/8, 3/8, 1/2);  τ = 1: (1/26, 9/26, 16/26)
BY_HAND = {
    # τ = 2.  β = 0: KL(p_T ‖ p_S) = Σ p_T log(p_T / p_S)
    (2.0, 0.0): 1 / 8 * log((1 / 8) / (1 / 2)) + 3 / 8 * log((3 / 8) / (1 / 4)) + 1 / 2 * log((1 / 2) / (1 / 4)),
    # β = 1: KL(p_S ‖ p_T) = Σ p_S log(p_S / p_T)
    (2.0, 1.0): 1 / 2 * log((1 / 2) / (1 / 8)) + 1 / 4 * log((1 / 4) / (3 / 8)) + 1 / 4 * log((1 / 4) / (1 / 2)),
    # β = 0.5: m = (p_S + p_T) / 2 = (5/16, 5/16, 6/16); ½·KL(p_T ‖ m) + ½·KL(p_S ‖ m)
    (2.0, 0.5): 0.5 * (1 / 8 * log((1 / 8) / (5 / 16)) + 3 / 8 * log((3 / 8) / (5 / 16))
                       + 1 / 2 * log((1 / 2) / (6 / 16)))
                + 0.5 * (1 / 2 * log((1 / 2) / (5 / 16)) + 1 / 4 * log((1 / 4) / (5 / 16))
                         + 1 / 4 * log((1 / 4) / (6 / 16))),
    # τ = 1: p_S = (4/6, 1/6, 1/6), p_T = (1/26, 9/26, 16/26)
    (1.0, 0.0): 1 / 26 * log((1 / 26) / (4 / 6)) + 9 / 26 * log((9 / 26) / (1 / 6)) + 16 / 26 * log((16 / 26) / (1 / 6)),
    (1.0, 1.0): 4 / 6 * log((4 / 6) / (1 / 26)) + 1 / 6 * log((1 / 6) / (9 / 26)) + 1 / 6 * log((1 / 6) / (16 / 26)),
    # m = (4/6 + 1/26, 1/6 + 9/26, 1/6 + 16/26) / 2
    (1.0, 0.5): 0.5 * (1 / 26 * log((1 / 26) / ((4 / 6 + 1 / 26) / 2)) + 9 / 26 * log((9 / 26) / ((1 / 6 + 9 / 26) / 2))
                       + 16 / 26 * log((16 / 26) / ((1 / 6 + 16 / 26) / 2)))
                + 0.5 * (4 / 6 * log((4 / 6) / ((4 / 6 + 1 / 26) / 2)) + 1 / 6 * log((1 / 6) / ((1 / 6 + 9 / 26) / 2))
                         + 1 / 6 * log((1 / 6) / ((1 / 6 + 16 / 26) / 2))),
}


@pytest.mark.parametrize("temperature, beta", list(BY_HAND))
def test_generalized_jsd_by_hand_on_three_tokens(temperature, beta):
    s, t = jnp.array([STUDENT_LOGITS]), jnp.array([TEACHER_LOGITS])
    got = generalized_jsd(s, t, jnp.array([True]), beta, temperature)
    assert float(got[0]) == pytest.approx(BY_HAND[temperature, beta], rel=1e-5)
    assert float(generalized_jsd(s, t, jnp.array([False]), beta, temperature)[0]) == 0.0  # masked: nothing


def test_the_two_kls_differ_and_jsd_is_bounded_by_log_2():
    """The numbers above are not one number thrice: forward ≠ reverse here, and the JSD (β = ½) ≤ log 2."""
    assert abs(BY_HAND[2.0, 0.0] - BY_HAND[2.0, 1.0]) > 0.09 and abs(BY_HAND[1.0, 0.0] - BY_HAND[1.0, 1.0]) > 0.09
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
