r"""RLOO: REINFORCE with a leave-one-out baseline and verifiable rewards (no value model).

Ahmadian et al. 2024 (Back to Basics); TRL's RLOOTrainer: sequence-level KL in the reward, a clipped ratio.
    python rloo.py --model runs/sft…/model --reward-fn my_checks.py:correct my_checks.py:formatted
Offline, toy checker data/toy.py:batch_score (the defaults are for real models; `tiny` takes its own):
    python rloo.py --model tiny --max-steps 30 --batch-size 64 --num-generations 8 --learning-rate 3e-4 \
        --max-prompt-length 64 --response-length 16 --beta 0.01 --lr-scheduler-type constant_with_warmup
"""

import functools
import math
import os
import time
from dataclasses import dataclass

import plumbing  # the run shell: shared flags, Run, the exit boundary (instant to import)

# `python rloo.py --help`: from Args' source, before the imports below
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (mesh, models, data files, the scorer)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


@dataclass
class Args(plumbing.RolloutArgs):
    """The shared flags (plumbing.RolloutArgs: model, dtype, mesh, prompts, lengths, outputs, …) + RLOO's."""

    # rewards
    reward_fn: tuple[str, ...] = (os.path.join(common.HERE, "data", "toy.py") + ":batch_score",)
    """one or more `path.py:function`: TRL's f(prompts, completions, **columns) or f(prompts, responses)"""
    reward_weights: tuple[float, ...] = ()
    """weight of each --reward-fn in the summed reward; empty: all 1"""
    reward_model: str | None = None
    """reward.py's `model/` dir: its score on the last real token is the reward"""
    # rollouts
    num_generations: int = 2
    """k: completions sampled per prompt (TRL: 2); --batch-size counts completions: B/k prompts a step"""
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
    beta: float = 0.05
    """β: weight of the sequence KL Σ_t (log π_old − log π_ref) taken off each reward (TRL: 0.05); 0: no
    reference model"""
    epsilon: float = 0.2
    """ε: sequence-ratio clip, lower side (and upper side unless --epsilon-high is given)"""
    epsilon_high: float | None = None
    """ε_high: upper sequence-ratio clip (DAPO's clip-higher: 0.28); None: --epsilon"""
    normalize_advantages: bool = False
    """standardise the advantages over the generation batch (mean 0, std 1) after the baseline (TRL: False)"""
    reward_clip_range: tuple[float, float] | None = None
    """(min, max): clip each summed reward into it before the KL penalty (TRL: None = off)"""
    mask_truncated_completions: bool = False
    """leave completions that never stopped (no EOS or stop token) out of the loss and the KL (DAPO's overlong
    filtering)"""
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


# ---- ALGO LOGIC: KV-cached sampling (fixed shapes: compiled once; it stops when every completion has ended),
# forwards of the policy and reference on query + response, the sequence KL in the reward, leave-one-out
# advantages, the clipped sequence-level surrogate
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


def sequence_kl(old_logps, ref_logps, mask):
    """KL_i = Σ_t (log π_old − log π_ref) over the real tokens of completion i: [B, R] -> [B]   (eq. 2).

    The plain log-ratio (k1), as TRL's RLOOTrainer and the paper: per token it may be negative; summed
    over tokens sampled from π_old it estimates KL(π_old ‖ π_ref) of the whole completion. Rollout-time
    values (no gradient): it shapes the reward, it is not a loss term.
    """
    return jnp.sum(jnp.where(mask, old_logps - ref_logps, 0.0), 1)  # padding may hold anything


def rloo_advantages(
    rewards, kl, num_generations, *, beta, normalize_advantages=False, reward_clip_range=None
):
    """A_i = r̃_i − mean_{j≠i} r̃_j with r̃ = clip(r) − β·KL   (eqs. 2–4 of docs/rloo.md).

    rewards, kl [B] hold B/k groups of k consecutive completions of one prompt. The mean of the other
    k − 1 is (Σ_j r̃_j − r̃_i) / (k − 1), so A_i = k/(k−1) · (r̃_i − mean r̃): an unbiased baseline (it
    does not use r̃_i), and every group's advantages sum to 0. `normalize_advantages`: (A − mean A) /
    (std A + 1e-4) over the whole batch (Bessel's std, as TRL). -> (advantages [B], group std of r̃ [B/k]).
    """
    if reward_clip_range is not None:  # before the penalty, as TRL: the KL term is never clipped
        rewards = jnp.clip(rewards, *reward_clip_range)
    shaped = (rewards - beta * kl).reshape(-1, num_generations)  # [B/k, k]
    baseline = (shaped.sum(1, keepdims=True) - shaped) / (num_generations - 1)  # leave-one-out mean
    advantages = (shaped - baseline).reshape(-1)
    if normalize_advantages:
        advantages = (advantages - advantages.mean()) / (advantages.std(ddof=1) + 1e-4)
    return advantages, shaped.std(1, ddof=1)


