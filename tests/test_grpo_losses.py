"""grpo.py's TRL loss types beyond dapo / grpo / dr_grpo (those and GSPO are in test_losses.py): bnpo, cispo,
sapo, luspo, vespo, --top-entropy-quantile and --entropy-coef. Each: a case whose expected value is written as
arithmetic, a float64 NumPy re-derivation on random inputs, and a direction check (raising a positive-advantage
token's log-prob lowers the loss, unless its weight is clipped or gated to 0); and one short CLI run showing the
flags reach the loss."""

import math

import numpy as np
import pytest

import common  # noqa: F401  (first: KERAS_BACKEND=jax)
import jax
import jax.numpy as jnp
from grpo import grpo_loss
from helpers import metrics, one_device_env, run_script

SAPO = (1.0, 1.05)  # TRL's τ_pos, τ_neg
VESPO = (2.0, 3.0, 3.0, 2.0)  # TRL's k_pos, λ_pos, k_neg, λ_neg


def _loss(
    lp,
    old,
    adv,
    mask,
    loss_type,
    ref=None,
    beta=0.0,
    eps=0.2,
    eps_high=0.2,
    level="token",
    entropy=None,
    rho=1.0,
    coef=0.0,
):
    arr = lambda x: None if x is None else jnp.array(x, jnp.float32)
    return grpo_loss(
        arr(lp),
        arr(old),
        arr(ref),
        arr(adv),
        jnp.array(mask, bool),
        epsilon=eps,
        epsilon_high=eps_high,
        beta=beta,
        loss_type=loss_type,
        importance_sampling_level=level,
        entropy=arr(entropy),
        top_entropy_quantile=rho,
        entropy_coef=coef,
        sapo_temperature_pos=SAPO[0],
        sapo_temperature_neg=SAPO[1],
        vespo_k_pos=VESPO[0],
        vespo_lambda_pos=VESPO[1],
        vespo_k_neg=VESPO[2],
        vespo_lambda_neg=VESPO[3],
    )


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------------------
# by hand
# ---------------------------------------------------------------------------
def test_bnpo_is_the_token_mean_of_the_batch():
    # ratio 1, advantages 1 and 2: per-token −1, −1 (2 real tokens) and −2 (1 real token; padding holds garbage).
    # No gradient accumulation here: the local batch is the batch, so bnpo equals dapo.
    lp = [[-1.0, -2.0, -9.0], [-1.0, -9.0, -9.0]]
    mask = [[True, True, False], [True, False, False]]
    loss, m = _loss(lp, lp, [1.0, 2.0], mask, "bnpo")
    np.testing.assert_allclose(loss, (-1 - 1 - 2) / 3, rtol=1e-6)
    assert m["clip_ratio"] == 0.0


def test_cispo_by_hand():
    # Token log-ratios 0 and 0.5 (ratios 1 and e^0.5 ≈ 1.65), cap ε_high = 1.2, Â = 2: weights min(1, 1.2) = 1
    # and min(e^0.5, 1.2) = 1.2; per token −w Â log π: −1·2·(−1) = 2 and −1.2·2·(−2) = 4.8; ÷ 2 real tokens.
    lp, old = [[-1.0, -2.0, 40.0]], [[-1.0, -2.5, 0.0]]  # the padded third token holds garbage
    mask = [[True, True, False]]
    loss, m = _loss(lp, old, [2.0], mask, "cispo", eps_high=1.2)
    np.testing.assert_allclose(loss, (2 + 4.8) / 2, rtol=1e-6)
    np.testing.assert_allclose(m["cispo_clip_ratio"], 1 / 2, rtol=1e-6)  # one of the two real tokens capped
    assert "clip_ratio" not in m
    # the capped token keeps its gradient, −w Â / 2: the weight is held constant, it is not clipped away
    g = jax.grad(lambda x: _loss(x, old, [2.0], mask, "cispo", eps_high=1.2)[0])(jnp.array(lp))
    np.testing.assert_allclose(g, [[-1 * 2 / 2, -1.2 * 2 / 2, 0.0]], rtol=1e-6)


