"""Every loss and its pure math helpers, imported from the scripts: for each of the nine losses
(sft, dpo, simpo, orpo, kto, reward, ppo, grpo, rloo) a case whose expected value is written as arithmetic
here, a float64 NumPy re-derivation on random inputs and a sign/direction check; and padding
invariance of the log-probs (sequence_logps, token_logps against the model's full logits).

The scripts' CLIs, updates on real rollouts and learning are tested in the per-script files.
"""

import math
import os

import numpy as np
import pytest

import common  # first: KERAS_BACKEND=jax
import dpo
import jax
import jax.numpy as jnp
import kto
import orpo
import simpo
from dpo import dpo_loss
from grpo import AGGREGATIONS, group_advantages, grpo_loss, k3_kl, rft_advantages, token_mean
from helpers import ROOT
from kto import kto_loss
from orpo import orpo_loss
from ppo import compute_gae, compute_rewards, ppo_loss, whiten
from reward import reward_loss
from rloo import rloo_advantages, rloo_loss, sequence_kl
from sft import sft_loss, token_logps
from simpo import simpo_loss

LOG2 = math.log(2)
EPS = 1e-4  # group_advantages' default ε


def log_sigmoid64(x):
    return -np.logaddexp(0.0, -x)


def random_logps(seed, n=16):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-30, -1, n) for _ in range(4)]


# ---------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------
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


def test_sft_loss_direction():
    # d loss / d logps = −1/n at the loss tokens' positions (the mask shifted by one), 0 elsewhere:
    # raising a completion token's log-prob lowers the loss; prompt and padding get no gradient
    logps = jnp.log(jnp.array([[0.9, 0.5, 0.25, 0.7]]))
    loss_mask = jnp.array([[False, False, True, True, False]])  # tokens 2, 3 -> logps positions 1, 2
    g = jax.grad(lambda x: sft_loss(x, loss_mask, 2)[0])(logps)
    np.testing.assert_allclose(g, [[0.0, -1 / 2, -1 / 2, 0.0]], rtol=1e-6)
    # token 2 from p = 0.5 to 0.8: the loss falls by (log 0.8 − log 0.5) / 2
    before = float(sft_loss(logps, loss_mask, 2)[0])
    after = float(sft_loss(logps.at[0, 1].set(math.log(0.8)), loss_mask, 2)[0])
    assert after == pytest.approx(before - (math.log(0.8) - math.log(0.5)) / 2, rel=1e-6) and after < before


# ---------------------------------------------------------------------------
# DPO
# ---------------------------------------------------------------------------
def test_dpo_hand_worked():
    loss, m = dpo_loss(
        jnp.array([-5.0, -9.0]),
        jnp.array([-7.0, -2.0]),
        jnp.array([-5.0, -9.0]),
        jnp.array([-7.0, -2.0]),
        beta=0.1,
    )
    assert float(loss) == pytest.approx(LOG2, abs=1e-6)  # policy == reference: equal margins
    assert float(m["rewards/margins"]) == 0 and float(m["rewards/accuracies"]) == 0
    # h = (−1 − (−3)) − (−2 − (−2)) = 2, β = 0.5: loss = −log σ(1) = log(1 + e^−1)
    loss, m = dpo_loss(jnp.array([-1.0]), jnp.array([-3.0]), jnp.array([-2.0]), jnp.array([-2.0]), beta=0.5)
    assert float(loss) == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-6)
    assert float(m["rewards/chosen"]) == pytest.approx(0.5) and float(m["rewards/rejected"]) == pytest.approx(
        -0.5
    )
    assert float(m["rewards/margins"]) == pytest.approx(1.0) and float(m["rewards/accuracies"]) == 1.0
    assert float(m["logps/chosen"]) == -1.0 and float(m["logps/rejected"]) == -3.0


def test_dpo_variants_hand_worked():
    same = [jnp.array([-4.0])] * 4  # h = 0
    assert float(dpo_loss(*same, beta=0.1, loss_type="ipo")[0]) == pytest.approx((0 - 1 / 0.2) ** 2)  # 25
    assert float(dpo_loss(*same, beta=0.1, loss_type="hinge")[0]) == pytest.approx(1.0)
    h20 = [jnp.array([-1.0]), jnp.array([-21.0]), jnp.array([-5.0]), jnp.array([-5.0])]  # h = 20
    assert float(dpo_loss(*h20, beta=0.1, loss_type="hinge")[0]) == 0.0  # relu(1 − 2)
    assert float(dpo_loss(*h20, beta=0.1, loss_type="ipo")[0]) == pytest.approx((20 - 5) ** 2, rel=1e-6)
    # cDPO with ε = 0.5 is symmetric: ½(softplus(−βh) + softplus(βh)), βh = 2
    x = 2.0
    expected = 0.5 * (math.log1p(math.exp(-x)) + math.log1p(math.exp(x)))
    assert float(dpo_loss(*h20, beta=0.1, label_smoothing=0.5)[0]) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError):
        dpo_loss(*same, loss_type="kto")
    # --sft-weight (RPO): α·NLL added to any of them, logged whatever α: log 2 + 0.5·2, 25 + 0.5·2
    loss, m = dpo_loss(*same, beta=0.1, nll_loss=2.0, sft_weight=0.5)
    assert float(loss) == pytest.approx(LOG2 + 1.0, abs=1e-6) and float(m["nll_loss"]) == 2.0
    loss, _ = dpo_loss(*same, beta=0.1, loss_type="ipo", nll_loss=2.0, sft_weight=0.5)
    assert float(loss) == pytest.approx(26.0)
    assert float(dpo_loss(*same, beta=0.1, nll_loss=2.0)[0]) == pytest.approx(LOG2, abs=1e-6)


@pytest.mark.parametrize(
    "loss_type, eps, alpha",
    [
        ("sigmoid", 0.0, 0.0),
        ("sigmoid", 0.2, 0.0),
        ("ipo", 0.0, 0.0),
        ("hinge", 0.0, 0.0),
        ("sigmoid", 0.0, 1.0),
        ("ipo", 0.0, 0.4),
    ],
)
def test_dpo_float64_rederivation(loss_type, eps, alpha):
    c, r, rc, rr = random_logps(1)
    beta, nll = 0.3, 1.37
    h = (c - r) - (rc - rr)
    if loss_type == "sigmoid":
        want = np.mean(-(1 - eps) * log_sigmoid64(beta * h) - eps * log_sigmoid64(-beta * h))
    elif loss_type == "ipo":
        want = np.mean((h - 1 / (2 * beta)) ** 2)
    else:
        want = np.mean(np.maximum(0.0, 1 - beta * h))
    loss, m = dpo_loss(
        *map(jnp.asarray, (c, r, rc, rr)),
        beta=beta,
        loss_type=loss_type,
        label_smoothing=eps,
        nll_loss=nll,
        sft_weight=alpha,
    )
    np.testing.assert_allclose(float(loss), want + alpha * nll, rtol=1e-5)
    np.testing.assert_allclose(float(m["rewards/margins"]), np.mean(beta * h), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(m["rewards/accuracies"]), np.mean(beta * (c - rc) > beta * (r - rr)))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_direction(loss_type):
    args = [
        jnp.array([-10.0, -12.0]),
        jnp.array([-11.0, -9.0]),
        jnp.array([-10.5, -11.0]),
        jnp.array([-10.0, -10.0]),
    ]
    g = jax.grad(lambda c, r: dpo_loss(c, r, *args[2:], beta=0.1, loss_type=loss_type)[0], argnums=(0, 1))(
        *args[:2]
    )
    assert (g[0] < 0).all() and (g[1] > 0).all()  # raising chosen / lowering rejected lowers the loss