def rloo_loss(logps, old_logps, advantages, mask, *, epsilon, epsilon_high):
    """Clipped surrogate on one ratio per completion, averaged over the B completions (eq. 5).

    logps / old_logps [B, R] per response token, advantages [B], mask [B, R]. The ratio is of the whole
    sequences: exp(Σ_t log π_θ − Σ_t log π_old), neither length-normalised (GSPO) nor per token (GRPO);
    on-policy its gradient is −A_i ∇ log π_θ(o_i), the REINFORCE estimator of the paper.
    """
    # [B]: sequence log-probs, padding zeroed (it may hold anything; after the EOS nothing was sampled)
    log_ratio = jnp.sum(jnp.where(mask, logps, 0.0), 1) - jnp.sum(jnp.where(mask, old_logps, 0.0), 1)
    ratio = jnp.exp(log_ratio)  # with one update per batch old = sg(π_θ): ratio 1
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    # pessimistic: the clip only ever removes gradient; a plain mean over completions, as TRL (not tokens)
    loss = jnp.mean(-jnp.minimum(ratio * advantages, clipped * advantages))
    low = (ratio < 1.0 - epsilon) & (advantages < 0)  # clipped from below: pushing further down is blocked
    high = (ratio > 1.0 + epsilon_high) & (advantages > 0)  # clipped from above
    # shares of the B completions (TRL's names); low_min / high_max: all of them / any of them clipped
    low, high = low.astype(jnp.float32), high.astype(jnp.float32)
    return loss, {
        "clip_ratio/low_mean": low.mean(),
        "clip_ratio/low_min": low.min(),
        "clip_ratio/high_mean": high.mean(),
        "clip_ratio/high_max": high.max(),
        "clip_ratio/region_mean": jnp.maximum(low, high).mean(),
    }


def rollout_logps(
    backbone,
    params,
    ref_params,
    frozen,
    batch,
    *,
    context_length,
    temperature,
    top_k=0,
    top_p=1.0,
    min_p=None,
):
    """π_old (the rollout policy's, of the distribution sampled from: temperature, top-k, top-p, min-p) and
    π_ref (logits / T only: docs/grpo.md, detail 17) log-probs of a finished batch (β > 0)."""
    # differs from grpo.py's: π_old always (the sequence KL folded into the reward is π_old's)
    ids, mask = batch["query_responses"], batch["padding_mask"]
    old_logps = response_logps(
        backbone,
        params,
        frozen,
        ids,
        mask,
        context_length=context_length,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
    )[0]
    out = {"old_logps": old_logps}
    if ref_params is not None:
        out["ref_logps"] = response_logps(
            backbone, ref_params, frozen, ids, mask, context_length=context_length, temperature=temperature
        )[0]
    return out


