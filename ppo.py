r"""PPO for language models (RLHF): KL-penalised reward, GAE, clipped policy and value losses.

Ouyang et al. 2022; "The N+ implementation details of RLHF with PPO" (Huang et al. 2024); TRL PPOTrainer.
    python ppo.py --model runs/sft…/model --reward-model runs/reward…/model
Offline, toy reward data/toy.py:batch_score (the defaults are for real models; `tiny` takes its own):
    python ppo.py --model tiny --max-steps 30 --batch-size 32 --num-mini-batches 2 \
        --learning-rate 3e-4 --max-prompt-length 64 --response-length 16 --missing-eos-penalty 1.0
"""

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Literal, NamedTuple

import plumbing  # the run shell: shared flags, Run, the exit boundary (instant to import)

# `python ppo.py --help`: from Args' source, before the imports below
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (mesh, models, data files, the scorer)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


@dataclass
class Args(plumbing.RolloutArgs):
    """The shared flags (plumbing.RolloutArgs: model, dtype, mesh, prompts, lengths, outputs, …) plus PPO's."""

    # rewards
    reward_model: str | None = None
    """reward.py's `model/` dir: scores responses and initialises the value model (--lora-rank: LoRA on both)"""
    reward_fn: str = os.path.join(common.HERE, "data", "toy.py") + ":batch_score"
    """`path.py:function`: TRL's f(prompts, completions, **columns) or f(prompts, responses); without --reward-model"""
    # rollouts
    response_length: int = 53
    """new tokens sampled per prompt (TRL PPOConfig: 53)"""
    temperature: float = 0.7
    """sampling temperature (TRL PPOConfig: 0.7); log-probs are computed from logits / temperature to match"""
    stop_token: tuple[str, ...] = ()
    """more tokens a completion ends at (a token's text or id), besides EOS and the chat's turn end"""
    missing_eos_penalty: float | None = None
    """subtracted from the score of a response without EOS (None: off, as in TRL)"""
    # optimisation
    learning_rate: float = 3e-6
    """peak AdamW learning rate (TRL PPOConfig: 3e-6) of policy and value together"""
    num_mini_batches: int = 1
    """mini-batches per PPO epoch"""
    num_ppo_epochs: int = 4
    """passes over each rollout batch (one step: a rollout of --batch-size prompts, epochs × mini-batches updates)"""
    # algorithm
    kl_coef: float = 0.05
    """β: per-token KL penalty coefficient"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """`k1` (log-ratio, unbiased, can be negative) or `k3` ((r-1) - log r, non-negative)"""
    whiten_rewards: bool = False
    """whiten per-token rewards (scale only, mean kept) before GAE"""
    gamma: float = 1.0
    """γ: discount"""
    lam: float = 0.95
    """λ: GAE trace decay"""
    cliprange: float = 0.2
    """ε: policy ratio clip"""
    cliprange_value: float = 0.2
    """value clip around the rollout-time values"""
    vf_coef: float = 0.1
    """value loss weight"""
    # logging and outputs
    export_hf: bool = False
    """also write the final model as a Hugging Face checkpoint, tokenizer and chat template in <output-dir>/model_hf/"""


class PPOParams(NamedTuple):
    """What PPO trains (one optimizer): the policy's weights, the value model's, and its scalar head."""

    policy: list  # trainable values, in stateless_call order
    value: list
    head: dict  # {weight [D, 1], bias []}, float32


class Pair(NamedTuple):
    """One per model, policy and value: their backbones, or their frozen (non-trainable) values."""

    policy: object
    value: object


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


# ---- ALGO LOGIC: KV-cached sampling and its log-probs (temperature only: the filters stay off, as TRL's
# PPOConfig), policy, reference and value forwards, per-token rewards, GAE, whitening, the PPO losses
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


def response_values(backbone, params, frozen, token_ids, padding_mask, *, head, context_length):
    """V(state before each response token) = w·h + b: [B, R], float32; and the forward's aux_loss."""
    hidden, aux_loss = common.forward(backbone, params, frozen, token_ids, padding_mask)  # [B, T, D], scalar
    hidden = hidden[:, context_length - 1 : -1]
    return (hidden.astype(jnp.float32) @ head["weight"])[..., 0] + head["bias"], aux_loss


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