# ---------------------------------------------------------------------------
# SimPO
# ---------------------------------------------------------------------------
def test_simpo_hand_worked():
    same = jnp.array([-0.7, -1.3])
    assert float(simpo_loss(same, same, 0.0, beta=2.0, gamma=0.0)[0]) == pytest.approx(LOG2, abs=1e-6)
    # equal rewards with margin γ = 1: −log σ(−1) = log(1 + e)
    assert float(simpo_loss(same, same, 0.0, beta=2.0, gamma=1.0)[0]) == pytest.approx(math.log(1 + math.e))
    # β·Δ = 2·0.5 = γ: back at log 2; sft_weight adds 0.5·NLL = 0.5·3
    loss, m = simpo_loss(jnp.array([-1.0]), jnp.array([-1.5]), 3.0, beta=2.0, gamma=1.0, sft_weight=0.5)
    assert float(loss) == pytest.approx(LOG2 + 1.5, abs=1e-6)
    assert float(m["rewards/chosen"]) == -2.0 and float(m["rewards/rejected"]) == -3.0
    assert float(m["rewards/margins"]) == 1.0 and float(m["nll_loss"]) == 3.0


def test_simpo_float64_rederivation_and_direction():
    c, r, _, _ = random_logps(2)
    c, r = c / 10, r / 10  # per-token means
    beta, gamma, w, nll = 2.5, 0.7, 0.3, 1.9
    want = np.mean(-log_sigmoid64(beta * c - beta * r - gamma)) + w * nll
    loss, m = simpo_loss(jnp.asarray(c), jnp.asarray(r), nll, beta=beta, gamma=gamma, sft_weight=w)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(m["rewards/accuracies"]), np.mean(c > r))
    g = jax.grad(lambda c, r: simpo_loss(c, r, 0.0, beta=beta, gamma=gamma)[0], argnums=(0, 1))(
        jnp.asarray(c), jnp.asarray(r)
    )
    assert (g[0] < 0).all() and (g[1] > 0).all()


# ---------------------------------------------------------------------------
# ORPO
# ---------------------------------------------------------------------------
def test_orpo_hand_worked():
    half = jnp.log(jnp.array([0.5, 0.5]))  # P = 0.5: odds 1 each, odds ratio 1, log σ(0) = −log 2
    loss, m = orpo_loss(half, half, 1.0, beta=0.1)
    assert float(loss) == pytest.approx(1.0 + 0.1 * LOG2, abs=1e-6)
    assert float(m["log_odds_chosen"]) == pytest.approx(0.0, abs=1e-6)
    assert float(m["log_odds_ratio"]) == pytest.approx(-LOG2, abs=1e-6)
    # P+ = 0.8, P− = 0.2: odds 4 and 1/4, log OR = log 16, −log σ(log 16) = log(17/16)
    loss, m = orpo_loss(jnp.log(jnp.array([0.8])), jnp.log(jnp.array([0.2])), 0.5, beta=1.0)
    assert float(loss) == pytest.approx(0.5 + math.log(17 / 16), rel=1e-5)
    assert float(m["log_odds_chosen"]) == pytest.approx(math.log(16), rel=1e-5)
    assert float(m["rewards/margins"]) == pytest.approx(math.log(4), rel=1e-5)  # β(log .8 − log .2)


def test_orpo_float64_rederivation_and_direction():
    c, r, _, _ = random_logps(3)
    c, r = c / 10, r / 10
    lam, nll = 0.25, 2.2
    log_odds = (c - np.log1p(-np.exp(c))) - (r - np.log1p(-np.exp(r)))
    want = nll - lam * np.mean(log_sigmoid64(log_odds))
    loss, m = orpo_loss(jnp.asarray(c), jnp.asarray(r), nll, lam)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(m["log_odds_chosen"]), np.mean(log_odds), rtol=1e-4)
    g = jax.grad(lambda c, r: orpo_loss(c, r, 0.0, lam)[0], argnums=(0, 1))(jnp.asarray(c), jnp.asarray(r))
    assert (g[0] < 0).all() and (g[1] > 0).all()


def test_orpo_numerically_safe_at_extremes():
    x = np.array([0.0, -1e-9, -1e-6, -1e-3, -0.69, -0.7, -5.0, -50.0, -1e4])
    np.testing.assert_allclose(
        np.asarray(orpo.log1mexp(jnp.asarray(x[2:]))), np.log1p(-np.exp(x[2:])), rtol=1e-5
    )
    assert np.isfinite(np.asarray(orpo.log1mexp(jnp.asarray(x[:2])))).all()  # P = 1 is capped, not −inf
    c, r = jnp.asarray(x), jnp.asarray(x[::-1].copy())
    loss, m = orpo_loss(c, r, 1.0, 0.1)
    g = jax.grad(lambda c, r: orpo_loss(c, r, 1.0, 0.1)[0], argnums=(0, 1))(c, r)
    assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in m.values())
    assert np.isfinite(np.asarray(g[0])).all() and np.isfinite(np.asarray(g[1])).all()


# ---------------------------------------------------------------------------
# KTO
# ---------------------------------------------------------------------------
def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def _kto(logps, ref_logps, kl_logps, ref_kl_logps, labels, **kw):
    arr = lambda x: jnp.array(x, jnp.float32)
    return kto_loss(arr(logps), arr(ref_logps), arr(kl_logps), arr(ref_kl_logps), jnp.array(labels), **kw)


def test_kto_hand_worked():
    # policy == reference: every log-ratio r = 0 and z₀ = 0, so each example's loss is 1 − σ(0) = ½
    loss, m = _kto([-5.0, -9.0], [-5.0, -9.0], [-7.0, -2.0], [-7.0, -2.0], [True, False])
    assert float(loss) == 0.5 and float(m["kl"]) == 0.0 and float(m["rewards/margins"]) == 0.0
    # desirable: r = −1 − (−3) = 2; undesirable: r = −6 − (−4) = −2; the mismatched pairs' log-ratios are
    # −10 − (−11) = 1 and −12 − (−12) = 0, so z₀ = (1 + 0)/2 = ½; β = ½:
    #   desirable 1 − σ(½(2 − ½)) = 1 − σ(0.75), undesirable 1 − σ(½(½ − (−2))) = 1 − σ(1.25)
    args = ([-1.0, -6.0], [-3.0, -4.0], [-10.0, -12.0], [-11.0, -12.0], [True, False])
    loss, m = _kto(*args, beta=0.5)
    assert float(loss) == pytest.approx(((1 - sigmoid(0.75)) + (1 - sigmoid(1.25))) / 2, rel=1e-6)
    assert float(m["kl"]) == pytest.approx(0.5)
    assert float(m["rewards/chosen"]) == pytest.approx(1.0) and float(m["rewards/rejected"]) == pytest.approx(
        -1.0
    )
    assert float(m["rewards/margins"]) == pytest.approx(2.0)
    assert float(m["logps/chosen"]) == -1.0 and float(m["logps/rejected"]) == -6.0
    assert int(m["count/chosen"]) == 1 and int(m["count/rejected"]) == 1
    # the weights: λ_D = 2, λ_U = 0.5 scale each example's loss before the batch mean
    loss, _ = _kto(*args, beta=0.5, desirable_weight=2.0, undesirable_weight=0.5)
    assert float(loss) == pytest.approx((2 * (1 - sigmoid(0.75)) + 0.5 * (1 - sigmoid(1.25))) / 2, rel=1e-6)
    # apo_zero_unpaired: no reference point (z₀ = 0): 1 − σ(½·2) and 1 − σ(½(0 − (−2)))
    loss, m = _kto(*args, beta=0.5, loss_type="apo_zero_unpaired")
    assert float(loss) == pytest.approx(1 - sigmoid(1.0), rel=1e-6) and float(m["kl"]) == 0.0
    with pytest.raises(ValueError):
        _kto(*args, loss_type="sigmoid")


def test_kto_reference_point_is_clamped_at_zero():
    # mismatched log-ratios −12 − (−9) = −3 and −5 − (−4) = −1: their mean −2 is clamped to z₀ = 0, so with
    # r = ±2 and β = ½ both examples lose 1 − σ(1) (unclamped it would be 1 − σ(½·4) and 1 − σ(0) = ½)
    loss, m = _kto([-1.0, -6.0], [-3.0, -4.0], [-12.0, -5.0], [-9.0, -4.0], [True, False], beta=0.5)
    assert float(m["kl"]) == 0.0
    assert float(loss) == pytest.approx(1 - sigmoid(1.0), rel=1e-6)