# ---- train_step: one update of the policy on a (mini-)batch of completions
def train_step(backbone, optimizer, args, state, frozen, *, batch, context_length):
    """One update on a (mini-)batch of completions. state = (params, opt_state). batch: query_responses /
    padding_mask [B, Q+R], response_mask [B, R], advantages [B] (the KL already in them); old_logps [B, R]
    from rollout time when more than one update uses the batch; sampler_logps [B, R] when this is the first
    forward of the weights that sampled."""
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
        # one update per generation batch: π_old is π_θ itself, held constant (ratio 1, gradient of π_θ)
        old = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(logps)
        loss, metrics = rloo_loss(
            logps,
            old,
            batch["advantages"],
            batch["response_mask"],
            epsilon=args.epsilon,
            epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
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
    if args.num_mini_batches < 1 or args.num_iterations < 1 or args.temperature <= 0:
        raise common.UsageError("--num-mini-batches and --num-iterations must be ≥ 1, --temperature > 0")
    if not 0 < args.top_p <= 1 or args.top_k < 0 or not 0 <= (args.min_p or 0) <= 1:
        raise common.UsageError("--top-p must be in (0, 1], --top-k ≥ 0 (0: off), --min-p in [0, 1]")
    if g < 2 or b % g:
        raise common.UsageError(
            f"--batch-size {b} must be a multiple of --num-generations {g} (≥ 2: a lone "
            "completion has no other to be its baseline)"
        )
    if b % args.num_mini_batches or b // args.num_mini_batches % mesh.shape["data"]:
        raise common.UsageError(
            f"--batch-size {b} must split into --num-mini-batches {args.num_mini_batches} "
            f"each divisible by the data axis ({mesh.shape['data']})"
        )
    if args.reward_clip_range is not None and not args.reward_clip_range[0] < args.reward_clip_range[1]:
        low, high = args.reward_clip_range
        raise common.UsageError(f"--reward-clip-range {low} {high}: expected MIN < MAX")
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
    # rows: the columns reward functions may read
    prompts, rows = common.read_prompts(
        args.dataset, template, "--dataset", args.dataset_config, args.dataset_split
    )
    g, n_prompts = args.num_generations, args.batch_size // args.num_generations
    # --max-steps, or --num-epochs' worth of B/k prompts
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
    q = queries.shape[1]
    r = args.response_length
    pad = tokenizer.pad_token_id
    stops = common.stop_token_ids(tokenizer, template, args.stop_token)  # EOS, the turn end, --stop-token
    print(
        f"data: {len(prompts)} prompts, queries padded to ≤ {q} tokens (a batch: its bucket); "
        f"{n_prompts} prompts × k={g} completions of ≤ {r} tokens per step, ended by ids {stops}; "
        f"reward: {args.reward_model or ', '.join(args.reward_fn)}"
    )

    # Policy trainable; reference (β > 0) = frozen copy of its initial values (with LoRA: the LoRA-off base)
    params, frozen = common.split_variables(backbone, frozen_dtype=run.frozen_dtype)
    # Through one jit with explicit out_shardings, so the trainable values carry the mesh in their types and are
    # committed to their devices, as the updated ones will be: the sampler sees the same input types every step.
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=common.shardings(params))(params)
    ref_params = common.frozen_copy(params, run.frozen_dtype) if args.beta else None
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
    # --resume: params, optimizer state, sampling key, mini-batch shuffler (the prompt order is a function of the step)
    (params, opt_state, key_data), meta = run.resume(
        (params, opt_state, jax.random.key_data(key)), {"rng": rng.bit_generator.state}
    )
    # the key through the host: restored, it sits on one device, which jit refuses beside mesh-wide inputs
    key = jax.random.wrap_key_data(np.asarray(key_data))
    rng.bit_generator.state = meta["rng"]
    state = jax.device_put((params, opt_state), state_shardings)

    # q: what is sampled and scored
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    gen_fn = jax.jit(
        functools.partial(
            generate, backbone, response_length=r, stop_ids=stops, pad_id=pad, group=g, **sampling
        )
    )  # group: a prompt's G rows share its prefill
    logps_fn = jax.jit(
        lambda p, rp, f, b: rollout_logps(
            backbone, p, rp, f, b, context_length=common.query_length(b), **sampling
        )
    )
    step_fn = remat.jit(
        lambda s, f, b: train_step(
            backbone, optimizer, args, s, f, batch=b, context_length=common.query_length(b)
        ),
        donate_argnums=0,
        out_shardings=(state_shardings, common.replicated(run.mesh)),
    )
    # args.json: the mode --remat auto chose, the warmup steps
    run.record(remat=remat, num_warmup_steps=warmup)
    # Every process samples, scores and updates the same global batch: rollout arrays [B, ...] over `data`.
    on_data = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec("data"))
    # FLOPs (docs/design.md): 2N per token per forward (sampling; π_old and π_ref when needed; reward model),
    # 6N per token per trained forward+backward (every iteration).
    n = plumbing.count_params(backbone)
    n_rm = plumbing.count_params(scorer.model.backbone) if scorer.model is not None else 0
    extra_forwards = (off_policy or args.beta > 0) + (args.beta > 0)  # π_old (the KL's or the ratio's), π_ref
    flops_per_token = 2 * n * (1 + extra_forwards) + 2 * n_rm + args.num_iterations * 6 * n

    # ---- the loop: rollout -> rewards -> advantages -> update ----
    for step in run.steps(
        learning_rate=lambda s: schedule(s * args.num_iterations * args.num_mini_batches),
        summed=("charts/generated_tokens",),
        show=("reward", "frac_reward_zero_std"),
    ):
        ticks = [time.perf_counter()]
        idx = np.repeat(order[step * n_prompts : (step + 1) * n_prompts], g)  # [B]
        # rollout: k completions of each of B/k prompts (a group = k consecutive rows), cut after a stop token
        key, gen_key = jax.random.split(key)
        batch, sequence_lengths = rollout(
            gen_fn,
            state[0],
            frozen,
            queries[idx],
            query_mask[idx],
            key=gen_key,
            stop_ids=stops,
            pad_id=pad,
            on_data=on_data,
        )
        qb = common.query_length(batch)  # the width of this batch's queries: the bucket of its longest prompt
        ticks.append(plumbing.synced(batch))
        # rewards: one scalar per completion (1), a weighted sum over the reward functions (or the RM score)
        texts, ids, lengths, has_eos = common.decode_completions(
            tokenizer, batch, sequence_lengths, qb, stops
        )
        scores, parts = scorer(
            [prompts[i] for i in idx],
            texts,
            batch,
            rows=[rows[i] for i in idx],
            completion_ids=ids,
            end=common.turn_end(template),
        )
        rewards = common.to_host(scores)
        if args.mask_truncated_completions:  # DAPO: a cut-off completion is in neither the KL nor the loss
            batch["response_mask"] = batch["response_mask"] & common.put_global(has_eos[:, None], on_data)
        # the KL to the reference per completion (2): π_old and π_ref forwards at rollout time, no gradient
        logps = logps_fn(state[0], ref_params, frozen, batch) if off_policy or ref_params is not None else {}
        kl = np.zeros(len(idx), np.float32)
        kl_log = {}
        # mismatch/*: the sampler's log q against the first forward of its weights: here, else train_step's
        meter = {}
        if "old_logps" in logps:
            meter = mismatch(logps["old_logps"], batch.pop("sampler_logps"), batch["padding_mask"][:, qb:])
        if ref_params is not None:  # logged per real token, as TRL: Σ_i KL_i / Σ_i |o_i|
            kl = common.to_host(sequence_kl(logps["old_logps"], logps["ref_logps"], batch["response_mask"]))
            kl_log = {"kl": float(kl.sum() / max(common.to_host(batch["response_mask"]).sum(), 1))}
        # advantages: each reward less β·KL, against the mean of the other k − 1 of its prompt (3), (4)
        advantages, group_std = jax.device_get(
            rloo_advantages(
                jnp.asarray(rewards),
                jnp.asarray(kl),
                g,
                beta=args.beta,
                normalize_advantages=args.normalize_advantages,
                reward_clip_range=args.reward_clip_range,
            )
        )
        batch["advantages"] = common.put_global(advantages, on_data)
        if off_policy:  # π_old of the ratio (5); one update per batch takes sg(π_θ) instead (train_step)
            batch["old_logps"] = logps["old_logps"]
        ticks.append(plumbing.synced(batch))
        # update: num_iterations passes, each over num_mini_batches shuffled mini-batches
        updates = []
        for mb_idx in common.mini_batches(
            rng, args.batch_size, args.num_mini_batches, args.num_iterations, on_data
        ):
            state, metrics = step_fn(state, frozen, jax.tree.map(lambda x: x[mb_idx], batch))
            updates.append(metrics)
        # generate tokens/s: the tokens sampled, through each stop token (all R without one); tokens/s and
        # MFU count real tokens: those and each prompt's, of B·(Qb+R) padded (charts/padding_fraction)
        real = int(query_mask[idx].sum() + (lengths + has_eos).sum())
        run.log(
            {
                **plumbing.phase_metrics(updates, ticks, int((lengths + has_eos).sum())),
                **meter,
                **common.reward_metrics(rewards, parts, lengths, has_eos),
                "reward_std": float(rewards.std(ddof=1)),  # the batch's (grpo.py logs its groups' mean std)
                **kl_log,
                "frac_reward_zero_std": float(np.mean(np.isclose(group_std, 0.0))),
                "charts/generate_compilations": float(gen_fn._cache_size()),
                "charts/query_padding_fraction": float(1 - query_mask[idx].sum() / (len(idx) * qb)),
            },
            tokens=real,
            padded=len(idx) * (qb + r),
            flops=real * flops_per_token,
        )
        if args.sample_every and (step % args.sample_every == 0 or step + 1 == max_steps):
            for i in range(min(4, g)):  # the first group: one prompt, its completions, their advantages
                print(
                    f"step {step + 1} sample: {prompts[idx[i]]!r} -> {texts[i]!r} reward {rewards[i]:.3f} "
                    f"advantage {float(advantages[i]):+.2f}"
                )
        run.checkpoint((state[0], state[1], jax.random.key_data(key)), {"rng": rng.bit_generator.state})

    # ---- outputs: the policy (LoRA merged) as a KerasHub preset ----
    run.finish(lambda path: common.save_model(model, state[0], path))


if __name__ == "__main__":
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