def test_sapo_by_hand():
    # Completion 1 (Â = +1, τ_pos = 1): ratios 1 and 2 → gates σ(0)·4/1 = 2 and σ(1)·4; terms −2, −4σ(1).
    # Completion 2 (Â = −1, τ_neg = 1.05): ratio 1 → gate σ(0)·4/1.05 = 2/1.05; term +2/1.05.
    # Aggregated as grpo: each completion's token mean, then the mean of those.
    lp = [[-1.0, math.log(2) - 1.0], [-0.5, 9.0]]
    old = [[-1.0, -1.0], [-0.5, 0.0]]
    mask = [[True, True], [True, False]]
    loss, m = _loss(lp, old, [1.0, -1.0], mask, "sapo")
    np.testing.assert_allclose(loss, ((-2 - 4 * sigmoid(1)) / 2 + 2 / 1.05) / 2, rtol=1e-6)
    assert not m  # TRL logs no clip share for the soft gate
    # at ratio 1 the gate's slope is 4σ'(0) = 1: the plain policy gradient −Â/(|o_i| B); at ratio 2 it is
    # 4σ(1)(1 − σ(1)) · ratio (∂ρ/∂log π = ρ), still negative for Â > 0
    g = jax.grad(lambda x: _loss(x, old, [1.0, -1.0], mask, "sapo")[0])(jnp.array(lp))
    np.testing.assert_allclose(
        g, [[-1 / 2 / 2, -4 * sigmoid(1) * (1 - sigmoid(1)) * 2 / 2 / 2], [1 / 1 / 2, 0.0]], rtol=1e-5
    )


def test_luspo_by_hand():
    # GSPO's sequence terms (test_losses.py's worked case): t1 = −1.2 (2 real tokens, s = e^0.2 clipped above),
    # t2 = +0.4 (3 tokens, s = e^−0.3 clipped below), t3 = −2 e^0.1 (1 token); LUSPO: each × |o_i|, ÷ B = 3.
    lp = [[0.1, 0.3, 50.0, 50.0], [-0.5, -0.1, -0.3, 50.0], [0.1, 50.0, 50.0, 50.0]]
    mask = [[True, True, False, False], [True, True, True, False], [True, False, False, False]]
    loss, m = _loss(lp, np.zeros((3, 4)), [1.0, -0.5, 2.0], mask, "luspo", level="sequence")
    np.testing.assert_allclose(loss, (2 * -1.2 + 3 * 0.4 + 1 * -2 * math.exp(0.1)) / 3, rtol=1e-6)
    np.testing.assert_allclose(
        [m["clip_ratio/high_mean"], m["clip_ratio/low_mean"]], [1 / 3, 1 / 3], rtol=1e-6
    )


def test_vespo_by_hand():
    # Completion 1: token log-ratios 0.1, 0.2 → log w = 0.3 (a sum, not GSPO's mean); Â = +1: k = 2, λ = 3,
    #   φ1 = e^3 · e^(2·0.3) · e^(−3 e^0.3); terms −φ1 Â log π = φ1 · 1 and φ1 · 2.
    # Completion 2: log w = −0.2, Â = −0.5: k = 3, λ = 2, φ2 = e^2 · e^(3·−0.2) · e^(−2 e^−0.2); term
    #   −φ2 · (−0.5) · (−0.5) = −0.25 φ2. Token mean over the 3 real tokens.
    lp = [[-1.0, -2.0], [-0.5, 30.0]]
    old = [[-1.1, -2.2], [-0.3, 0.0]]
    mask = [[True, True], [True, False]]
    phi1 = math.exp(3 + 2 * 0.3 - 3 * math.exp(0.3))
    phi2 = math.exp(2 + 3 * -0.2 - 2 * math.exp(-0.2))
    loss, m = _loss(lp, old, [1.0, -0.5], mask, "vespo")
    np.testing.assert_allclose(loss, (phi1 + 2 * phi1 - 0.25 * phi2) / 3, rtol=1e-5)
    np.testing.assert_allclose(m["vespo/phi_seq_mean"], (phi1 + phi2) / 2, rtol=1e-5)
    # φ is a constant weight: the gradient is −φ Â / 3 on each real token, no ∂φ/∂log π term
    g = jax.grad(lambda x: _loss(x, old, [1.0, -0.5], mask, "vespo")[0])(jnp.array(lp))
    np.testing.assert_allclose(g, [[-phi1 / 3, -phi1 / 3], [0.5 * phi2 / 3, 0.0]], rtol=1e-5)
    # on-policy w = 1, so φ = e^λ · 1 · e^−λ = 1: the loss is −Σ Â log π / 3
    np.testing.assert_allclose(_loss(lp, lp, [1.0, -0.5], mask, "vespo")[0], (1 + 2 - 0.25) / 3, rtol=1e-6)