def test_kto_batches_of_one_kind_give_finite_metrics():
    """No undesirable example: their means are 0 (not 0/0 = NaN), their count 0, and so is the margin."""
    loss, m = _kto([-1.0, -2.0], [-2.0, -2.5], [-3.0, -3.0], [-3.5, -2.5], [True, True], beta=0.5)
    assert all(np.isfinite(float(v)) for v in (loss, *m.values()))
    assert (
        int(m["count/rejected"]) == 0
        and float(m["rewards/rejected"]) == 0.0
        and float(m["logps/rejected"]) == 0.0
    )
    assert float(m["rewards/margins"]) == 0.0 and float(m["rewards/chosen"]) == pytest.approx(
        0.5 * (1.0 + 0.5) / 2
    )


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_float64_rederivation(loss_type):
    """From the paper's form: L = mean over examples of λ_y − v(x, y), v = λ_D σ(β(r − z₀)) for a desirable
    y and λ_U σ(β(z₀ − r)) for an undesirable one; APO-zero's unpaired loss as TRL writes it."""
    rng = np.random.default_rng(4)
    n, beta, w_d, w_u = 24, 0.2, 1.3, 0.7
    logps, ref_logps = rng.uniform(-40, -5, n), rng.uniform(-40, -5, n)
    kl_logps = rng.uniform(-40, -5, n)
    ref_kl_logps = kl_logps - rng.uniform(0.0, 4.0, n)  # the mismatched log-ratios average ~2: z₀ > 0
    desirable = rng.uniform(size=n) < 0.4
    r = logps - ref_logps
    sig = lambda x: 1 / (1 + np.exp(-x))
    if loss_type == "kto":
        z0 = max(0.0, float(np.mean(kl_logps - ref_kl_logps)))
        value = np.where(desirable, w_d * sig(beta * (r - z0)), w_u * sig(beta * (z0 - r)))
        want = np.mean(np.where(desirable, w_d, w_u) - value)
    else:
        z0 = 0.0
        want = np.mean(np.where(desirable, w_d * (1 - sig(beta * r)), w_u * sig(beta * r)))
    loss, m = kto_loss(
        *map(jnp.asarray, (logps, ref_logps, kl_logps, ref_kl_logps, desirable)),
        beta=beta,
        desirable_weight=w_d,
        undesirable_weight=w_u,
        loss_type=loss_type,
    )
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(m["kl"]), z0, rtol=1e-5)
    chosen, rejected = beta * r[desirable].mean(), beta * r[~desirable].mean()
    np.testing.assert_allclose(
        [m["rewards/chosen"], m["rewards/rejected"], m["rewards/margins"]],
        [chosen, rejected, chosen - rejected],
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        [m["logps/chosen"], m["logps/rejected"]],
        [logps[desirable].mean(), logps[~desirable].mean()],
        rtol=1e-5,
    )
    assert int(m["count/chosen"]) == desirable.sum() and int(m["count/rejected"]) == (~desirable).sum()


def test_kto_direction_and_detached_reference_point():
    """Raising a desirable example's log-prob lowers the loss, raising an undesirable one's raises it; no
    gradient reaches the mismatched pairs (z₀ is a detached reference point, not a target)."""
    logps, ref_logps = jnp.array([-10.0, -12.0, -11.0]), jnp.array([-10.5, -11.0, -10.0])
    kl_logps, ref_kl_logps = jnp.array([-9.0, -8.0, -7.0]), jnp.array([-10.0, -9.0, -7.5])  # z₀ = 5/6
    labels = jnp.array([True, False, True])
    g, g_kl = jax.grad(lambda x, k: kto_loss(x, ref_logps, k, ref_kl_logps, labels)[0], argnums=(0, 1))(
        logps, kl_logps
    )
    assert g[0] < 0 and g[2] < 0 and g[1] > 0
    assert (np.asarray(g_kl) == 0).all()
    loss = lambda x: float(kto_loss(x, ref_logps, kl_logps, ref_kl_logps, labels)[0])
    assert loss(logps.at[0].add(1.0)) < loss(logps) < loss(logps.at[1].add(1.0))


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


