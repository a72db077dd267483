r"""GRPO: group-relative policy optimisation with verifiable rewards (no value model).

Shao et al. 2024 (DeepSeekMath); loss variants from DAPO (Yu et al. 2025) and Dr. GRPO (Liu et al. 2025).
    python grpo.py --model runs/sft…/model --reward-fn my_checks.py:correct my_checks.py:formatted
Offline, toy checker data/toy.py:batch_score (the defaults are for real models; `tiny` takes its own):
    python grpo.py --model tiny --max-steps 30 --batch-size 64 --learning-rate 3e-4 \
        --max-prompt-length 64 --response-length 16 --beta 0.04 --lr-scheduler-type constant_with_warmup
"""

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Literal

import plumbing  # the run shell: shared flags, Run, the exit boundary (instant to import)

# `python grpo.py --help`: from Args' source, before the imports below
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (mesh, models, data files, the scorer)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


@dataclass
class Args(plumbing.RolloutArgs):
    """The shared flags (plumbing.RolloutArgs: model, dtype, mesh, prompts, lengths, outputs, …) plus GRPO's."""

    # rewards
    reward_fn: tuple[str, ...] = (os.path.join(common.HERE, "data", "toy.py") + ":batch_score",)
    """one or more `path.py:function`: TRL's f(prompts, completions, **columns) or f(prompts, responses)"""
    reward_weights: tuple[float, ...] = ()
    """weight of each --reward-fn in the summed reward; empty: all 1"""
    reward_model: str | None = None
    """reward.py's `model/` dir: its score on the last real token is the reward"""
    # rollouts
    num_generations: int = 8
    """G: completions sampled per prompt (one group); --batch-size counts completions: B/G prompts a step"""
    top_p: float = 1.0
    """top-p: sample from the likeliest tokens that hold this probability mass (TRL: 1.0 = off)"""
    top_k: int = 0
    """top-k: sample among the k likeliest tokens (TRL: 0 = off); log-probs: of what is sampled from"""
    min_p: float | None = None
    """min-p: drop tokens less likely than min_p × the top token's probability (TRL: None = off)"""
    stop_token: tuple[str, ...] = ()
    """more tokens a completion ends at (a token's text or id), besides EOS and the chat's turn end"""
    # optimisation
    num_iterations: int = 1
    """μ: optimisation passes over each generation batch (>1 keeps the rollout log-probs as π_old)"""
    num_mini_batches: int = 1
    """mini-batches per pass (each a whole number of groups is not required: advantages are fixed first)"""
    # algorithm
    beta: float = 0.0
    """β: weight of the k3 KL to the reference (TRL: 0.0, DeepSeekMath: 0.04); 0: no reference model"""
    epsilon: float = 0.2
    """ε: ratio clip, lower side (and upper side unless --epsilon-high is given)"""
    epsilon_high: float | None = None
    """ε_high: upper ratio clip (DAPO's clip-higher: 0.28); `cispo`: the weight's cap itself (ScaleRL: 5.0)"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """ratio per `token` (GRPO) or per `sequence` (GSPO: exp of the mean token log-ratio, clipped once)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """advantage scale: `group` (÷ group std, GRPO), `batch` (÷ batch std), `none` (Dr. GRPO: no division)"""
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
    """objective and aggregation, docs/grpo.md (3)-(10): `dapo` `bnpo` `cispo` `vespo` ÷ the batch's tokens,
    `grpo` `sapo` sequence means' mean, `dr_grpo` ÷ B × response_length, `luspo` ÷ B"""
    sapo_temperature_pos: float = 1.0
    """τ_pos: temperature of SAPO's soft gate for Â > 0 (`--loss-type sapo`)"""
    sapo_temperature_neg: float = 1.05
    """τ_neg: temperature of SAPO's soft gate for Â ≤ 0 (higher: off-policy negative updates fade faster)"""
    vespo_k_pos: float = 2.0
    """k for Â ≥ 0 in VESPO's weight φ(w) = w^k e^(λ(1−w)) of the sequence ratio w: φ → 0 as w^k, w → 0"""
    vespo_lambda_pos: float = 3.0
    """λ for Â ≥ 0 in VESPO's φ(w): φ → 0 as e^(−λw) for large w"""
    vespo_k_neg: float = 3.0
    """k for Â < 0 in VESPO's φ(w)"""
    vespo_lambda_neg: float = 2.0
    """λ for Â < 0 in VESPO's φ(w)"""
    top_entropy_quantile: float = 1.0
    """ρ: only the top-ρ share of real tokens by entropy carry the policy loss (80/20 rule: 0.2; 1.0: all)"""
    entropy_coef: float = 0.0
    """entropy bonus: L − coef × the mean entropy of the tokens that carry the policy loss (0: off)"""
    mask_truncated_completions: bool = False
    """leave completions that never stopped out of the loss (DAPO's overlong filtering)"""
    accept_reward: float | None = None
    """rejection-sampling fine-tuning instead of Â (RFT, Yuan et al. 2023; RAFT): Â 1 for a completion whose
    reward reaches it, the rest out of the loss: SFT on the accepted samples; None: GRPO (compare.py's rft)"""
    # logging and outputs
    export_hf: bool = False
    """also write the final model as a Hugging Face checkpoint, tokenizer and chat template in <output-dir>/model_hf/"""