def whiten(x, mask, shift_mean=True):
    """(x - mean) / std over the positions where `mask` is True (std with Bessel's
    correction, as TRL); masked positions come out as 0 and never count."""
    mean = masked_mean(x, mask)
    var = jnp.sum(jnp.where(mask, (x - mean) ** 2, 0.0)) / jnp.maximum(mask.sum() - 1, 1)
    out = (x - mean) * jax.lax.rsqrt(var + 1e-8) + (0.0 if shift_mean else mean)
    return jnp.where(mask, out, 0.0)


def compute_rewards(scores, logprobs, ref_logprobs, sequence_lengths, *, kl_coef, kl_estimator="k1"):
    """Per-token rewards (eq. 2 of docs/ppo.md): -β·KL_t on every real response token, plus the score on the
    last real one (the stop token). Padding after it gets 0. -> (rewards, kl, non_score_reward) [B, R]."""
    idx = jnp.arange(logprobs.shape[1])[None]
    mask = idx <= sequence_lengths[:, None]  # [B, R]: real response tokens (the stop token included)
    logr = jnp.where(mask, ref_logprobs - logprobs, 0.0)
    kl = -logr if kl_estimator == "k1" else jnp.expm1(logr) - logr  # k1, or k3 (Schulman's blog)
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward + jnp.where(idx == sequence_lengths[:, None], scores[:, None], 0.0)
    return rewards, kl, non_score_reward


def compute_gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (eq. 3), backwards over the response. Values and rewards are zeroed
    where `mask` is False, so the value after the last real token is 0: the episode ends there.
    -> (advantages, returns) [B, R]."""
    values, rewards = jnp.where(mask, values, 0.0), jnp.where(mask, rewards, 0.0)
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], 1)
    deltas = rewards + gamma * next_values - values  # δ_t = r_t + γ V_{t+1} - V_t

    def step(next_advantage, delta):
        advantage = delta + gamma * lam * next_advantage  # A_t = δ_t + γλ A_{t+1}
        return advantage, advantage

    _, advantages = jax.lax.scan(step, jnp.zeros_like(deltas[:, 0]), deltas.T, reverse=True)
    advantages = advantages.T
    return advantages, advantages + values


def ppo_loss(
    new_logprobs,
    new_values,
    *,
    logprobs,
    values,
    advantages,
    returns,
    mask,
    cliprange,
    cliprange_value,
    vf_coef,
):
    """Clipped surrogate (eq. 4) + vf_coef · clipped value loss (eq. 5), token means over `mask`: the update's
    new_logprobs and new_values [B, R] against the rollout's logprobs, values, advantages, returns [B, R]."""
    log_ratio = new_logprobs - logprobs
    ratio = jnp.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * jnp.clip(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_mean(jnp.maximum(pg_losses, pg_losses2), mask)
    values_clipped = values + jnp.clip(new_values - values, -cliprange_value, cliprange_value)
    vf_losses, vf_losses2 = (new_values - returns) ** 2, (values_clipped - returns) ** 2
    vf_loss = 0.5 * masked_mean(jnp.maximum(vf_losses, vf_losses2), mask)
    metrics = {
        "loss/policy_avg": pg_loss,
        "loss/value_avg": vf_loss,
        "policy/clipfrac_avg": masked_mean(pg_losses2 > pg_losses, mask),
        "val/clipfrac_avg": masked_mean(vf_losses2 > vf_losses, mask),
        "policy/approxkl_avg": 0.5 * masked_mean(log_ratio**2, mask),
        "val/ratio": masked_mean(ratio, mask),
    }
    return pg_loss + vf_coef * vf_loss, metrics


def rollout_stats(models, params, ref_params, frozen, batch, *, context_length, temperature):
    """Log-probs of policy and reference, and values, for a finished rollout batch.
    models, frozen: Pairs (backbones, frozen values); params: PPOParams; ref_params: policy values."""
    ids, mask = batch["query_responses"], batch["padding_mask"]
    logprobs, _, _ = response_logps(
        models.policy,
        params.policy,
        frozen.policy,
        ids,
        mask,
        context_length=context_length,
        temperature=temperature,
    )
    ref_logprobs, _, _ = response_logps(
        models.policy,
        ref_params,
        frozen.policy,
        ids,
        mask,
        context_length=context_length,
        temperature=temperature,
    )
    values, _ = response_values(
        models.value, params.value, frozen.value, ids, mask, head=params.head, context_length=context_length
    )
    return logprobs, ref_logprobs, values


def advantages_of(scores, logprobs, ref_logprobs, values, sequence_lengths, *, args):
    """Rewards -> GAE advantages (whitened) and returns, plus the objective/* metrics."""
    rewards, kl, non_score_reward = compute_rewards(
        scores, logprobs, ref_logprobs, sequence_lengths, kl_coef=args.kl_coef, kl_estimator=args.kl_estimator
    )
    mask = jnp.arange(logprobs.shape[1])[None] <= sequence_lengths[:, None]
    if args.whiten_rewards:
        rewards = whiten(rewards, mask, shift_mean=False)
    advantages, returns = compute_gae(rewards, values, mask, args.gamma, args.lam)
    advantages = whiten(advantages, mask)
    metrics = {
        "objective/kl": kl.sum(1).mean(),
        "objective/entropy": -jnp.where(mask, logprobs, 0).sum(1).mean(),
        "objective/non_score_reward": non_score_reward.sum(1).mean(),
        "objective/scores": scores.mean(),
        "objective/rlhf_reward": non_score_reward.sum(1).mean() + scores.mean(),
    }
    return advantages, returns, metrics


# ---- train_step: one PPO update of policy and value on a mini-batch
def train_step(models, optimizer, args, state, frozen, *, batch, context_length):
    """One PPO update on a mini-batch. state = (PPOParams, opt_state); models = Pair of backbones;
    frozen = Pair of their non-trainable values, an input only (never donated)."""
    params, opt_state = state
    ids, mask = batch["query_responses"], batch["padding_mask"]

    def loss_fn(p):
        new_logprobs, entropy, aux_loss = response_logps(
            models.policy,
            p.policy,
            frozen.policy,
            ids,
            mask,
            context_length=context_length,
            temperature=args.temperature,
        )
        new_values, value_aux_loss = response_values(
            models.value, p.value, frozen.value, ids, mask, head=p.head, context_length=context_length
        )
        loss, metrics = ppo_loss(
            new_logprobs,
            new_values,
            logprobs=batch["logprobs"],
            values=batch["values"],
            advantages=batch["advantages"],
            returns=batch["returns"],
            mask=batch["response_mask"],
            cliprange=args.cliprange,
            cliprange_value=args.cliprange_value,
            vf_coef=args.vf_coef,
        )
        # + each model's router load-balancing loss (a mixture of experts; 0.0 dense), weighted as its own
        # loss: the value model's by vf_coef, as its value loss, so its balance against that loss is kept
        loss = loss + aux_loss + args.vf_coef * value_aux_loss
        return loss, {
            **metrics,
            "policy/entropy_avg": masked_mean(entropy, batch["response_mask"]),
            "aux_loss": aux_loss,
            "val/aux_loss": value_aux_loss,
        }

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state), {**metrics, "train/loss": loss, "train/grad_norm": optax.global_norm(grads)}