def test_top_entropy_quantile_by_hand():
    # Entropies of 5 real tokens 0.1, 0.5, 0.2, 0.9, 0.4 (the padded sixth: 100, never counted). ρ = 0.4: the
    # 0.6-quantile of the sorted 0.1, 0.2, 0.4, 0.5, 0.9 sits at position 0.6 · 4 = 2.4 → 0.4 + 0.4 · (0.5 − 0.4)
    # = 0.44: tokens 0.5 and 0.9 carry the policy term. Ratio 1, Â = 1: −1 each, ÷ all 5 real tokens (as TRL).
    ent = [[0.1, 0.5, 0.2, 0.9, 0.4, 100.0]]
    lp = np.zeros((1, 6))
    mask = [[True] * 5 + [False]]
    np.testing.assert_allclose(_loss(lp, lp, [1.0], mask, "dapo", entropy=ent, rho=0.4)[0], -2 / 5, rtol=1e-6)
    np.testing.assert_allclose(_loss(lp, lp, [1.0], mask, "dapo", entropy=ent, rho=0.0)[0], -1 / 5, rtol=1e-6)
    # β > 0: the KL stays on every real token (π = 1/2, π_ref = 1/4: k3 = log 2 − 1/2 on each)
    lp, ref = np.full((1, 6), math.log(0.5)), np.full((1, 6), math.log(0.25))
    loss, m = _loss(lp, lp, [1.0], mask, "dapo", ref=ref, beta=0.1, entropy=ent, rho=0.4)
    np.testing.assert_allclose(loss, (-2 + 5 * 0.1 * (math.log(2) - 0.5)) / 5, rtol=1e-5)
    # a dropped token gets no gradient; a kept positive-advantage one the policy gradient −Â / 5
    g = jax.grad(lambda x: _loss(x, jax.lax.stop_gradient(x), [1.0], mask, "dapo", entropy=ent, rho=0.4)[0])(
        jnp.zeros((1, 6))
    )
    np.testing.assert_allclose(g, [[0.0, -1 / 5, 0.0, -1 / 5, 0.0, 0.0]], atol=1e-7)


def test_entropy_coef_by_hand():
    # Â = 0 (no policy term): the loss is −coef × the mean entropy of the real tokens, (1 + 2 + 3) / 3 = 2
    ent = [[1.0, 2.0, 3.0, 50.0]]
    lp = np.zeros((1, 4))
    mask = [[True, True, True, False]]
    loss, m = _loss(lp, lp, [0.0], mask, "grpo", entropy=ent, coef=0.01)
    np.testing.assert_allclose(loss, -0.01 * 2.0, rtol=1e-6)
    assert m["policy_loss"] == 0.0 and m["entropy_coef"] == np.float32(0.01)
    # with ρ = 1/3: the 2/3-quantile of 1, 2, 3 is 2 + (4/3 − 1) · 1 = 7/3: only entropy 3 is kept, bonus 3
    np.testing.assert_allclose(
        _loss(lp, lp, [0.0], mask, "grpo", entropy=ent, coef=0.01, rho=1 / 3)[0], -0.01 * 3.0, rtol=1e-6
    )
    # direction: more entropy on a real token lowers the loss by coef / 3 per nat; padding moves nothing
    g = jax.grad(lambda e: _loss(lp, lp, [0.0], mask, "grpo", entropy=e, coef=0.01)[0])(jnp.array(ent))
    np.testing.assert_allclose(g, [[-0.01 / 3] * 3 + [0.0]], rtol=1e-6)


def test_defaults_leave_the_loss_and_metrics_as_they_were():
    """ρ = 1 and coef 0 (TRL's defaults): passing the entropy changes no value and adds no metric."""
    rng = np.random.default_rng(0)
    lp, old, ref, ent = rng.normal(-1, 0.3, (4, 5, 6))
    adv, mask = rng.normal(size=5), rng.random((5, 6)) > 0.3
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        before = _loss(lp, old, adv, mask, loss_type, ref=ref, beta=0.1)
        after = _loss(lp, old, adv, mask, loss_type, ref=ref, beta=0.1, entropy=ent)
        assert before[0] == after[0] and before[1].keys() == after[1].keys(), loss_type
        assert all(before[1][k] == after[1][k] for k in before[1]), loss_type