# ---- Data: prompt texts (common.read_dataset: strings or chats) -> left-padded query ids [N, Q]
def tokenize_prompts(prompts, tokenizer, max_prompt_length):
    """-> (queries [N, Q] left-padded, query_mask [N, Q]), Q a multiple of 8."""
    ids = [[tokenizer.start_token_id] + list(x) for x in tokenizer.tokenize(prompts)]
    ids = [x[:1] + x[1:][-(max_prompt_length - 1) :] for x in ids]  # cut from the left, BOS kept
    q = min(max_prompt_length, 8 * math.ceil(max(len(x) for x in ids) / 8))
    queries, mask = np.zeros((len(ids), q), np.int32), np.zeros((len(ids), q), bool)
    for i, x in enumerate(ids):  # left padding: every prompt ends at column Q-1, responses start at Q
        queries[i, q - len(x) :], mask[i, q - len(x) :] = x, True
    return queries, mask


# ---- ALGO LOGIC: sampling and its log-probs, forwards on query + response, Â, the k3 KL, the objectives
def filter_logits(logits, top_k=0, top_p=1.0, min_p=None):
    """TRL's sampling filters on logits / T [B, V] in transformers' order, each on what the previous left
    (renormalised): top-k keeps the k largest, top-p the likeliest until their mass reaches top_p (the one
    crossing it too), min-p p ≥ min_p · max p. Dropped: -inf; 0, 1.0, None: off; ties at a cut stay."""
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ascending = jnp.sort(logits, -1)  # [B, V]: drop the prefix whose probabilities sum to ≤ 1 − top_p
        dropped = jnp.sum(jnp.cumsum(jax.nn.softmax(ascending, -1), -1) <= 1.0 - top_p, -1)
        cut = jnp.take_along_axis(ascending, jnp.minimum(dropped, logits.shape[-1] - 1)[:, None], -1)
        logits = jnp.where(logits < cut, -jnp.inf, logits)
    if min_p is not None:
        probs = jax.nn.softmax(logits, -1)
        logits = jnp.where(probs < min_p * probs.max(-1, keepdims=True), -jnp.inf, logits)
    return logits


def filtered_logps(logits, tokens, temperature, *, top_k=0, top_p=1.0, min_p=None):
    """log q(token) and q's entropy [B] for logits [B, V] (float32, or the compute dtype's: computed in their
    float32), tokens [B]; q, what the sampler draws from: softmax(filter_logits(logits / T, …)), renormalised
    over the kept tokens (eq. 1 of docs/design.md). The token always counts as kept: only a rounding gap
    between the two forwards could drop it (NaN)."""
    scaled = logits.astype(jnp.float32) / temperature
    kept = filter_logits(scaled, top_k, top_p, min_p)
    kept = jnp.where(jnp.arange(kept.shape[-1]) == tokens[:, None], scaled, kept)  # [B, V], -inf: dropped
    logz = jax.nn.logsumexp(kept, -1)
    finite = jnp.isfinite(kept)
    # Σ p·logit over the kept tokens only (0 · -inf is NaN); the inner where keeps the gradient finite too
    plogp = jnp.where(finite, jax.nn.softmax(kept, -1) * jnp.where(finite, kept, 0.0), 0.0)
    # the token's kept value is its scaled logit: gathered from `logits` themselves, no [B, V] float32 (of
    # kept, or of the compute dtype's logits) is written for one value a row (the sampler's step)
    token_logit = jnp.take_along_axis(logits, tokens[:, None], -1)[:, 0].astype(jnp.float32) / temperature
    return token_logit - logz, logz - plogp.sum(-1)