# ---- main's pieces: the rollout
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
    if args.num_mini_batches < 1 or args.num_ppo_epochs < 1 or args.temperature <= 0:
        raise common.UsageError("--num-mini-batches and --num-ppo-epochs must be ≥ 1, --temperature > 0")
    if (
        args.batch_size % args.num_mini_batches
        or args.batch_size // args.num_mini_batches % run.mesh.shape["data"]
    ):
        raise common.UsageError(
            f"--batch-size {args.batch_size} must split into --num-mini-batches "
            f"{args.num_mini_batches} each divisible by the data axis ({run.mesh.shape['data']})"
        )
    common.check_sampler(args.model)  # a family whose decoder layers the sampler knows
    template = common.chat_template(args.model, args.chat_template)
    # rows: the columns reward functions may read
    prompts, rows = common.read_prompts(
        args.dataset, template, "--dataset", args.dataset_config, args.dataset_split
    )
    max_steps = run.resolve_max_steps(len(prompts))  # --max-steps, or --num-epochs' worth of rollouts
    # s(x, y): the reward model, or the reward function
    scorer = common.load_scorer(
        run.mesh,
        run.dtype,
        frozen_dtype=run.frozen_dtype,
        reward_model=args.reward_model,
        reward_fns=[args.reward_fn],
        value_model=True,
        **args.lora,
    )
    scorer.check_columns(rows)  # before the model loads: every column a reward function names exists
    model = common.load_model(
        args.model, run.mesh, run.dtype, args.seed, logits_chunk=args.logits_chunk, **args.lora
    )
    backbone, tokenizer = model.backbone, model.preprocessor.tokenizer
    scorer.check_tokenizer(tokenizer)
    value_bb = scorer.model.backbone if scorer.model is not None else backbone
    # --remat on policy and value (not the KV-cached sampler)
    remat = plumbing.Remat(args.remat, backbone, value_bb)
    queries, query_mask = tokenize_prompts(prompts, tokenizer, args.max_prompt_length)
    q = queries.shape[1]
    r = args.response_length
    pad = tokenizer.pad_token_id
    stops = common.stop_token_ids(tokenizer, template, args.stop_token)  # EOS, the turn end, --stop-token
    print(
        f"data: {len(prompts)} prompts, queries padded to ≤ {q} tokens (a batch: its bucket); "
        f"responses ≤ {r} tokens, ended by ids {stops}; reward: {args.reward_model or args.reward_fn}"
    )

    # Policy trainable; reference = frozen copy of its initial values (with LoRA: the LoRA-off base);
    # value = a copy of the reward model (Huang et al.), else of the policy + a zero head.
    policy_params, policy_frozen = common.split_variables(backbone, frozen_dtype=run.frozen_dtype)
    ref_params = common.frozen_copy(policy_params, run.frozen_dtype)
    # the scorer keeps the reward model's as loaded
    value_params, value_frozen = common.split_variables(value_bb, frozen_dtype=run.frozen_dtype)
    head = (
        scorer.head
        if scorer.model is not None
        else jax.tree.map(
            lambda x: common.put_global(x, common.replicated(run.mesh)),
            {"weight": np.zeros((backbone.hidden_dim, 1), np.float32), "bias": np.zeros((), np.float32)},
        )
    )
    models, frozen = Pair(backbone, value_bb), Pair(policy_frozen, value_frozen)
    params = PPOParams(policy_params, value_params, head)
    # Through one jit with explicit out_shardings, so the trainable values carry the mesh in their types and are
    # committed to their devices, as the updated ones will be: the sampler sees the same input types every step.
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=common.shardings(params))(params)
    # over max_steps (unless resumed) × epochs × mini-batches optimizer updates; Adam's ε as TRL's PPO
    optimizer, schedule, warmup = plumbing.make_optimizer(
        args, run.schedule_steps, updates_per_step=args.num_ppo_epochs * args.num_mini_batches, eps=1e-5
    )
    opt_state, opt_shardings = common.init_optimizer(optimizer, params, run.mesh)  # scalars replicated
    state_shardings = (common.shardings(params), opt_shardings)
    key, rng = jax.random.key(args.seed), np.random.default_rng(args.seed)
    order = np.concatenate(
        [rng.permutation(len(prompts)) for _ in range(-(-max_steps * args.batch_size // len(prompts)))]
    )
    # --resume: params, optimizer state, sampling key, mini-batch shuffler (the prompt order is a function of the step)
    (params, opt_state, key_data), meta = run.resume(
        (params, opt_state, jax.random.key_data(key)), {"rng": rng.bit_generator.state}
    )
    # the key through the host: restored, it sits on one device, which jit refuses beside mesh-wide inputs
    key = jax.random.wrap_key_data(np.asarray(key_data))
    rng.bit_generator.state = meta["rng"]
    state = jax.device_put((params, opt_state), state_shardings)

    gen_fn = jax.jit(
        functools.partial(
            generate, backbone, response_length=r, temperature=args.temperature, stop_ids=stops, pad_id=pad
        )
    )

    @jax.jit
    def stats_fn(params, ref_params, frozen, batch):  # the batch's own query width: a compilation per bucket
        context_length = common.query_length(batch)
        return rollout_stats(
            models,
            params,
            ref_params,
            frozen,
            batch,
            context_length=context_length,
            temperature=args.temperature,
        )

    adv_fn = jax.jit(functools.partial(advantages_of, args=args))
    step_fn = remat.jit(
        lambda s, f, b: train_step(
            models, optimizer, args, s, f, batch=b, context_length=common.query_length(b)
        ),
        donate_argnums=0,
        out_shardings=(state_shardings, common.replicated(run.mesh)),
    )
    # args.json: the mode --remat auto chose, the warmup steps
    run.record(remat=remat, num_warmup_steps=warmup)
    # Every process samples, scores and updates the same global batch: rollout arrays [B, ...] over `data`.
    on_data = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec("data"))
    # FLOPs (docs/design.md): 2N per token per forward (sampling, policy + reference + value, reward model),
    # 6N per token per trained forward+backward (policy and value, every epoch).
    n_pol, n_val = plumbing.count_params(backbone), plumbing.count_params(value_bb)
    flops_per_token = (
        2 * n_pol
        + 2 * (2 * n_pol + n_val)
        + 2 * n_val * (scorer.model is not None)
        + args.num_ppo_epochs * 6 * (n_pol + n_val)
    )

    # ---- the loop: rollout -> rewards -> advantages -> update ----
    for step in run.steps(
        learning_rate=lambda s: schedule(s * args.num_ppo_epochs * args.num_mini_batches),
        summed=("charts/generated_tokens",),
        show=("objective/scores", "objective/kl"),
    ):
        ticks = [time.perf_counter()]
        idx = order[step * args.batch_size : (step + 1) * args.batch_size]
        # rollout: sample responses to a batch of prompts, cut them after the first stop token
        key, gen_key = jax.random.split(key)
        batch, sequence_lengths = rollout(
            gen_fn,
            state[0].policy,
            frozen.policy,
            queries[idx],
            query_mask[idx],
            key=gen_key,
            stop_ids=stops,
            pad_id=pad,
            on_data=on_data,
        )
        qb = common.query_length(batch)  # the width of this batch's queries: the bucket of its longest prompt
        ticks.append(plumbing.synced(batch))
        # rewards: a score per response (1), minus the missing-EOS penalty; log-probs of policy and reference; values
        texts, ids, lengths, has_eos = common.decode_completions(
            tokenizer, batch, sequence_lengths, qb, stops
        )
        scores, _ = scorer(
            [prompts[i] for i in idx],
            texts,
            batch,
            rows=[rows[i] for i in idx],
            completion_ids=ids,
            end=common.turn_end(template),
        )
        if args.missing_eos_penalty is not None:
            scores = scores - args.missing_eos_penalty * common.put_global(np.float32(~has_eos), on_data)
        logprobs, ref_logprobs, values = stats_fn(state[0], ref_params, frozen, batch)
        # mismatch/*: the sampler's log q against the first forward of the weights that sampled
        meter = mismatch(logprobs, batch.pop("sampler_logps"), batch["padding_mask"][:, qb:])
        # advantages: per-token KL-penalised rewards (2) -> GAE (3) -> whitening
        advantages, returns, objective = adv_fn(scores, logprobs, ref_logprobs, values, sequence_lengths)
        batch.update(logprobs=logprobs, values=values, advantages=advantages, returns=returns)
        ticks.append(plumbing.synced(batch))
        # update: num_ppo_epochs passes, each over num_mini_batches shuffled mini-batches
        updates = []
        for mb_idx in common.mini_batches(
            rng, args.batch_size, args.num_mini_batches, args.num_ppo_epochs, on_data
        ):
            state, metrics = step_fn(state, frozen, jax.tree.map(lambda x: x[mb_idx], batch))
            updates.append(metrics)
        # generate tokens/s: the tokens sampled, through each stop token (all R without one); tokens/s and
        # MFU count real tokens: those and each prompt's, of B·(Qb+R) padded (charts/padding_fraction)
        real = int(query_mask[idx].sum() + (lengths + has_eos).sum())
        run.log(
            {
                **plumbing.phase_metrics(updates, ticks, int((lengths + has_eos).sum())),
                **objective,
                **meter,
                "val/num_eos_tokens": float(has_eos.sum()),
                "charts/generate_compilations": float(gen_fn._cache_size()),
                "charts/query_padding_fraction": float(1 - query_mask[idx].sum() / (len(idx) * qb)),
            },
            tokens=real,
            padded=len(idx) * (qb + r),
            flops=real * flops_per_token,
        )
        if args.sample_every and (step % args.sample_every == 0 or step + 1 == max_steps):
            for i, s in enumerate(common.to_host(scores)[:3]):
                print(f"step {step + 1} sample: {prompts[idx[i]]!r} -> {texts[i]!r} score {s:.3f}")
        run.checkpoint((state[0], state[1], jax.random.key_data(key)), {"rng": rng.bit_generator.state})

    # ---- outputs: the policy (LoRA merged) as a KerasHub preset ----
    run.finish(lambda path: common.save_model(model, state[0].policy, path))


if __name__ == "__main__":
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