# ---------------------------------------------------------------------------
# float64 NumPy re-derivations, one completion at a time from the papers' definitions
# ---------------------------------------------------------------------------
def numpy_loss(loss_type, lp, old, ref, adv, lengths, ent, r, eps, eps_high, beta, rho, coef, level):
    """-> (loss, metrics) in float64, looping over completions cut to their lengths."""
    real_ent = np.concatenate([ent[i, :n] for i, n in enumerate(lengths)])
    cut = np.quantile(real_ent, 1 - rho) if rho < 1 else -np.inf  # linear interpolation
    terms, kept_ent, phis, capped = [], [], [], []
    for i, n in enumerate(lengths):
        x, x_old, a = lp[i, :n], old[i, :n], adv[i]
        ratio = np.exp(x - x_old)
        if level == "sequence":
            ratio = np.full(n, np.exp(np.mean(x - x_old)))
        if loss_type == "cispo":
            t = -np.minimum(ratio, eps_high) * a * x
            capped += list((ratio > eps_high) & (a > 0))
        elif loss_type == "sapo":
            tau = SAPO[0] if a > 0 else SAPO[1]
            t = -4 / tau / (1 + np.exp(-tau * (ratio - 1))) * a
        elif loss_type == "vespo":
            k, lam = (VESPO[0], VESPO[1]) if a >= 0 else (VESPO[2], VESPO[3])
            w = np.prod(np.exp(x)) / np.prod(np.exp(x_old))  # the whole sequence's ratio
            phis.append(w**k * np.exp(lam * (1 - w)))
            t = -phis[-1] * a * x
        else:
            t = -np.minimum(ratio * a, np.clip(ratio, 1 - eps, 1 + eps_high) * a)
        keep = ent[i, :n] >= cut
        kept_ent += list(ent[i, :n][keep])
        t = np.where(keep, t, 0.0) + beta * (np.exp(ref[i, :n] - x) - (ref[i, :n] - x) - 1)
        terms.append(t)
    if loss_type in ("grpo", "sapo"):
        loss = np.mean([t.mean() for t in terms])
    elif loss_type == "luspo":
        loss = sum(t.sum() for t in terms) / len(lengths)
    elif loss_type == "dr_grpo":
        loss = sum(t.sum() for t in terms) / (len(lengths) * r)
    else:
        loss = sum(t.sum() for t in terms) / lengths.sum()
    m = {
        "cispo_clip_ratio": np.mean(capped) if capped else None,
        "vespo/phi_seq_mean": np.mean(phis) if phis else None,
    }
    return loss - coef * np.mean(kept_ent), m