def generate(
    backbone,
    params,
    frozen,
    queries,
    query_mask,
    key,
    *,
    response_length,
    temperature,
    stop_ids,
    pad_id,
    top_k=0,
    top_p=1.0,
    min_p=None,
    group=1,
):
    """Sample ≤ R tokens after left-padded queries [B, Q] -> (responses [B, R], steps, the sampler's own log q
    [B, R] of softmax(filter_logits(logits / T)), 0 if greedy or after the end). A prefill, then a
    `lax.while_loop` of one token a step until every sequence has one of `stop_ids` (steps ≤ R); fixed shapes
    (one compilation per bucket), `pad_id` after the end; a key split a step, as a scan over R: the same
    tokens for a key. T = 0: greedy. group: the rows are B/group prompts, each `group` times in a row (G
    completions of a prompt): a prompt is prefilled once and its cache and last hidden state copied to its
    rows; group=1's tokens for a key, but for the prefill's rounding (its matmuls over B/G rows, not B: a bf16
    step on a TPU)."""
    b, q = queries.shape
    padding_mask = jnp.concatenate([query_mask, jnp.ones((b, response_length), bool)], 1)  # [B, S]
    filtered = top_k or top_p < 1.0 or min_p is not None  # else q is softmax(logits / T) itself
    keep = functools.partial(filter_logits, top_k=top_k, top_p=top_p, min_p=min_p) if filtered else None
    with common.weights(backbone, params, frozen):  # each weight in the dtype it is held in
        cache = common.empty_cache(backbone, b // group, q + response_length)  # L (K, V) pairs [B/G, S, K, H]
        hidden, cache = jax.tree.map(  # prefill, a group's prompt once, copied to its G rows; the last
            lambda x: jnp.repeat(x, group, 0),  # position's final hidden state [B, 1, D]
            common.cached_forward(
                backbone, queries[::group], padding_mask[::group], cache, 0, last=True, hidden=True
            ),
        )

        def pick(h, key, done):  # final hidden [B, D] -> token [B], its log q [B]; a finished sequence pads
            key, sample_key = jax.random.split(key)
            if temperature == 0:  # greedy: the arg-max of the logits
                token, logq = jnp.argmax(common.logits(backbone, h), -1).astype(jnp.int32), jnp.zeros((b,))
            else:  # q = softmax(filter_logits(logits / T)): jax.random.categorical's draw, and its log q
                token, logq = common.categorical(backbone, h, sample_key, temperature, keep)
            token = jnp.where(done, pad_id, token)
            return token, jnp.where(done, 0.0, logq), key, done | jnp.isin(token, jnp.asarray(stop_ids))

        def step(carry):  # feed token t-1 at cache position Q+t-1, pick token t (and its log q)
            tokens, logqs, cache, t, key, done = carry
            fed = jax.lax.dynamic_slice_in_dim(tokens, t - 1, 1, 1)  # [B, 1]
            hidden, cache = common.cached_forward(backbone, fed, padding_mask, cache, q + t - 1, hidden=True)
            token, logq, key, done = pick(hidden[:, -1], key, done)
            put = lambda x, new: jax.lax.dynamic_update_slice_in_dim(x, new[:, None], t, 1)
            return put(tokens, token), put(logqs, logq), cache, t + 1, key, done

        token, logq, key, done = pick(hidden[:, -1], key, jnp.zeros((b,), bool))
        tokens = jnp.full((b, response_length), pad_id, jnp.int32).at[:, 0].set(token)  # [B, R]
        logqs = jnp.zeros((b, response_length)).at[:, 0].set(logq)  # [B, R]
        tokens, logqs, _, steps, _, _ = jax.lax.while_loop(  # while some sequence has not ended and t < R
            lambda c: (c[3] < response_length) & ~c[5].all(),
            step,
            (tokens, logqs, cache, jnp.int32(1), key, done),
        )
    return tokens, steps, logqs


def truncate_response(responses, stop_ids, pad_id):
    """Keep tokens up to and including the first of `stop_ids` (EOS, turn end, …), pad after it -> (responses
    [B, R], sequence_lengths [B]: index of the last real token, the stop token, or R-1 without one)."""
    r = responses.shape[1]
    is_stop = jnp.isin(responses, jnp.asarray(stop_ids, jnp.int32))  # [B, R]
    first = jnp.where(is_stop.any(1), jnp.argmax(is_stop, 1), r - 1)
    return jnp.where(jnp.arange(r)[None] > first[:, None], pad_id, responses), first


def response_logps(
    backbone,
    params,
    frozen,
    token_ids,
    padding_mask,
    *,
    context_length,
    temperature,
    top_k=0,
    top_p=1.0,
    min_p=None,
):
    """log q(response token) and q's entropy (filtered_logps), [B, R] each, float32, and the forward's
    aux_loss (a mixture of experts' router loss, common.forward; 0.0 dense). Position t predicts t+1:
    response token Q+i is scored by hidden[Q+i-1]; the [B, R, V] logits come --logits-chunk positions at a
    time (common.per_token), never whole."""
    hidden, aux_loss = common.forward(backbone, params, frozen, token_ids, padding_mask)  # [B, T, D], scalar
    hidden, labels = hidden[:, context_length - 1 : -1], token_ids[:, context_length:]  # [B, R, D], [B, R]

    def chunk(h, y):  # [B, C, D], [B, C] -> log q [B, C], entropy [B, C]
        logits = common.logits(backbone, h)  # [B, C, V], float32
        b, c, v = logits.shape
        logq, entropy = filtered_logps(
            logits.reshape(b * c, v), y.reshape(b * c), temperature, top_k=top_k, top_p=top_p, min_p=min_p
        )
        return logq.reshape(b, c), entropy.reshape(b, c)

    with common.weights(backbone, params, frozen):  # the output layer's weights, from `params`
        logps, entropy = common.per_token(backbone, chunk, (hidden, labels))
    return logps, entropy, aux_loss


def masked_mean(x, mask):
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(mask.sum(), 1)


def mismatch(logps, sampler_logps, mask):
    """The meter: ρ = π_trainer / q_sampler on the sampled tokens (mask [B, R]), the first forward of the
    weights that sampled against the sampler's own log q: 1 to float rounding (unfiltered: the kept mass)."""
    ratio = jnp.exp(logps - sampler_logps)  # [B, R]
    real = lambda x: jnp.where(mask, x, 1.0)  # padding as a ratio of 1: out of the max and the min
    return {
        "mismatch/ratio_mean": masked_mean(ratio, mask),
        "mismatch/ratio_max": real(ratio).max(),
        "mismatch/ratio_min": real(ratio).min(),
        "mismatch/frac_outside_10pct": masked_mean(abs(ratio - 1.0) > 0.1, mask),
    }  # outside [0.9, 1.1]


def group_advantages(rewards, num_generations, scale_rewards="group", eps=1e-4):
    """Â_i = (r_i − mean(group)) / (std(group) + ε) (eq. 2), rewards [B]: B/G groups of G consecutive rows;
    std with Bessel's correction (TRL's); `batch`: ÷ all B's std, `none`: no division (Dr. GRPO) -> (Â [B],
    std [B/G]); an all-equal group gets Â = 0."""
    grouped = rewards.reshape(-1, num_generations)  # [B/G, G]
    std = grouped.std(1, ddof=1)  # [B/G]
    centred = grouped - grouped.mean(1, keepdims=True)  # [B/G, G]
    scale = {"group": std[:, None] + eps, "batch": rewards.std(ddof=1) + eps, "none": 1.0}[scale_rewards]
    return (centred / scale).reshape(-1), std


def rft_advantages(rewards, accept_reward):
    """Rejection sampling: rewards [B] -> (Â [B]: 1 where the reward reaches accept_reward, else 0; accepted
    [B] bool). With the rest out of the loss, one on-policy update (ratio 1) is SFT's token-mean NLL step on
    the accepted completions: no baseline, no negative gradient."""
    accepted = np.asarray(rewards) >= accept_reward
    return accepted.astype(np.float32), accepted


def k3_kl(logps, ref_logps):
    """Per-token KL(π ‖ π_ref) estimate k3 = π_ref/π − log(π_ref/π) − 1 (Schulman 2020; eq. 4): ≥ 0,
    unbiased on tokens sampled from π, lower variance than k1 = log π − log π_ref."""
    log_ratio = ref_logps - logps  # log(π_ref / π)
    return jnp.expm1(log_ratio) - log_ratio


def share(x, mask):
    """The share of real tokens where x holds (x [B, R]), or at sequence level (x [B, 1]) of the B
    completions."""
    return masked_mean(x, mask) if x.shape == mask.shape else jnp.mean(x)  # TRL counts all B completions


def clipped_surrogate(ratio, advantages, mask, epsilon, epsilon_high):
    """GRPO's policy term (eq. 3), PPO's pessimistic clip: −min(ρÂ, clip(ρ, 1 − ε, 1 + ε_high)Â) per token
    [B, R] (per completion [B, 1] at GSPO's sequence level: its real tokens share it) -> (the term, clip
    shares)."""
    per_token = -jnp.minimum(
        ratio * advantages, jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high) * advantages
    )
    low = (ratio < 1.0 - epsilon) & (advantages < 0)  # clipped from below: the clip only removes gradient
    high = (ratio > 1.0 + epsilon_high) & (advantages > 0)  # clipped from above
    metrics = {"clip_ratio/low_mean": share(low, mask), "clip_ratio/high_mean": share(high, mask)}
    return per_token, {**metrics, "clip_ratio": share(low | high, mask)}