def test_reward_loss_equal_scores_extremes_and_gradients_float64():
    # equal scores: every margin 0, −log σ(0) = log 2 whatever the scores; a tie is not a correct ranking
    loss, m = reward_loss(jnp.array([3.0, -7.0]), jnp.array([3.0, -7.0]))
    assert float(loss) == pytest.approx(LOG2, abs=1e-6)
    assert float(m["rewards/chosen"]) == pytest.approx((3 - 7) / 2) and float(
        m["rewards/rejected"]
    ) == pytest.approx(-2.0)
    assert float(m["rewards/accuracies"]) == 0.0 and float(m["rewards/margins"]) == 0.0
    # margins +100 and −100: softplus(−100) ≈ 0 and softplus(100) ≈ 100, no overflow: mean 50
    loss, m = reward_loss(jnp.array([100.0, 0.0]), jnp.array([0.0, 100.0]))
    assert np.isfinite(float(loss)) and float(loss) == pytest.approx(100 / 2, rel=1e-6)
    assert float(m["rewards/accuracies"]) == 0.5
    # float64 on random scores: the loss, and d loss/d chosen = −σ(−margin)/B, d loss/d rejected = +σ(−margin)/B
    rng = np.random.default_rng(1)
    c, r = rng.normal(size=32) * 3, rng.normal(size=32) * 3
    margin = c - r
    loss, m = reward_loss(jnp.array(c, jnp.float32), jnp.array(r, jnp.float32))
    np.testing.assert_allclose(float(loss), np.mean(np.logaddexp(0.0, -margin)), rtol=1e-5)
    np.testing.assert_allclose(
        [m["rewards/margins"], m["rewards/accuracies"]],
        [margin.mean(), np.mean(margin > 0)],
        rtol=1e-5,
        atol=1e-6,
    )
    gc, gr = jax.grad(lambda a, b: reward_loss(a, b)[0], argnums=(0, 1))(
        jnp.array(c, jnp.float32), jnp.array(r, jnp.float32)
    )
    sig = 1 / (1 + np.exp(margin))  # σ(−margin)
    np.testing.assert_allclose(gc, -sig / 32, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(gr, sig / 32, rtol=1e-4, atol=1e-9)
    assert (np.asarray(gc) < 0).all() and (np.asarray(gr) > 0).all()  # raise chosen, lower rejected


# ---------------------------------------------------------------------------
# ppo.py: rewards, GAE, whitening, the clipped policy and value losses
# ---------------------------------------------------------------------------
def test_ppo_reward_placement_and_kl():
    logprobs = jnp.array([[-1.0, -2.0, -0.5, -3.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = jnp.array([[-1.5, -1.0, -0.5, -9.0], [-2.0, -1.0, -1.0, -1.0]])
    scores, lengths = jnp.array([2.0, -1.0]), jnp.array([2, 3])
    rewards, kl, nsr = compute_rewards(scores, logprobs, ref, lengths, kl_coef=0.1)
    # k1 = logπ - logπref on real tokens; 0 after the EOS (row 0, position 3)
    np.testing.assert_allclose(kl, [[0.5, -1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    # score added on the last real token only: -0.1·kl + score there
    np.testing.assert_allclose(rewards, [[-0.05, 0.1, 2.0, 0.0], [-0.1, 0.0, 0.0, -1.0]], rtol=1e-6)
    np.testing.assert_allclose(nsr, -0.1 * np.asarray(kl))
    _, kl3, _ = compute_rewards(scores, logprobs, ref, lengths, kl_coef=0.1, kl_estimator="k3")
    logr = np.array([[-0.5, 1.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(kl3, np.expm1(logr) - logr, rtol=1e-6)
    assert (np.asarray(kl3) >= 0).all()


def test_ppo_gae_worked_example():
    rewards, values = jnp.array([[0.0, 0.0, 1.0]]), jnp.array([[0.5, 0.5, 0.5]])
    adv, ret = compute_gae(rewards, values, jnp.ones((1, 3), bool), gamma=0.9, lam=0.5)
    d2 = 1.0 + 0.9 * 0.0 - 0.5  # the value after the last token is 0
    d1 = d0 = 0.0 + 0.9 * 0.5 - 0.5
    a2 = d2
    a1 = d1 + 0.9 * 0.5 * a2
    a0 = d0 + 0.9 * 0.5 * a1
    np.testing.assert_allclose(adv, [[a0, a1, a2]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[a0 + 0.5, a1 + 0.5, a2 + 0.5]], rtol=1e-6)


def test_ppo_gae_matches_python_loop_and_ignores_padding():
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
    np.testing.assert_allclose(
        np.where(mask, ret, 0), np.where(mask, expected + values, 0), rtol=1e-4, atol=1e-5
    )
    garbage = np.where(mask, values, 1e3)  # padded values must not leak in
    adv2, _ = compute_gae(
        jnp.array(np.where(mask, rewards, 1e3)), jnp.array(garbage), jnp.array(mask), gamma, lam
    )
    np.testing.assert_allclose(np.where(mask, adv2, 0), expected, rtol=1e-4, atol=1e-5)


def test_ppo_masked_whitening():
    rng = np.random.default_rng(2)
    x = rng.normal(3.0, 2.0, size=(3, 5))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)
    w = np.asarray(whiten(jnp.array(np.where(mask, x, 1e6)), jnp.array(mask)))
    v = x[mask]
    np.testing.assert_allclose(w[mask], (v - v.mean()) / v.std(ddof=1), rtol=1e-4)
    assert (w[~mask] == 0).all()
    kept = np.asarray(whiten(jnp.array(x), jnp.array(mask), shift_mean=False))
    np.testing.assert_allclose(kept[mask], (v - v.mean()) / v.std(ddof=1) + v.mean(), rtol=1e-4)


def _ppo_loss(new_lp, new_v, lp, v, adv, ret, mask=None, **kw):
    arr = lambda x: jnp.array([x], jnp.float32)
    mask = jnp.ones((1, len(new_lp)), bool) if mask is None else jnp.array([mask])
    return ppo_loss(
        arr(new_lp),
        arr(new_v),
        logprobs=arr(lp),
        values=arr(v),
        advantages=arr(adv),
        returns=arr(ret),
        mask=mask,
        cliprange=kw.get("c", 0.2),
        cliprange_value=kw.get("cv", 0.2),
        vf_coef=0.1,
    )


def test_ppo_policy_loss_hand_cases():
    # ratio e^0.5 ≈ 1.65 outside [0.8, 1.2], advantage +1: the clipped term wins, -1.2
    _, m = _ppo_loss([0.5], [0.0], [0.0], [0.0], [1.0], [0.0])
    np.testing.assert_allclose(m["loss/policy_avg"], -1.2, rtol=1e-6)
    assert m["policy/clipfrac_avg"] == 1.0
    # same ratio, advantage -1: the pessimistic max keeps the unclipped e^0.5
    _, m = _ppo_loss([0.5], [0.0], [0.0], [0.0], [-1.0], [0.0])
    np.testing.assert_allclose(m["loss/policy_avg"], np.exp(0.5), rtol=1e-6)
    assert m["policy/clipfrac_avg"] == 0.0
    # ratio e^0.1 inside the range, advantage 2: plain -2·e^0.1; approxkl = ½·0.1²
    _, m = _ppo_loss([0.1], [0.0], [0.0], [0.0], [2.0], [0.0])
    np.testing.assert_allclose(
        [m["loss/policy_avg"], m["policy/approxkl_avg"]], [-2 * np.exp(0.1), 0.005], rtol=1e-5
    )


def test_ppo_value_loss_hand_cases():
    # new value 0.5 moves 0.5 from the rollout value 0 > cliprange_value 0.2: clipped 0.2,
    # (0.2 - 1)² = 0.64 > (0.5 - 1)² = 0.25, the max is 0.64, loss ½·0.64
    loss, m = _ppo_loss([0.0], [0.5], [0.0], [0.0], [0.0], [1.0])
    np.testing.assert_allclose(m["loss/value_avg"], 0.5 * 0.64, rtol=1e-6)
    np.testing.assert_allclose(loss, 0.1 * 0.32, rtol=1e-6)
    assert m["val/clipfrac_avg"] == 1.0
    # inside the clip range: ½·(0.1 - 1)²
    _, m = _ppo_loss([0.0], [0.1], [0.0], [0.0], [0.0], [1.0])
    np.testing.assert_allclose(m["loss/value_avg"], 0.5 * 0.81, rtol=1e-6)
    assert m["val/clipfrac_avg"] == 0.0
    # a padded token counts nowhere
    _, m = _ppo_loss(
        [0.0, 3.0], [0.1, 9.0], [0.0, 0.0], [0.0, 0.0], [0.0, 5.0], [1.0, -9.0], mask=[True, False]
    )
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
    f32 = lambda x: jnp.array(x, jnp.float32)
    loss, m = ppo_loss(
        f32(new_lp),
        f32(new_v),
        logprobs=f32(lp),
        values=f32(v),
        advantages=f32(adv),
        returns=f32(ret),
        mask=jnp.array(mask),
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
    )
    np.testing.assert_allclose(
        [m["loss/policy_avg"], m["loss/value_avg"], loss], [pg, vf, pg + 0.1 * vf], rtol=1e-5
    )

    # direction: with a positive advantage, raising the token's log-prob lowers the loss
    def loss_of(x):  # one token: old log-prob, values and return 0, advantage 1
        return ppo_loss(
            x,
            jnp.zeros((1, 1)),
            logprobs=jnp.zeros((1, 1)),
            values=jnp.zeros((1, 1)),
            advantages=jnp.ones((1, 1)),
            returns=jnp.zeros((1, 1)),
            mask=jnp.ones((1, 1), bool),
            cliprange=0.2,
            cliprange_value=0.2,
            vf_coef=0.1,
        )[0]

    grad = jax.grad(loss_of)(jnp.zeros((1, 1)))
    assert grad[0, 0] < 0


def test_ppo_value_loss_direction_and_clipped_values_have_no_gradient():
    def grad(new_v, ret):  # d loss / d V_new on one token: old value 0, advantage 0, vf_coef 0.1
        zero = jnp.zeros((1, 1))

        def f(x):
            return ppo_loss(
                zero,
                x,
                logprobs=zero,
                values=zero,
                advantages=zero,
                returns=jnp.full((1, 1), ret),
                mask=jnp.ones((1, 1), bool),
                cliprange=0.2,
                cliprange_value=0.2,
                vf_coef=0.1,
            )[0]

        return float(jax.grad(f)(jnp.full((1, 1), new_v))[0, 0])

    # inside the clip range: d/dV ½·0.1·(V − R)² = 0.1·(V − R), so V moves toward the return
    assert grad(0.1, 1.0) == pytest.approx(0.1 * (0.1 - 1.0), rel=1e-6) and grad(0.1, 1.0) < 0
    assert grad(-0.1, -1.0) == pytest.approx(0.1 * (-0.1 + 1.0), rel=1e-6) and grad(-0.1, -1.0) > 0
    # V_new 0.5 beyond V_old + 0.2, return 1: the clipped term (0.2 − 1)² = 0.64 > (0.5 − 1)² is the
    # max, and it does not depend on V_new
    assert grad(0.5, 1.0) == 0.0


# ---------------------------------------------------------------------------
# grpo.py: group advantages, the k3 KL estimator, the clipped loss in each aggregation mode, at token
# and at sequence level (GSPO)
# ---------------------------------------------------------------------------
def test_grpo_group_advantages_worked_example():
    # two groups of G=4: rewards 1, 0, 0, 1 (mean ½) and 0.5 × 4 (all equal: no signal)
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv, std = group_advantages(rewards, 4)
    s = np.sqrt(4 * 0.5**2 / 3)  # sample std (÷ G-1) of 1, 0, 0, 1
    a = 0.5 / (s + EPS)
    np.testing.assert_allclose(adv, [a, -a, -a, a, 0, 0, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(std, [s, 0.0], rtol=1e-6)
    # Dr. GRPO: no division, the raw centred rewards
    np.testing.assert_allclose(group_advantages(rewards, 4, "none")[0], [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    # batch: ÷ the std of all eight rewards (mean 0.5; four deviations of ±0.5, four of 0)
    sb = np.sqrt(4 * 0.5**2 / 7)
    np.testing.assert_allclose(
        group_advantages(rewards, 4, "batch")[0],
        np.array([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (sb + EPS),
        rtol=1e-6,
    )


def test_grpo_group_advantages_numpy_float64():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=48)
    grouped = rewards.reshape(6, 8)
    centred = grouped - grouped.mean(1, keepdims=True)
    expected = {
        "group": centred / (grouped.std(1, ddof=1, keepdims=True) + EPS),
        "batch": centred / (rewards.std(ddof=1) + EPS),
        "none": centred,
    }
    for scale, want in expected.items():
        got, std = group_advantages(jnp.array(rewards, jnp.float32), 8, scale)
        np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-4, atol=1e-5, err_msg=scale)
    np.testing.assert_allclose(std, grouped.std(1, ddof=1), rtol=1e-5)
    # every group's advantages sum to zero: the group mean is the baseline
    np.testing.assert_allclose(np.asarray(got).reshape(6, 8).sum(1), 0, atol=1e-5)


def test_rft_is_sft_on_the_accepted_completions():
    """--accept-reward (compare.py's rft row): rewards 1, 0.6, 1, 0 at threshold 1 accept the first and third;
    with the others out of the mask, GRPO's on-policy step (ratio 1, dapo: ÷ the kept tokens) has SFT's
    gradient: −1/3 on each of the 3 accepted real tokens (2 + 1), 0 on every other token."""
    adv, accepted = rft_advantages(np.array([1.0, 0.6, 1.0, 0.0]), 1.0)
    np.testing.assert_array_equal(adv, [1, 0, 1, 0])
    np.testing.assert_array_equal(accepted, [True, False, True, False])
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], bool) & accepted[:, None]
    logps = jnp.log(jnp.array(np.random.default_rng(0).uniform(0.1, 0.9, (4, 3)), jnp.float32))
    loss_of = lambda lp: _grpo_loss(lp, jax.lax.stop_gradient(lp), adv, mask)[0]
    grad = jax.grad(loss_of)(logps)
    np.testing.assert_allclose(grad, np.where(mask, -1 / 3, 0.0), rtol=1e-6)
    # the same as SFT's token-mean NLL over those tokens, −Σ_kept log π / 3
    nll = lambda lp: -jnp.sum(jnp.where(mask, lp, 0.0)) / mask.sum()
    np.testing.assert_allclose(grad, jax.grad(nll)(logps), rtol=1e-6)


def test_grpo_k3_by_hand_and_unbiased_on_samples_from_pi():
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


def _grpo_loss(
    logps, old, advantages, mask, ref=None, beta=0.0, loss_type="dapo", eps=0.2, eps_high=0.2, level="token"
):
    arr = lambda x: None if x is None else jnp.array(x, jnp.float32)
    return grpo_loss(
        arr(logps),
        arr(old),
        arr(ref),
        arr(advantages),
        jnp.array(mask, bool),
        epsilon=eps,
        epsilon_high=eps_high,
        beta=beta,
        loss_type=loss_type,
        importance_sampling_level=level,
    )


def test_grpo_aggregation_modes_by_hand():
    # ratio 1 everywhere, advantages 1 and 2: per-token losses -1, -1 (2 real tokens) and -2 (1 real
    # token, the rest padding that holds garbage and must not count)
    lp = [[-1.0, -2.0, -9.0], [-1.0, -9.0, -9.0]]
    mask = [[True, True, False], [True, False, False]]
    by_mode = {
        "dapo": (-1 - 1 - 2) / 3,  # token mean over the batch's 3 real tokens
        "grpo": (-(1 + 1) / 2 - 2 / 1) / 2,  # each completion's mean, then the mean of those
        "dr_grpo": (-1 - 1 - 2) / (2 * 3),
    }  # ÷ (B × R), fixed
    for mode, want in by_mode.items():
        loss, m = _grpo_loss(lp, lp, [1.0, 2.0], mask, loss_type=mode)
        np.testing.assert_allclose(loss, want, rtol=1e-6, err_msg=mode)
        assert m["clip_ratio"] == 0.0 and "kl" not in m  # β = 0: no KL term, no reference


def test_grpo_clipping_by_hand():
    # ratio e^0.5 ≈ 1.65, advantage +1: clipped at 1+ε → loss −1.2; with ε_high 0.28 → −1.28
    loss, m = _grpo_loss([[0.5]], [[0.0]], [1.0], [[True]])
    np.testing.assert_allclose(loss, -1.2, rtol=1e-6)
    assert m["clip_ratio/high_mean"] == 1.0 and m["clip_ratio"] == 1.0
    np.testing.assert_allclose(
        _grpo_loss([[0.5]], [[0.0]], [1.0], [[True]], eps_high=0.28)[0], -1.28, rtol=1e-6
    )
    # ratio e^-0.5 ≈ 0.61, advantage −1: min(−0.61, −0.8) = −0.8 → loss +0.8, clipped from below
    loss, m = _grpo_loss([[-0.5]], [[0.0]], [-1.0], [[True]])
    np.testing.assert_allclose(loss, 0.8, rtol=1e-6)
    assert m["clip_ratio/low_mean"] == 1.0
    # ratio e^0.5 with advantage −1: the pessimistic min keeps the unclipped e^0.5, not clipped
    loss, m = _grpo_loss([[0.5]], [[0.0]], [-1.0], [[True]])
    np.testing.assert_allclose(loss, np.exp(0.5), rtol=1e-6)
    assert m["clip_ratio"] == 0.0


def test_grpo_kl_term_by_hand():
    # π = 0.5, π_ref = 0.25 on one token, ratio 1, advantage 0: loss = β · (log 2 − 0.5)
    loss, m = _grpo_loss([[np.log(0.5)]], [[np.log(0.5)]], [0.0], [[True]], ref=[[np.log(0.25)]], beta=0.04)
    np.testing.assert_allclose(loss, 0.04 * (np.log(2) - 0.5), rtol=1e-5)
    np.testing.assert_allclose(m["kl"], np.log(2) - 0.5, rtol=1e-5)


def test_grpo_loss_numpy_float64_every_mode():
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
    want = {
        "dapo": x.sum() / mask.sum(),
        "grpo": np.mean(x.sum(1) / mask.sum(1)),
        "dr_grpo": x.sum() / (b * r),
    }
    for mode, w in want.items():
        loss, _ = _grpo_loss(
            lp, old, adv, mask, ref=ref, beta=beta, loss_type=mode, eps=eps, eps_high=eps_high
        )
        np.testing.assert_allclose(loss, w, rtol=1e-5, err_msg=mode)


def test_grpo_loss_direction_and_clipped_tokens_have_no_gradient():
    """A positive advantage raises the token's log-prob; a clipped token gets no gradient; with
    old = stop_gradient(new) (one update per batch) the gradient is the plain policy gradient −A."""

    def grad(lp, old, adv):
        return jax.grad(lambda x: _grpo_loss(x, old, adv, [[True, True]])[0])(jnp.array(lp))

    g = np.asarray(grad([[0.0, 0.5]], [[0.0, 0.0]], [1.0]))
    assert g[0, 0] < 0 and g[0, 1] == 0.0  # token 2 sits above 1+ε with A > 0: clipped, no gradient
    on_policy = jax.grad(lambda x: _grpo_loss(x, jax.lax.stop_gradient(x), [2.0], [[True, True]])[0])(
        jnp.zeros((1, 2))
    )
    np.testing.assert_allclose(on_policy, [[-2.0 / 2, -2.0 / 2]], rtol=1e-6)  # −A / (number of tokens)


def test_grpo_aggregate_ignores_padding_values():
    x = jnp.array([[1.0, 2.0, 5.0]])
    mask = jnp.array([[True, True, False]])
    for mode in ("dapo", "grpo", "dr_grpo", "luspo"):
        aggregate = AGGREGATIONS.get(mode, token_mean)
        assert aggregate(x, mask) == aggregate(x.at[0, 2].set(1e9), mask)


# GSPO (--importance-sampling-level sequence): one length-normalised ratio per completion (docs/grpo.md eq. 6)
def test_gspo_sequence_ratio_by_hand():
    # R = 4. Completion 1: 2 real tokens, log-ratios 0.1, 0.3 → log s = 0.2, s = e^0.2 ≈ 1.221 > 1.2, Â = +1:
    #   clipped from above, term −1.2. Completion 2: 3 real tokens, log-ratios −0.5, −0.1, −0.3
    #   → log s = −0.3, s ≈ 0.741 < 0.8, Â = −0.5: min(−0.5 s, −0.5 · 0.8) = −0.4 → term +0.4, clipped below.
    #   Completion 3: 1 real token, log-ratio 0.1 → s = e^0.1 inside the clip, Â = +2: term −2 e^0.1.
    # Padding holds 50 (π) against 0 (π_old): were it counted, every ratio would explode.
    lp = [[0.1, 0.3, 50.0, 50.0], [-0.5, -0.1, -0.3, 50.0], [0.1, 50.0, 50.0, 50.0]]
    old = np.zeros((3, 4))
    mask = [[True, True, False, False], [True, True, True, False], [True, False, False, False]]
    adv = [1.0, -0.5, 2.0]
    t1, t2, t3 = -1.2, 0.4, -2 * np.exp(0.1)
    by_mode = {
        "grpo": (t1 + t2 + t3) / 3,  # the paper: one term per completion, averaged
        "dapo": (2 * t1 + 3 * t2 + 1 * t3) / 6,  # each term on each of its real tokens, ÷ 6 tokens
        "dr_grpo": (2 * t1 + 3 * t2 + 1 * t3) / (3 * 4),
    }  # ÷ (B × R)
    for mode, want in by_mode.items():
        loss, m = _grpo_loss(lp, old, adv, mask, loss_type=mode, level="sequence")
        np.testing.assert_allclose(loss, want, rtol=1e-6, err_msg=mode)
        # clip shares over the 3 completions: one clipped from above, one from below
        np.testing.assert_allclose(
            [m["clip_ratio/high_mean"], m["clip_ratio/low_mean"], m["clip_ratio"]],
            [1 / 3, 1 / 3, 2 / 3],
            rtol=1e-6,
            err_msg=mode,
        )
    # per token instead: tokens 0.3 (above), −0.5 and −0.3 (below) are clipped, 3 of the 6 real tokens
    assert _grpo_loss(lp, old, adv, mask)[1]["clip_ratio"] == 0.5


def test_gspo_loss_numpy_float64():
    """From the paper's definitions, on sequences cut to their length: s_i = (π_θ(y_i) / π_old(y_i))^(1/|y_i|)
    with π(y) = Π_t π(y_t), J_i = min(s_i Â_i, clip(s_i, 1−ε, 1+ε_high) Â_i), plus β k3 on each real token."""
    rng = np.random.default_rng(2)
    b, r, eps, eps_high, beta = 8, 7, 0.2, 0.28, 0.1
    lengths = rng.integers(1, r + 1, b)
    lp = rng.normal(-2, 0.5, (b, r))
    old = lp + rng.normal(0, 0.4, (b, r))
    ref = rng.normal(-2, 0.3, (b, r))
    adv = rng.normal(size=b)
    mask = np.arange(r)[None] < lengths[:, None]
    lp_padded = np.where(mask, lp, rng.normal(0, 20, (b, r)))  # garbage after each completion's end
    objective, kl_sums, high, low = [], [], [], []
    for i, n in enumerate(lengths):
        s = (np.prod(np.exp(lp[i, :n])) / np.prod(np.exp(old[i, :n]))) ** (1.0 / n)
        objective.append(min(s * adv[i], np.clip(s, 1 - eps, 1 + eps_high) * adv[i]))
        kl_sums.append(np.sum(np.exp(ref[i, :n] - lp[i, :n]) - (ref[i, :n] - lp[i, :n]) - 1))
        high.append(s > 1 + eps_high and adv[i] > 0)
        low.append(s < 1 - eps and adv[i] < 0)
    objective, kl_sums = np.array(objective), np.array(kl_sums)
    assert 0 < np.mean(high) + np.mean(low) < 1  # the inputs exercise both the clip and the unclipped branch
    want = {
        "grpo": np.mean(-objective + beta * kl_sums / lengths),
        "dapo": np.sum(-lengths * objective + beta * kl_sums) / lengths.sum(),
        "dr_grpo": np.sum(-lengths * objective + beta * kl_sums) / (b * r),
    }
    for mode, w in want.items():
        loss, m = _grpo_loss(
            lp_padded,
            old,
            adv,
            mask,
            ref=ref,
            beta=beta,
            loss_type=mode,
            eps=eps,
            eps_high=eps_high,
            level="sequence",
        )
        np.testing.assert_allclose(loss, w, rtol=1e-5, err_msg=mode)
        np.testing.assert_allclose(
            [m["clip_ratio/high_mean"], m["clip_ratio/low_mean"]], [np.mean(high), np.mean(low)], err_msg=mode
        )


def test_gspo_equals_token_level_for_one_token_and_its_gradient_is_per_sequence():
    rng = np.random.default_rng(3)
    lp, old, ref = rng.normal(-1, 0.3, (3, 6, 4))
    adv = rng.normal(size=6)
    one = np.zeros((6, 4), bool)
    one[:, 0] = True  # one real token per completion: s_i is that token's ratio, the same loss and metrics
    for mode in ("dapo", "grpo", "dr_grpo"):
        token = _grpo_loss(lp, old, adv, one, ref=ref, beta=0.1, loss_type=mode)
        sequence = _grpo_loss(lp, old, adv, one, ref=ref, beta=0.1, loss_type=mode, level="sequence")
        np.testing.assert_allclose(sequence[0], token[0], rtol=1e-6, err_msg=mode)
        for k in token[1]:
            np.testing.assert_allclose(sequence[1][k], token[1][k], rtol=1e-6, err_msg=f"{mode} {k}")
    # Off-policy, --loss-type grpo (B = 2): ∂L/∂log π_{i,t} = −(1/B) Â_i s_i / |y_i| for every real token
    # of an unclipped completion, 0 for each token of a clipped one, 0 on padding. Completion 1: log-ratios
    # 0.05, −0.15 → s = e^−0.05, Â = 1, unclipped. Completion 2: 0.3 alone, s = e^0.3 > 1.2, Â = 1: clipped.
    old = np.zeros((2, 3))
    grad = jax.grad(
        lambda x: _grpo_loss(
            x,
            old,
            [1.0, 1.0],
            [[True, True, False], [True, False, False]],
            loss_type="grpo",
            level="sequence",
        )[0]
    )
    g = grad(jnp.array([[0.05, -0.15, 7.0], [0.3, 7.0, 7.0]]))
    s = np.exp(-0.05)
    np.testing.assert_allclose(g, [[-s / 2 / 2, -s / 2 / 2, 0.0], [0.0, 0.0, 0.0]], rtol=1e-6)
    # on-policy (π_old = sg(π_θ), s = 1) it is the token level's policy gradient in every aggregation
    mask = jnp.array(rng.random((6, 4)) > 0.4).at[:, 0].set(True)
    for mode in ("dapo", "grpo", "dr_grpo"):
        grads = [
            jax.grad(
                lambda x: _grpo_loss(x, jax.lax.stop_gradient(x), adv, mask, loss_type=mode, level=level)[0]
            )(jnp.array(lp, jnp.float32))
            for level in ("token", "sequence")
        ]
        np.testing.assert_allclose(grads[1], grads[0], rtol=1e-5, atol=1e-8, err_msg=mode)


def test_gspo_ignores_padded_log_probs():
    rng = np.random.default_rng(4)
    lp, old = rng.normal(-1, 0.3, (2, 5, 6))
    adv = rng.normal(size=5)
    mask = np.arange(6)[None] < rng.integers(1, 7, 5)[:, None]
    mask[0, -1] = False  # at least one padded token
    for mode in ("dapo", "grpo", "dr_grpo"):
        base = _grpo_loss(lp, old, adv, mask, loss_type=mode, level="sequence")
        for fill in (30.0, -30.0):  # a padded log π far from π_old: it must not move s_i
            changed = _grpo_loss(np.where(mask, lp, fill), old, adv, mask, loss_type=mode, level="sequence")
            assert changed[0] == base[0] and changed[1] == base[1], (mode, fill)


# ---------------------------------------------------------------------------
# rloo.py: the leave-one-out baseline, the sequence KL folded into the reward, the clipped sequence ratio
# ---------------------------------------------------------------------------
def _rloo_loss(logps, old, advantages, mask, eps=0.2, eps_high=0.2):
    arr = lambda x: jnp.array(x, jnp.float32)
    return rloo_loss(
        arr(logps), arr(old), arr(advantages), jnp.array(mask, bool), epsilon=eps, epsilon_high=eps_high
    )


def test_rloo_leave_one_out_baseline_by_hand():
    # k = 4, rewards 1, 0, 0, 0: completion 1's baseline is the mean of 0, 0, 0 = 0 → A = 1; each other's
    # is (1 + 0 + 0) / 3 → A = −1/3. The identity A_i = k/(k−1)·(r_i − mean r): 4/3 · (1 − ¼) = 1,
    # 4/3 · (0 − ¼) = −⅓.
    # Second group 2, 2, 2, 2: every baseline 2, A = 0.
    rewards = jnp.array([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv, std = rloo_advantages(rewards, jnp.zeros(8), 4, beta=0.05)
    np.testing.assert_allclose(adv, [1, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(adv[:4], 4 / 3 * (np.array([1, 0, 0, 0]) - 0.25), rtol=1e-6)
    np.testing.assert_allclose(std, [np.sqrt(0.75**2 + 3 * 0.25**2) / np.sqrt(3), 0.0], rtol=1e-6)
    # k = 2 (TRL's default): each completion against the other, A = r_1 − r_2 and r_2 − r_1
    pair, _ = rloo_advantages(jnp.array([3.0, 0.5]), jnp.zeros(2), 2, beta=0.0)
    np.testing.assert_allclose(pair, [2.5, -2.5])


def test_rloo_kl_folds_into_the_reward_then_the_loss_by_hand():
    # Two completions of one prompt (k = 2), rewards 1 and 0, R = 2.
    # Completion 1, 2 real tokens: log π_old −1, −2; log π_ref −1.5, −2.5 → KL_1 = 0.5 + 0.5 = 1.
    # Completion 2, 1 real token: log π_old −1, log π_ref −0.5 → KL_2 = −0.5 (k1 may be negative); its
    # padding holds 40 (π_old) against −40 (π_ref): were it counted, KL_2 would be 79.5.
    old = [[-1.0, -2.0], [-1.0, 40.0]]
    ref = [[-1.5, -2.5], [-0.5, -40.0]]
    mask = jnp.array([[True, True], [True, False]])
    kl = sequence_kl(jnp.array(old), jnp.array(ref), mask)
    np.testing.assert_allclose(kl, [1.0, -0.5], rtol=1e-6)
    # β = 0.5: shaped rewards 1 − 0.5·1 = 0.5 and 0 − 0.5·(−0.5) = 0.25 → A = 0.5 − 0.25 = 0.25 and −0.25
    adv, _ = rloo_advantages(jnp.array([1.0, 0.0]), kl, 2, beta=0.5)
    np.testing.assert_allclose(adv, [0.25, -0.25], rtol=1e-6)
    # --reward-clip-range (−1, 1) clips the rewards 5, −5 before the penalty, never the KL: shaped 1 − 0.5 · 2
    # = 0 and −1 − 0 = −1 → A = ±1 (clipping after the penalty would give 1 and −1 → A = ±2)
    clipped, _ = rloo_advantages(
        jnp.array([5.0, -5.0]), jnp.array([2.0, 0.0]), 2, beta=0.5, reward_clip_range=(-1, 1)
    )
    np.testing.assert_allclose(clipped, [1.0, -1.0], rtol=1e-6)
    # Off-policy update: completion 1's log-ratio sums to 0.05 + 0.05 = 0.1 → ratio e^0.1 inside [0.8, 1.2]:
    # term −0.25 e^0.1. Completion 2: −0.3 on its real token (its padding, 9 against 40, must not count)
    # → ratio e^−0.3 ≈ 0.741 < 0.8 with A < 0: min(−0.25 · 0.741, −0.25 · 0.8) = −0.2 → term +0.2.
    # The loss is the mean over the two completions (not over their three tokens).
    logps = [[-0.95, -1.95], [-1.3, 9.0]]
    loss, m = _rloo_loss(logps, old, adv, mask)
    np.testing.assert_allclose(loss, (-0.25 * np.exp(0.1) + 0.2) / 2, rtol=1e-5)
    assert m["clip_ratio/low_mean"] == 0.5 and m["clip_ratio/high_mean"] == 0.0
    assert m["clip_ratio/region_mean"] == 0.5
    assert m["clip_ratio/low_min"] == 0.0 and m["clip_ratio/high_max"] == 0.0  # not all / none clipped


def test_rloo_numpy_float64_from_the_definitions():
    """Leave-one-out by an explicit loop over the others, KL and sequence log-probs summed over each
    completion's real tokens only (padding holds garbage), the clipped ratio per completion, the mean."""
    rng = np.random.default_rng(5)
    k, groups, r, beta, eps, eps_high = 4, 3, 6, 0.1, 0.2, 0.28
    b = k * groups
    lengths = rng.integers(1, r + 1, b)
    mask = np.arange(r)[None] < lengths[:, None]
    rewards = rng.normal(size=b)
    old, ref = rng.normal(-2, 0.4, (b, r)), rng.normal(-2, 0.4, (b, r))
    logps = old + rng.normal(0, 0.15, (b, r))
    garbage = lambda x: np.where(mask, x, rng.normal(0, 30, (b, r)))
    shaped = [rewards[i] - beta * sum(old[i, t] - ref[i, t] for t in range(lengths[i])) for i in range(b)]
    want_adv = []
    for i in range(b):
        others = [shaped[j] for j in range(i - i % k, i - i % k + k) if j != i]
        want_adv.append(shaped[i] - sum(others) / (k - 1))
    want_adv = np.array(want_adv)
    f32 = lambda x: jnp.array(x, jnp.float32)
    kl = sequence_kl(f32(garbage(old)), f32(garbage(ref)), jnp.array(mask))
    adv, _ = rloo_advantages(jnp.array(rewards, jnp.float32), kl, k, beta=beta)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-4, atol=1e-5)
    normalised = rloo_advantages(
        jnp.array(rewards, jnp.float32), kl, k, beta=beta, normalize_advantages=True
    )[0]
    np.testing.assert_allclose(
        normalised, (want_adv - want_adv.mean()) / (np.std(want_adv, ddof=1) + 1e-4), rtol=1e-4, atol=1e-5
    )
    terms, low, high = [], [], []
    for i, n in enumerate(lengths):
        ratio = np.exp(logps[i, :n].sum() - old[i, :n].sum())
        terms.append(-min(ratio * want_adv[i], np.clip(ratio, 1 - eps, 1 + eps_high) * want_adv[i]))
        low.append(ratio < 1 - eps and want_adv[i] < 0)
        high.append(ratio > 1 + eps_high and want_adv[i] > 0)
    assert 0 < np.mean(low) + np.mean(high) < 1  # both branches exercised
    loss, m = _rloo_loss(garbage(logps), garbage(old), want_adv, mask, eps, eps_high)
    np.testing.assert_allclose(loss, np.mean(terms), rtol=1e-5)
    got = [m["clip_ratio/low_mean"], m["clip_ratio/high_mean"], m["clip_ratio/region_mean"]]
    np.testing.assert_allclose(got, [np.mean(low), np.mean(high), np.mean(np.array(low) | np.array(high))])


def test_rloo_direction_and_on_policy_gradient():
    """Raising the log-prob of the positive-advantage completion lowers the loss (and of the negative one
    raises it); on-policy (π_old = sg(π_θ)) the gradient is −A_i / B on every real token, 0 on padding."""
    mask = [[True, True, False], [True, False, False]]
    old = np.zeros((2, 3))
    lp = np.zeros((2, 3))
    adv = [1.0, -1.0]
    base = _rloo_loss(lp, old, adv, mask)[0]
    assert _rloo_loss(lp + [[0.05], [0.0]], old, adv, mask)[0] < base
    assert _rloo_loss(lp + [[0.0], [0.05]], old, adv, mask)[0] > base
    on_policy = jax.grad(lambda x: _rloo_loss(x, jax.lax.stop_gradient(x), adv, mask)[0])
    on_policy = on_policy(jnp.full((2, 3), -1.0))
    np.testing.assert_allclose(on_policy, [[-0.5, -0.5, 0.0], [0.5, 0.0, 0.0]], rtol=1e-6)


def test_rloo_clipping_by_hand():
    # one completion, two real tokens with log-ratios 0.3 + 0.2 = 0.5 → ratio e^0.5 ≈ 1.65, A = +1:
    # clipped at 1 + ε → loss −1.2, no gradient; with ε_high = 0.28 → −1.28
    mask = [[True, True]]
    loss, m = _rloo_loss([[0.3, 0.2]], [[0.0, 0.0]], [1.0], mask)
    np.testing.assert_allclose(loss, -1.2, rtol=1e-6)
    assert m["clip_ratio/high_mean"] == m["clip_ratio/high_max"] == m["clip_ratio/region_mean"] == 1.0
    loss_high = _rloo_loss([[0.3, 0.2]], [[0.0, 0.0]], [1.0], mask, eps_high=0.28)[0]
    np.testing.assert_allclose(loss_high, -1.28, rtol=1e-6)
    grad = jax.grad(lambda x: _rloo_loss(x, [[0.0, 0.0]], [1.0], mask)[0])(jnp.array([[0.3, 0.2]]))
    assert np.all(np.asarray(grad) == 0.0)
    # ratio e^−0.5 ≈ 0.61, A = −1: clipped from below at 1 − ε → loss +0.8
    loss, m = _rloo_loss([[-0.5, 0.0]], [[0.0, 0.0]], [-1.0], mask)
    np.testing.assert_allclose(loss, 0.8, rtol=1e-6)
    assert m["clip_ratio/low_mean"] == 1.0 and m["clip_ratio/low_min"] == 1.0
    # ratio e^0.5 with A = −1: the pessimistic min keeps the unclipped e^0.5, and its gradient
    loss, m = _rloo_loss([[0.3, 0.2]], [[0.0, 0.0]], [-1.0], mask)
    np.testing.assert_allclose(loss, np.exp(0.5), rtol=1e-6)
    assert m["clip_ratio/region_mean"] == 0.0
    # inside [1 − ε, 1 + ε]: the plain ratio, e^0.1 · A
    inside = _rloo_loss([[0.1, 0.0]], [[0.0, 0.0]], [2.0], mask)[0]
    np.testing.assert_allclose(inside, -2 * np.exp(0.1), rtol=1e-6)


# ---------------------------------------------------------------------------
# Log-probs: sequence_logps (shift, padding), token_logps against the model's full logits
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("module", [dpo, simpo, orpo, kto])
def test_sequence_logps_shift_and_padding(module):
    logps = jnp.array([[-1.0, -2.0, -3.0, -4.0, 9.0, 9.0]])  # position t scores token t+1
    mask = jnp.array([[False, False, True, True, True, False, False]])  # BOS, prompt, 3 response, 2 pad
    assert float(module.sequence_logps(logps, mask)[0]) == -2.0 - 3.0 - 4.0
    assert float(module.sequence_logps(logps, mask, average=True)[0]) == pytest.approx(-3.0)
    padded = module.sequence_logps(
        jnp.pad(logps, ((0, 0), (0, 5)), constant_values=7.0), jnp.pad(mask, ((0, 0), (0, 5)))
    )
    assert float(padded[0]) == -9.0


def test_padding_invariance_of_sequence_logps_through_the_model(prefs):
    mesh, model, pairs = prefs
    params, frozen = common.split_variables(model.backbone)
    fwd = jax.jit(lambda b: dpo.concatenated_forward(model.backbone, params, frozen, b)[0])
    short = fwd(dpo.pad_examples(pairs, 32))
    long = fwd(dpo.pad_examples(pairs, 48))
    for k in short:
        np.testing.assert_allclose(np.asarray(short[k]), np.asarray(long[k]), rtol=1e-5, atol=1e-4)
    chosen = np.asarray(short["chosen_logps"])
    assert np.all(chosen < 0) and not np.allclose(chosen, short["rejected_logps"])
    # --sft-weight's NLL: the chosen sums negated, also when IPO averages the log-probs
    mean = jax.jit(lambda b: dpo.concatenated_forward(model.backbone, params, frozen, b, average=True)[0])
    averaged = mean(dpo.pad_examples(pairs, 32))
    np.testing.assert_allclose(np.asarray(short["nll"]), -chosen, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(averaged["nll"]), np.asarray(short["nll"]), rtol=1e-5)
    assert np.all(np.asarray(averaged["chosen_logps"]) > chosen)  # means of negative sums: larger


def test_kto_padding_invariance_through_the_model(prefs):
    """kto.concatenated_forward: each example and its mismatched pair score the same at two paddings."""
    _, model, _ = prefs
    path = os.path.join(ROOT, "data", "kto_eval.jsonl")
    examples = kto.read_examples(path, common.chat_template("tiny"))
    rows, _ = kto.tokenize_dataset(
        examples[:4] + examples[-4:], model.preprocessor.tokenizer, 512, path, seed=0
    )
    params, frozen = common.split_variables(model.backbone)
    fwd = jax.jit(lambda b: kto.concatenated_forward(model.backbone, params, frozen, b))
    short, long = fwd(kto.pad_examples(rows, 32)), fwd(kto.pad_examples(rows, 48))
    for a, b in zip(short, long):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(short[0]) < 0) and not np.allclose(short[0], short[1])  # another completion


@pytest.fixture(scope="module")
def tiny():
    mesh = common.make_mesh()
    model = common.load_model("tiny", mesh, "float32", seed=0)
    params, frozen = common.split_variables(model.backbone)
    return model, params, frozen


def test_token_logps_match_full_logits_and_padding(tiny, monkeypatch):
    model, params, frozen = tiny
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 300, (2, 11)).astype(np.int32)
    mask = np.ones_like(ids, bool)
    mask[1, 7:] = False  # row 1 is right-padded
    monkeypatch.setattr(model.backbone, "logits_chunk", 4, raising=False)  # --logits-chunk 4: chunks 4+4+2
    chunked = jax.jit(lambda p, i, m: token_logps(model.backbone, p, frozen, i, m)[0])
    logps = chunked(params, ids, mask)
    # Reference: full [B, T, V] logits from the KerasHub model itself, float64 log-softmax.
    logits = np.asarray(model({"token_ids": ids, "padding_mask": mask}), np.float64)
    ref = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    ref = np.take_along_axis(ref[:, :-1], ids[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(logps)[0], ref[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(logps)[1, :6], ref[1, :6], rtol=1e-4, atol=1e-4)
    # Padding invariance: the same row with more right padding gives the same log-probs.
    longer = np.pad(ids[1:, :7], ((0, 0), (0, 9)))
    longer_mask = np.pad(mask[1:, :7], ((0, 0), (0, 9)))
    whole = jax.jit(lambda p, i, m: token_logps(model.backbone, p, frozen, i, m)[0])
    padded = whole(params, longer, longer_mask)
    np.testing.assert_allclose(np.asarray(padded)[0, :6], np.asarray(logps)[1, :6], rtol=1e-5, atol=1e-5)