@pytest.mark.parametrize(
    "loss_type, level",
    [
        ("bnpo", "token"),
        ("cispo", "token"),
        ("sapo", "token"),
        ("sapo", "sequence"),
        ("luspo", "sequence"),
        ("vespo", "token"),
    ],
)
@pytest.mark.parametrize("rho, coef", [(1.0, 0.0), (0.3, 0.02)])
def test_loss_types_numpy_float64(loss_type, level, rho, coef):
    rng = np.random.default_rng(5)
    b, r, eps, eps_high, beta = 8, 7, 0.2, 0.28, 0.05
    eps_high = 1.02 if loss_type == "cispo" else eps_high  # a cap some ratios cross
    lengths = rng.integers(1, r + 1, b)
    mask = np.arange(r)[None] < lengths[:, None]
    lp = rng.normal(-2, 0.5, (b, r))
    old = lp + rng.normal(0, 0.15, (b, r))
    ref = rng.normal(-2, 0.3, (b, r))
    ent = rng.uniform(0, 3, (b, r))
    adv = rng.normal(size=b)
    garbage = rng.normal(0, 20, (b, r))  # padding of the log-probs and entropies must not count
    want, want_m = numpy_loss(
        loss_type, lp, old, ref, adv, lengths, ent, r, eps, eps_high, beta, rho, coef, level
    )
    loss, m = _loss(
        np.where(mask, lp, garbage),
        old,
        adv,
        mask,
        loss_type,
        ref=ref,
        beta=beta,
        eps=eps,
        eps_high=eps_high,
        level=level,
        entropy=np.where(mask, ent, np.abs(garbage)),
        rho=rho,
        coef=coef,
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for k, v in want_m.items():
        if v is not None:
            assert 0 < v and (k != "cispo_clip_ratio" or v < 1), (k, v)  # the inputs exercise both sides
            np.testing.assert_allclose(m[k], v, rtol=1e-5, err_msg=k)


# ---------------------------------------------------------------------------
# direction: ∂L/∂log π < 0 on every positive-advantage token whose weight is not clipped (or gated) to 0
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "loss_type, level",
    [("bnpo", "token"), ("cispo", "token"), ("sapo", "token"), ("luspo", "sequence"), ("vespo", "token")],
)
def test_loss_types_direction(loss_type, level):
    rng = np.random.default_rng(6)
    b, r = 8, 6
    mask = np.arange(r)[None] < rng.integers(1, r + 1, b)[:, None]
    lp = rng.normal(-2, 0.5, (b, r))
    old = lp + rng.normal(0, 0.3, (b, r))
    old[0] = lp[0] - 0.5  # completion 0 (Â > 0): every ratio, and its sequence's, e^0.5 > 1 + ε_high
    adv = np.array([1.0, -1.0] * (b // 2)) * rng.uniform(0.5, 1.5, b)
    g = np.asarray(
        jax.grad(lambda x: _loss(x, old, adv, mask, loss_type, eps_high=0.28, level=level)[0])(
            jnp.array(lp, jnp.float32)
        )
    )
    assert (g[~mask] == 0).all()
    ratio = np.exp(lp - old)
    if level == "sequence":
        ratio = (
            np.exp(np.where(mask, lp - old, 0).sum(1, keepdims=True) / mask.sum(1, keepdims=True)) + 0 * lp
        )
    clipped = (ratio > 1.28) & (adv[:, None] > 0) if loss_type in ("bnpo", "luspo") else np.zeros_like(mask)
    pos = mask & (adv[:, None] > 0)
    assert (g[pos & ~clipped] < 0).all() and (g[pos & clipped] == 0).all()
    assert (pos & ~clipped).sum() >= 4 and (loss_type not in ("bnpo", "luspo") or clipped[pos].any())
    # negative advantages push the other way, wherever the weight is not 0
    neg = mask & (adv[:, None] < 0)
    assert (g[neg] >= 0).all() and (g[neg] > 0).any()


def test_sharded_over_8_devices_equals_one_device():
    """The quantile of (11) and VESPO's sequence sums over a batch sharded on `data` (8 simulated devices, as
    train_step sees it): the same loss and metrics as on one device."""
    rng = np.random.default_rng(7)
    lp, old, ent = rng.normal(-1, 0.3, (3, 8, 5))
    adv, mask = rng.normal(size=8), rng.random((8, 5)) > 0.3
    on_data = jax.sharding.NamedSharding(common.make_mesh(None), jax.sharding.PartitionSpec("data"))
    for loss_type in ("vespo", "sapo"):

        @jax.jit
        def f(lp, old, adv, mask, ent):
            return grpo_loss(
                lp,
                old,
                None,
                adv,
                mask,
                epsilon=0.2,
                epsilon_high=0.28,
                beta=0.0,
                loss_type=loss_type,
                importance_sampling_level="token",
                entropy=ent,
                top_entropy_quantile=0.3,
                entropy_coef=0.02,
                sapo_temperature_pos=SAPO[0],
                sapo_temperature_neg=SAPO[1],
                vespo_k_pos=VESPO[0],
                vespo_lambda_pos=VESPO[1],
                vespo_k_neg=VESPO[2],
                vespo_lambda_neg=VESPO[3],
            )

        inputs = [jnp.array(x) for x in (lp, old, adv, mask, ent)]
        one = f(*inputs)
        placed = [jax.device_put(x, on_data) for x in inputs]
        assert len(placed[0].sharding.device_set) == 8
        sharded = f(*placed)
        np.testing.assert_allclose(sharded[0], one[0], rtol=1e-6, err_msg=loss_type)
        for k in one[1]:
            np.testing.assert_allclose(sharded[1][k], one[1][k], rtol=1e-6, err_msg=f"{loss_type} {k}")


# ---------------------------------------------------------------------------
# the flags reach the loss: a 2-step run's metrics
# ---------------------------------------------------------------------------
def test_cli_loss_flags_reach_the_loss(tmp_path):
    out = run_script(
        "grpo.py",
        "--model",
        "tiny",
        "--max-steps",
        "2",
        "--batch-size",
        "8",
        "--num-generations",
        "4",
        "--response-length",
        "8",
        "--max-prompt-length",
        "64",
        "--loss-type",
        "cispo",
        "--epsilon-high",
        "5.0",
        "--top-entropy-quantile",
        "0.2",
        "--entropy-coef",
        "0.01",
        "--num-iterations",
        "2",
        "--sample-every",
        "0",
        "--output-dir",
        str(tmp_path),
        env=one_device_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(tmp_path)
    assert all(r["entropy_coef"] == pytest.approx(0.01) and "policy_loss" in r for r in rows), rows
    assert all(0 <= r["cispo_clip_ratio"] <= 1 and "clip_ratio" not in r for r in rows), rows
    assert all(np.isfinite(r["train/loss"]) for r in rows)