def sequence_mean(per_token, mask):
    """GRPO's aggregation (eq. 5): each completion's mean over its real tokens, then the mean over
    completions."""
    return jnp.mean(jnp.where(mask, per_token, 0.0).sum(1) / jnp.maximum(mask.sum(1), 1))


def grpo_loss(
    logps,
    old_logps,
    ref_logps,
    advantages,
    mask,
    *,
    epsilon,
    epsilon_high,
    beta,
    loss_type="grpo",
    importance_sampling_level="token",
    entropy=None,
    top_entropy_quantile=1.0,
    entropy_coef=0.0,
    **constants,
):
    """GRPO's objective (Shao et al. 2024) -> (loss, metrics): on each real token of completion i, the clipped
    surrogate of ρ = π_θ/π_old times Â_i (eq. 3) plus β × the k3 estimate of KL(π_θ ‖ π_ref) (eq. 4); each
    completion's tokens averaged, then the completions (eq. 5). logps, old_logps, ref_logps (None: β 0),
    entropy, mask [B, R]; advantages [B]. A variant (the keywords after β, Args' fields of those names) swaps
    one part, each a function below: --loss-type's policy term (POLICY_TERMS; `constants`: their --sapo-* and
    --vespo-* settings) and aggregation (AGGREGATIONS), GSPO's sequence-level ratio, the 80/20 rule's
    high-entropy tokens, an entropy bonus."""
    log_ratio = jnp.where(mask, logps - old_logps, 0.0)  # log ρ [B, R]; padding may hold anything
    if importance_sampling_level == "sequence":
        log_ratio = gspo_log_ratio(log_ratio, mask)  # GSPO (eq. 6): one ratio per completion, [B, 1]
    advantages = advantages[:, None]  # Â [B, 1]: every token of a completion shares it
    if loss_type in POLICY_TERMS:  # CISPO, SAPO, VESPO (eq. 7, 8, 10)
        per_token, metrics = POLICY_TERMS[loss_type](
            log_ratio, advantages, logps, mask, epsilon_high=epsilon_high, constants=constants
        )
    else:  # the paper's; one update a batch: π_old = sg(π_θ), ratio 1
        per_token, metrics = clipped_surrogate(jnp.exp(log_ratio), advantages, mask, epsilon, epsilon_high)
    kept = mask  # the tokens that carry the policy term
    if top_entropy_quantile < 1.0:
        kept = high_entropy_tokens(entropy, mask, top_entropy_quantile)  # eq. 11
        per_token = jnp.where(kept, per_token, 0.0)
    if beta:  # on every real token, kept or not (as TRL)
        kl = k3_kl(logps, ref_logps)  # [B, R]
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl, mask)
    loss = AGGREGATIONS.get(loss_type, token_mean)(per_token, mask)  # eq. 5; DAPO's and the others' (5, 9)
    if entropy_coef:  # TRL's bonus (eq. 12): the kept tokens' mean entropy, whatever the aggregation
        metrics.update({"policy_loss": loss, "entropy_coef": jnp.float32(entropy_coef)})
        loss = loss - entropy_coef * masked_mean(entropy, kept)
    return loss, metrics


# The variants, each the part of grpo_loss that it changes (docs/grpo.md (5)-(12); TRL's GRPOTrainer's)
def gspo_log_ratio(log_ratio, mask):
    """GSPO (Zheng et al. 2025, eq. 6): log s_i = (1/|o_i|) Σ_t log ρ_{i,t}, [B, R] -> [B, 1]; differentiated
    through the mean (as TRL's GRPOTrainer): ∂ s_i / ∂ log π_{i,t} = s_i / |o_i|."""
    return log_ratio.sum(1, keepdims=True) / jnp.maximum(mask.sum(1, keepdims=True), 1)


def cispo_term(log_ratio, advantages, logps, mask, epsilon_high, constants):
    """CISPO (MiniMax-M1 2025, eq. 7): the importance weight capped at ε_high and held constant, times
    Â log π: a capped token keeps its gradient (PPO's clip drops it)."""
    ratio = jnp.exp(log_ratio)
    per_token = (
        -jax.lax.stop_gradient(jnp.minimum(ratio, epsilon_high)) * advantages * jnp.where(mask, logps, 0.0)
    )
    return per_token, {"cispo_clip_ratio": share((ratio > epsilon_high) & (advantages > 0), mask)}


def sapo_term(log_ratio, advantages, logps, mask, epsilon_high, constants):
    """SAPO (Soft Adaptive Policy Optimization 2025, eq. 8): a sigmoid gate for the clip, −σ(τ(ρ − 1))·4/τ·Â,
    gradient weight 1 at ratio 1 and fading off it; τ by the sign of Â (τ_neg > τ_pos: negatives fade
    faster)."""
    tau = jnp.where(advantages > 0, constants["sapo_temperature_pos"], constants["sapo_temperature_neg"])
    return -jax.nn.sigmoid(tau * (jnp.exp(log_ratio) - 1.0)) * 4.0 / tau * advantages, {}


def vespo_term(log_ratio, advantages, logps, mask, epsilon_high, constants):
    """VESPO (2026, eq. 10): φ(w) = w^k e^(λ(1−w)) of the whole sequence's ratio w = Π_t ρ_t [B, 1], held
    constant, times Â log π; (k, λ) by the sign of Â; in log space with TRL's clamps."""
    log_w = jnp.clip(jnp.clip(log_ratio, -20.0, 20.0).sum(1, keepdims=True), math.log(1e-8), 20.0)
    k = jnp.where(advantages >= 0, constants["vespo_k_pos"], constants["vespo_k_neg"])
    lam = jnp.where(advantages >= 0, constants["vespo_lambda_pos"], constants["vespo_lambda_neg"])
    phi = jax.lax.stop_gradient(jnp.exp(jnp.maximum(lam, 1e-4) * (1.0 - jnp.exp(log_w)) + k * log_w))
    return -phi * advantages * jnp.where(mask, logps, 0.0), {"vespo/phi_seq_mean": jnp.mean(phi)}


POLICY_TERMS = {"cispo": cispo_term, "sapo": sapo_term, "vespo": vespo_term}  # the rest: clipped_surrogate


def token_mean(per_token, mask):
    """DAPO (Yu et al. 2025, eq. 5): every real token of the batch weighs the same (BNPO, CISPO, VESPO too)."""
    return jnp.where(mask, per_token, 0.0).sum() / jnp.maximum(mask.sum(), 1)


AGGREGATIONS = {  # per-token losses [B, R] -> the loss; masked tokens never count; the rest: token_mean
    "grpo": sequence_mean,
    "sapo": sequence_mean,  # as TRL
    "dr_grpo": lambda x, mask: jnp.where(mask, x, 0.0).sum() / mask.size,  # Dr. GRPO (Liu et al. 2025): ÷ B·R
    "luspo": lambda x, mask: jnp.where(mask, x, 0.0).sum() / mask.shape[0],  # LUSPO (eq. 9): Σ |o_i| ℓ_i / B
}


def high_entropy_tokens(entropy, mask, top_entropy_quantile):
    """The 80/20 rule (Wang et al. 2025, eq. 11): the real tokens whose entropy reaches its (1 − ρ)-quantile
    over the batch's real tokens (linear interpolation: TRL's torch.quantile) carry the policy term:
    [B, R] bool."""
    real = jnp.where(mask, jax.lax.stop_gradient(entropy), jnp.nan)  # [B, R]; padding left out
    return (entropy >= jnp.nanquantile(real, 1.0 - top_entropy_quantile)) & mask


def rollout_logps(backbone, params, frozen, batch, **settings):
    """[B, R] log-probs of a finished generation batch's responses under `params`: π_old's of the distribution
    sampled from (settings: temperature, top-k, top-p, min-p), π_ref's of logits / T alone (temperature)."""
    # differs from rloo.py's: one model's, called for π_old only where it is not π_θ (off-policy updates)
    ids, mask = batch["query_responses"], batch["padding_mask"]
    return response_logps(
        backbone, params, frozen, ids, mask, context_length=common.query_length(batch), **settings
    )[0]


# ---- train_step: one update of the policy on a (mini-)batch of completions
def train_step(backbone, optimizer, args, state, frozen, *, batch, context_length):
    """state = (params, opt_state); batch: query_responses / padding_mask [B, Q+R], response_mask [B, R],
    advantages [B]; old_logps / ref_logps [B, R] if made at rollout; sampler_logps [B, R] if its weights'."""
    params, opt_state = state
    ids, mask = batch["query_responses"], batch["padding_mask"]

    def loss_fn(p):
        logps, entropy, aux_loss = response_logps(
            backbone,
            p,
            frozen,
            ids,
            mask,
            context_length=context_length,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
        )
        old = batch.get("old_logps", jax.lax.stop_gradient(logps))  # μ = 1: π_old = sg(π_θ), ratio 1
        loss, metrics = grpo_loss(
            logps,
            old,
            batch.get("ref_logps"),
            batch["advantages"],
            batch["response_mask"],
            epsilon=args.epsilon,
            epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
            beta=args.beta,
            loss_type=args.loss_type,
            importance_sampling_level=args.importance_sampling_level,
            entropy=entropy,
            top_entropy_quantile=args.top_entropy_quantile,
            entropy_coef=args.entropy_coef,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
        )
        loss = loss + aux_loss  # + the router load-balancing loss (a mixture of experts; 0.0 dense)
        if "sampler_logps" in batch:  # mismatch/*, over every sampled token (padding_mask's response part)
            metrics.update(mismatch(logps, batch["sampler_logps"], mask[:, context_length:]))
        return loss, {
            **metrics,
            "entropy": masked_mean(entropy, batch["response_mask"]),
            "aux_loss": aux_loss,
        }

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state), {**metrics, "train/loss": loss, "train/grad_norm": optax.global_norm(grads)}


# ---- main's pieces: flag checks, rollout
def check_args(args, mesh):
    """Inconsistent sizes, unsupported choices: stop before the model loads (--reward-weights against
    --reward-fn: common.load_scorer)."""
    g, b = args.num_generations, args.batch_size
    plumbing.check_flags(
        num_mini_batches=(args.num_mini_batches, 1, False),
        num_iterations=(args.num_iterations, 1, False),
        temperature=(args.temperature, 0, True),
        top_k=(args.top_k, 0, False),
        sapo_temperature_pos=(args.sapo_temperature_pos, 0, True),
        sapo_temperature_neg=(args.sapo_temperature_neg, 0, True),
    )
    if not 0 < args.top_p <= 1 or not 0 <= (args.min_p or 0) <= 1 or not 0 <= args.top_entropy_quantile <= 1:
        raise common.UsageError("--top-p must be in (0, 1], --min-p and --top-entropy-quantile in [0, 1]")
    if g < 2 or b % g:
        raise common.UsageError(
            f"--batch-size {b} must be a multiple of --num-generations {g} (≥ 2: a group "
            "of one has no relative advantage)"
        )
    if b % args.num_mini_batches or b // args.num_mini_batches % mesh.shape["data"]:
        raise common.UsageError(
            f"--batch-size {b} must split into --num-mini-batches {args.num_mini_batches} "
            f"each divisible by the data axis ({mesh.shape['data']})"
        )
    if args.loss_type == "vespo" and args.importance_sampling_level == "sequence":
        raise common.UsageError("--importance-sampling-level sequence: not with vespo (its w is its own)")
    common.check_sampler(args.model)  # a family whose decoder layers the sampler knows


def rollout(gen_fn, params, frozen, queries, query_mask, *, key, stop_ids, pad_id, on_data):
    """Responses to host queries [B, Q] (whole on each process), cut after their first stop token -> (batch,
    with the sampler's own log-probs, lengths [B]). The queries are cut to their last Qb columns (left padded:
    all their real tokens), Qb the bucket of the longest prompt (≤ Q): jit compiles once per bucket met."""
    qb = common.bucket_length(int(query_mask.sum(1).max()), queries.shape[1])
    qs, qm = common.put_global(queries[:, -qb:], on_data), common.put_global(query_mask[:, -qb:], on_data)
    responses, _, sampler_logps = gen_fn(params, frozen, qs, qm, key)
    responses, sequence_lengths = truncate_response(responses, stop_ids, pad_id)
    response_mask = jnp.arange(responses.shape[1])[None] <= sequence_lengths[:, None]  # [B, R]: stop included
    return {
        "query_responses": jnp.concatenate([qs, responses], 1),
        "response_mask": response_mask,
        "padding_mask": jnp.concatenate([qm, response_mask], 1),
        "sampler_logps": sampler_logps,
    }, sequence_lengths


def main(args):
    # ---- set-up: every flag, file and row checked before the models load ----
    # flags and --output-dir checked; nothing written
    run = plumbing.Run(__file__, args, export_hf=args.export_hf)
    check_args(args, run.mesh)
    template = common.chat_template(args.model, args.chat_template)
    prompts, rows = common.read_prompts(
        args.dataset, template, "--dataset", args.dataset_config, args.dataset_split
    )
    g, n_prompts = args.num_generations, args.batch_size // args.num_generations
    # --max-steps, or --num-epochs' worth of B/G prompts
    max_steps = run.resolve_max_steps(len(prompts), n_prompts)
    # r(x, y): the reward model, or the weighted functions
    scorer = common.load_scorer(
        run.mesh,
        run.dtype,
        reward_model=args.reward_model,
        reward_fns=args.reward_fn,
        weights=args.reward_weights,
    )
    scorer.check_columns(rows)  # before the model loads: every column a reward function names exists
    model = common.load_model(
        args.model, run.mesh, run.dtype, args.seed, logits_chunk=args.logits_chunk, **args.lora
    )
    backbone, tokenizer = model.backbone, model.preprocessor.tokenizer
    scorer.check_tokenizer(tokenizer)
    # --remat: a checkpoint switch on each block (not the sampler's calls)
    remat = plumbing.Remat(args.remat, backbone)
    queries, query_mask = tokenize_prompts(prompts, tokenizer, args.max_prompt_length)
    stops = common.stop_token_ids(tokenizer, template, args.stop_token)  # EOS, the turn end, --stop-token
    print(
        f"data: {len(prompts)} prompts, queries padded to ≤ {queries.shape[1]} tokens (a batch: its bucket); "
        f"{n_prompts} prompts × G={g} completions of ≤ {args.response_length} tokens per step, "
        f"ended by ids {stops}; "
        f"reward: {args.reward_model or ', '.join(args.reward_fn)}"
    )

    params, frozen = common.split_variables(backbone, frozen_dtype=run.frozen_dtype)
    # one jit with out_shardings commits the values to the mesh as updates will: the sampler sees one type
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=common.shardings(params))(params)
    ref_params = (
        common.frozen_copy(params, run.frozen_dtype) if args.beta else None
    )  # the initial values (LoRA: the base)
    off_policy = args.num_iterations > 1 or args.num_mini_batches > 1  # π_old differs from π_θ at some update
    # over max_steps (unless resumed) × μ × mini-batches optimizer updates (TRL counts optimizer steps)
    optimizer, schedule, warmup = plumbing.make_optimizer(
        args, run.schedule_steps, updates_per_step=args.num_iterations * args.num_mini_batches
    )
    opt_state, opt_shardings = common.init_optimizer(optimizer, params, run.mesh)  # scalars replicated
    state_shardings = (common.shardings(params), opt_shardings)
    key, rng = jax.random.key(args.seed), np.random.default_rng(args.seed)
    order = np.concatenate(
        [rng.permutation(len(prompts)) for _ in range(-(-max_steps * n_prompts // len(prompts)))]
    )
    # --resume: params, optimizer state, sampling key (through the host: restored on one device), shuffler
    (params, opt_state, key_data), meta = run.resume(
        (params, opt_state, jax.random.key_data(key)), {"rng": rng.bit_generator.state}
    )
    key = jax.random.wrap_key_data(np.asarray(key_data))
    rng.bit_generator.state = meta["rng"]
    state = jax.device_put((params, opt_state), state_shardings)

    # q: what is sampled and scored
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    gen_fn = jax.jit(
        functools.partial(
            generate,
            backbone,
            response_length=args.response_length,
            stop_ids=stops,
            pad_id=tokenizer.pad_token_id,
            group=g,
            **sampling,
        )
    )  # group: a prompt's G rows share its prefill
    old_logps_fn = jax.jit(functools.partial(rollout_logps, backbone, **sampling))  # π_old: q, as sampled
    ref_logps_fn = jax.jit(functools.partial(rollout_logps, backbone, temperature=args.temperature))
    step_fn = remat.jit(
        lambda s, f, b: train_step(
            backbone, optimizer, args, s, f, batch=b, context_length=common.query_length(b)
        ),
        donate_argnums=0,
        out_shardings=(state_shardings, common.replicated(run.mesh)),
    )
    # args.json: the mode --remat auto chose, the warmup steps
    run.record(remat=remat, num_warmup_steps=warmup)
    on_data = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec("data"))  # rollouts [B, …]
    # FLOPs (docs/design.md): 2N a token per forward (sampler, π_old, π_ref, reward model), 6N per update pass
    n, n_rm = (plumbing.count_params(m.backbone) if m is not None else 0 for m in (model, scorer.model))
    flops_per_token = 2 * n * (1 + off_policy + (args.beta > 0)) + 2 * n_rm + args.num_iterations * 6 * n

    # ---- the loop: rollout -> rewards -> advantages -> update ----
    for step in run.steps(
        learning_rate=lambda s: schedule(s * args.num_iterations * args.num_mini_batches),
        summed=("charts/generated_tokens",),
        show=("reward", "frac_reward_zero_std"),
    ):
        ticks = [time.perf_counter()]
        idx = np.repeat(order[step * n_prompts : (step + 1) * n_prompts], g)  # [B]
        key, gen_key = jax.random.split(key)  # rollout: G completions of B/G prompts, a group per G rows
        batch, sequence_lengths = rollout(
            gen_fn,
            state[0],
            frozen,
            queries[idx],
            query_mask[idx],
            key=gen_key,
            stop_ids=stops,
            pad_id=tokenizer.pad_token_id,
            on_data=on_data,
        )
        qb = common.query_length(batch)  # the width of this batch's queries: the bucket of its longest prompt
        ticks.append(plumbing.synced(batch))
        texts, ids, lengths, has_eos = common.decode_completions(
            tokenizer, batch, sequence_lengths, qb, stops
        )  # rewards: (1)
        scores, parts = scorer(
            [prompts[i] for i in idx],
            texts,
            batch,
            rows=[rows[i] for i in idx],
            completion_ids=ids,
            end=common.turn_end(template),
        )
        rewards = common.to_host(scores)
        advantages, group_std = jax.device_get(group_advantages(jnp.asarray(rewards), g, args.scale_rewards))
        if args.mask_truncated_completions:  # DAPO: a cut-off completion is not judged at all
            batch["response_mask"] = batch["response_mask"] & common.put_global(has_eos[:, None], on_data)
        if args.accept_reward is not None:  # RFT: SFT on the accepted completions, the others out of the loss
            advantages, accepted = rft_advantages(rewards, args.accept_reward)
            batch["response_mask"] = batch["response_mask"] & common.put_global(accepted[:, None], on_data)
        batch["advantages"] = common.put_global(advantages, on_data)  # relative to the prompt's group (2)
        if off_policy:  # π_old, the rollout's weights (a single update needs none: π_old = sg(π_θ))
            batch["old_logps"] = old_logps_fn(state[0], frozen, batch)
        if ref_params is not None:  # π_ref, β > 0
            batch["ref_logps"] = ref_logps_fn(ref_params, frozen, batch)
        # mismatch/*: the sampler against the first forward of the weights that sampled: π_old's here, if made
        # (the sampler's log-probs then leave the batch), else train_step's
        meter = {}
        if "old_logps" in batch:
            meter = mismatch(batch["old_logps"], batch.pop("sampler_logps"), batch["padding_mask"][:, qb:])
        ticks.append(plumbing.synced(batch))
        updates = []  # update: num_iterations passes, each over num_mini_batches shuffled mini-batches
        for mb_idx in common.mini_batches(
            rng, args.batch_size, args.num_mini_batches, args.num_iterations, on_data
        ):
            state, metrics = step_fn(state, frozen, jax.tree.map(lambda x: x[mb_idx], batch))
            updates.append(metrics)
        # tokens sampled: through each stop (R without one); tokens/s, MFU: those + prompts' (of B·(Qb+R))
        real = int(query_mask[idx].sum() + (lengths + has_eos).sum())
        run.log(
            {
                **plumbing.phase_metrics(updates, ticks, int((lengths + has_eos).sum())),
                **meter,
                **common.reward_metrics(rewards, parts, lengths, has_eos),
                "reward_std": float(np.mean(group_std)),
                "frac_reward_zero_std": float(np.mean(np.isclose(group_std, 0.0))),
                "charts/generate_compilations": float(gen_fn._cache_size()),
                "charts/query_padding_fraction": float(1 - query_mask[idx].sum() / (len(idx) * qb)),
            },
            tokens=real,
            padded=len(idx) * (qb + args.response_length),
            flops=real * flops_per_token,
        )
        if args.sample_every and (step % args.sample_every == 0 or step + 1 == max_steps):
            print(  # the first group: one prompt, its completions, their advantages
                "\n".join(
                    f"step {step + 1} sample: {prompts[idx[i]]!r} -> {texts[i]!r} reward {rewards[i]:.3f} "
                    f"advantage {float(advantages[i]):+.2f}"
                    for i in range(min(4, g))
                )
            )
        run.checkpoint((state[0], state[1], jax.random.key_data(key)), {"rng": rng.bit_generator.state})

    # ---- outputs: the policy (LoRA merged) as a KerasHub preset ----
    run.finish(lambda path: common.save_model(model, state[0], path))


if __name__ == "__main__":
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
