r"""On-policy distillation: the student samples, a frozen teacher of the same vocabulary grades every token.

Agarwal et al. 2024 (GKD, arXiv:2306.13649); TRL's DistillationTrainer: generalized JSD chosen by β
(0: forward KL, 1: reverse KL, the default). Data: `prompt` (string or chat messages).
    python distill.py --model qwen3.5_0.8b --teacher-model qwen3.5_9b --dataset my_prompts.jsonl
Offline toy (docs/distill.md: teacher = `tiny` after 150 sft.py steps, student after 40; ~2 min, 2 CPU cores):
    python distill.py --model runs/student/model --teacher-model runs/teacher/model --max-steps 40 \
        --batch-size 32 --learning-rate 1e-3 --response-length 16 --max-prompt-length 64
"""

import functools
import math
import os
import time
from dataclasses import dataclass
from typing import Literal

import plumbing  # the run shell: shared flags, Run, the exit boundary (instant to import)

# `python distill.py --help`: from Args' source, before the imports
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (mesh, models, data files)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


@dataclass
class Args(plumbing.RolloutArgs):
    """The shared flags (plumbing.RolloutArgs: model, dtype, mesh, prompts, lengths, outputs…), distill's."""

    # model
    teacher_model: str | None = None
    """the frozen teacher: any --model form; its tokenizer's vocabulary must be the student's, its width and
    depth may differ (TRL's teacher_model_name_or_path)"""
    teacher_dtype: Literal["bfloat16", "float32"] | None = None
    """the teacher's compute dtype and the dtype its weights are held in; bfloat16 halves its memory (it has
    no optimizer, so no float32 master copy is needed). None: the student's --dtype, held in --frozen-dtype"""
    # rollouts
    response_length: int = 512
    """new tokens the student samples per completion (TRL DistillationConfig's max_completion_length: 512)"""
    top_p: float = 1.0
    """top-p: sample from the likeliest tokens that hold this probability mass (1.0 = off)"""
    top_k: int = 0
    """top-k: sample among the k likeliest tokens (0 = off); the loss is over all the vocabulary, as TRL's"""
    min_p: float | None = None
    """min-p: drop tokens less likely than min_p × the top token's probability (None = off)"""
    stop_token: tuple[str, ...] = ()
    """more tokens a completion ends at (a token's text or id), besides EOS and the chat's turn end"""
    # algorithm
    beta: float = 1.0
    """β of the generalized JSD: 0 forward KL(teacher ‖ student), 1 reverse KL(student ‖ teacher) (TRL: 1.0),
    in between β·KL(p_T ‖ m) + (1 − β)·KL(p_S ‖ m), m = (1 − β)·p_S + β·p_T"""
    temperature: float = 1.0
    """τ: sampling temperature, and both models' logits are divided by it in the loss (TRL: 1.0)"""
    # logging and outputs
    export_hf: bool = False
    """also write the student as a Hugging Face checkpoint, tokenizer and template in model_hf/"""


# ---- ALGO LOGIC (the loss first: it is what this file is about): the generalized JSD on one chunk of logits,
# then the chunked projection of both models' hidden states that feeds it
def generalized_jsd(student_logits, teacher_logits, mask, beta, temperature):
    """Per-token divergence of the teacher's and the student's next-token distributions (docs/distill.md):
    logits [..., V] (float32, each model's soft-cap applied), mask [...] -> [...], 0 where mask is False.

      β = 0 (eq. 1):  KL(p_T ‖ p_S) = Σ_v p_T (log p_T − log p_S)      forward: mass-covering
      β = 1 (eq. 2):  KL(p_S ‖ p_T) = Σ_v p_S (log p_S − log p_T)      reverse: mode-seeking
      else  (eq. 3):  β·KL(p_T ‖ m) + (1 − β)·KL(p_S ‖ m),  m = (1 − β)·p_S + β·p_T
    p = softmax(logits / τ) for both. As TRL's, β = 0 and 1 are their own cases: eq. 3 tends to 0 at each end.
    """
    s = jax.nn.log_softmax(student_logits / temperature, -1)  # log p_S [..., V]
    t = jax.nn.log_softmax(teacher_logits / temperature, -1)  # log p_T [..., V]
    if beta == 0:
        per_token = jnp.sum(jnp.exp(t) * (t - s), -1)
    elif beta == 1:
        per_token = jnp.sum(jnp.exp(s) * (s - t), -1)
    else:  # log m = log((1 − β)·p_S + β·p_T), stably in log space
        m = jnp.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        per_token = beta * jnp.sum(jnp.exp(t) * (t - m), -1) + (1 - beta) * jnp.sum(jnp.exp(s) * (s - m), -1)
    return jnp.where(mask, per_token, 0.0)


def distill_loss(divergence, mask):
    """Σ over completion tokens of the per-token divergence [B, R] ÷ the batch's completion tokens (eq. 4, as
    TRL's: every token of the batch weighs the same, a long completion counts more) -> (loss, metrics)."""
    loss = jnp.sum(jnp.where(mask, divergence, 0.0)) / jnp.maximum(mask.sum(), 1)
    return loss, {"train/loss": loss}


def completion_divergence(
    backbone,
    params,
    frozen,
    teacher,
    teacher_weights,
    *,
    token_ids,
    padding_mask,
    response_mask,
    context_length,
    beta,
    temperature,
    top_k=0,
    top_p=1.0,
    min_p=None,
):
    """generalized_jsd at every completion position: [B, R] float32 (full distributions at τ); the student's
    log q of its sampled tokens and q's entropy [B, R] (filtered_logps: the distribution it sampled from, for
    mismatch/*); and the student forward's aux_loss (a mixture of experts' router loss; 0.0 dense).

    Both models run on query + response [B, Q+R]; position Q+i-1 predicts response token i, so the hidden
    states [:, Q-1:-1] are kept. The [B, R, V] logits of either model are never materialised: each model's
    own output layer (its soft-cap included) projects --logits-chunk positions at a time (common.per_token,
    under jax.checkpoint), so one [B, chunk, V] float32 block per model is alive at a time, forward and
    backward (recomputed).
    """
    teacher_params, teacher_frozen = teacher_weights
    hidden, aux_loss = common.forward(backbone, params, frozen, token_ids, padding_mask)  # [B, T, D]
    # the frozen teacher: no gradient into it (and its router's aux_loss is not trained), as TRL's no_grad
    teacher_hidden = jax.lax.stop_gradient(
        common.forward(teacher, teacher_params, teacher_frozen, token_ids, padding_mask)[0]
    )  # [B, T, D_T]
    # One tokenizer, embedding matrices of other widths (Gemma 3 1B: 262,144 rows, 4B: 262,208, the rows past
    # the tokenizer's padding): the divergence is over the ids both have (vocabularies: checked at start-up)
    v = min(backbone.vocabulary_size, teacher.vocabulary_size)

    def chunk_divergence(h, h_teacher, m, y):  # [B, C, D], [B, C, D_T], [B, C], [B, C] -> 3 × [B, C]
        with common.weights(backbone, params, frozen):  # each output layer reads its own weights
            logits = common.logits(backbone, h)[..., :v]  # f32 [B, C, V]
        with common.weights(teacher, teacher_params, teacher_frozen):
            teacher_logits = jax.lax.stop_gradient(common.logits(teacher, h_teacher)[..., :v])
        # the sampled tokens under the sampler's filters (a metric only: the divergence is the full one)
        logq, entropy = filtered_logps(
            logits.reshape(-1, v), y.reshape(-1), temperature, top_k=top_k, top_p=top_p, min_p=min_p
        )
        divergence = generalized_jsd(logits, teacher_logits, m, beta, temperature)
        return divergence, logq.reshape(m.shape), entropy.reshape(m.shape)

    def response(x):  # [B, T, ...] -> the positions that predict the response, [B, R, ...]
        return x[:, context_length - 1 : -1]

    labels = token_ids[:, context_length:]  # [B, R]: position Q+i-1's hidden state predicts token i
    arrays = (response(hidden), response(teacher_hidden), response_mask, labels)
    divergence, logq, entropy = common.per_token(backbone, chunk_divergence, arrays)
    return divergence, logq, entropy, aux_loss


# ---- Data and rollouts, as grpo.py's (copied: each algorithm file forks alone): left-padded prompts [N, Q],
# KV-cached sampling with TRL's filters, responses cut after their first stop token (EOS, turn end, …)
def tokenize_prompts(prompts, tokenizer, max_prompt_length):
    """-> (queries [N, Q] left-padded, query_mask [N, Q]), Q a multiple of 8."""
    ids = [[tokenizer.start_token_id] + list(x) for x in tokenizer.tokenize(prompts)]
    ids = [x[:1] + x[1:][-(max_prompt_length - 1) :] for x in ids]  # cut from the left, BOS kept
    q = min(max_prompt_length, 8 * math.ceil(max(len(x) for x in ids) / 8))
    queries, mask = np.zeros((len(ids), q), np.int32), np.zeros((len(ids), q), bool)
    for i, x in enumerate(ids):  # left padding: every prompt ends at column Q-1, responses start at Q
        queries[i, q - len(x) :], mask[i, q - len(x) :] = x, True
    return queries, mask


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


# ---- train_step: one update of the student on a batch of its own completions
def train_step(backbone, optimizer, args, state, frozen, *, batch, context_length, teacher, teacher_weights):
    """state = (params, opt_state); batch: query_responses / padding_mask [B, Q+R], response_mask [B, R],
    sampler_logps [B, R] when rollout made it (the sampler's log q, against this first forward: mismatch/*).

    teacher_weights (its params, its frozen values) are an input only: neither donated nor returned.
    """
    params, opt_state = state
    mask = batch["response_mask"]

    def loss_fn(p):
        divergence, logq, entropy, aux_loss = completion_divergence(
            backbone,
            p,
            frozen,
            teacher,
            teacher_weights,
            token_ids=batch["query_responses"],
            padding_mask=batch["padding_mask"],
            response_mask=mask,
            context_length=context_length,
            beta=args.beta,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
        )
        loss, metrics = distill_loss(divergence, mask)
        loss = loss + aux_loss  # + the student's router load-balancing loss (a mixture of experts; 0.0 dense)
        if "sampler_logps" in batch:  # mismatch/*: rollout's batches carry it (these weights sampled them)
            metrics.update(mismatch(logq, batch["sampler_logps"], mask))
        return loss, {
            **metrics,
            "train/loss": loss,
            "entropy": masked_mean(entropy, mask),
            "aux_loss": aux_loss,
        }

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state), {**metrics, "train/grad_norm": optax.global_norm(grads)}


# ---- main's pieces: flag checks, the teacher's checks (before any weights load)
def check_args(args):
    """Flags out of range, a teacher that cannot grade the student's tokens: stop before the models load."""
    if not 0 <= args.beta <= 1 or args.temperature <= 0:
        raise common.UsageError(
            f"--beta {args.beta} must be in [0, 1] (0: forward KL, 1: reverse KL) and "
            f"--temperature {args.temperature} > 0"
        )
    if not 0 < args.top_p <= 1 or args.top_k < 0 or not 0 <= (args.min_p or 0) <= 1:
        raise common.UsageError("--top-p must be in (0, 1], --top-k ≥ 0 (0: off), --min-p in [0, 1]")
    if args.response_length < 1:
        raise common.UsageError("--response-length must be ≥ 1")
    if not args.teacher_model:
        raise common.UsageError(
            "--teacher-model is required: the model whose next-token distributions the student learns"
        )
    if os.path.exists(os.path.join(args.teacher_model, common.HEAD_FILE)):
        raise common.UsageError(
            f"--teacher-model {args.teacher_model}: a reward model (reward.py's); the "
            "teacher is a causal LM whose next-token distributions the student learns"
        )
    common.check_sampler(args.model)  # the student samples: a family whose decoder layers the sampler knows
    student, teacher = common.vocabulary(args.model), common.vocabulary(args.teacher_model)
    if student != teacher:
        # the first id the two tokenizers disagree on
        first = next(
            (i for i, (a, b) in enumerate(zip(student, teacher)) if a != b), min(len(student), len(teacher))
        )
        raise common.UsageError(
            f"--teacher-model {args.teacher_model}: its tokenizer's vocabulary "
            f"({len(teacher)} tokens) is not --model {args.model}'s ({len(student)}; they"
            f" differ from id {first}): the divergence compares the two models' "
            "probabilities token by token"
        )


def main(args):
    # ---- set-up: every flag, file and the teacher's vocabulary checked before the models load ----
    run = plumbing.Run(__file__, args, export_hf=args.export_hf)  # flags, --output-dir checked; none written
    check_args(args)
    template = common.chat_template(args.model, args.chat_template)
    prompts, _ = common.read_prompts(
        args.dataset, template, "--dataset", args.dataset_config, args.dataset_split
    )
    max_steps = run.resolve_max_steps(len(prompts), args.batch_size)  # --max-steps, or --num-epochs' worth
    model = common.load_model(
        args.model, run.mesh, run.dtype, args.seed, logits_chunk=args.logits_chunk, **args.lora
    )  # LoRA: the student's
    # the teacher: laid out on the mesh by the same rule (its family's layout map, or the generic one)
    teacher_model = common.load_model(
        args.teacher_model,
        run.mesh,
        args.teacher_dtype or run.dtype,
        args.seed,
        logits_chunk=args.logits_chunk,
    )
    backbone, tokenizer = model.backbone, model.preprocessor.tokenizer
    teacher = teacher_model.backbone
    remat = plumbing.Remat(args.remat, backbone)  # --remat: a checkpoint switch on each student block
    queries, query_mask = tokenize_prompts(prompts, tokenizer, args.max_prompt_length)
    q = queries.shape[1]
    r = args.response_length
    pad = tokenizer.pad_token_id
    stops = common.stop_token_ids(tokenizer, template, args.stop_token)  # EOS, the turn end, --stop-token
    print(
        f"data: {len(prompts)} prompts, queries padded to ≤ {q} tokens (a batch: its bucket); "
        f"{args.batch_size} completions of ≤ {r} tokens a step, ended by ids {stops}; teacher "
        f"{args.teacher_model}"
    )

    params, frozen = common.split_variables(backbone, frozen_dtype=run.frozen_dtype)
    # committed to the mesh in their types, as the updated ones will be: the sampler compiles once (grpo.py)
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=common.shardings(params))(params)
    # never updated, saved or donated: held in --teacher-dtype, else --frozen-dtype (the compute dtype)
    teacher_weights = common.split_variables(
        teacher, frozen_dtype=args.teacher_dtype or run.frozen_dtype, all_frozen=True
    )
    # over max_steps, unless resumed (run.schedule_steps)
    optimizer, schedule, warmup = plumbing.make_optimizer(args, run.schedule_steps)
    opt_state, opt_shardings = common.init_optimizer(optimizer, params, run.mesh)
    state_shardings = (common.shardings(params), opt_shardings)
    key, rng = jax.random.key(args.seed), np.random.default_rng(args.seed)
    order = np.concatenate(
        [rng.permutation(len(prompts)) for _ in range(-(-max_steps * args.batch_size // len(prompts)))]
    )
    # --resume: params, optimizer state, sampling key (the prompt order: a function of the seed and the step)
    (params, opt_state, key_data), _ = run.resume((params, opt_state, jax.random.key_data(key)))
    key = jax.random.wrap_key_data(np.asarray(key_data))  # through the host: not committed to one device
    state = jax.device_put((params, opt_state), state_shardings)

    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    gen_fn = jax.jit(
        functools.partial(generate, backbone, response_length=r, stop_ids=stops, pad_id=pad, **sampling)
    )

    def update(
        state, frozen, batch, teacher_weights
    ):  # the batch's own query width: a compilation per bucket
        context_length = common.query_length(batch)
        return train_step(
            backbone,
            optimizer,
            args,
            state,
            frozen,
            batch=batch,
            context_length=context_length,
            teacher=teacher,
            teacher_weights=teacher_weights,
        )

    # the state donated (updated in place); the teacher's weights an input only
    step_fn = remat.jit(
        update, donate_argnums=0, out_shardings=(state_shardings, common.replicated(run.mesh))
    )
    run.record(remat=remat, num_warmup_steps=warmup)  # args.json: the mode --remat auto chose, warmup steps
    on_data = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec("data"))
    # FLOPs (docs/design.md): 2N per token sampling, 6N the student's forward + backward, 2N_T the teacher's
    flops_per_token = 8 * plumbing.count_params(backbone) + 2 * plumbing.count_params(teacher)

    # ---- the loop: rollout (the student samples) -> the teacher grades every token -> update ----
    for step in run.steps(learning_rate=schedule, show=("entropy",), summed=("charts/generated_tokens",)):
        ticks = [time.perf_counter()]
        idx = order[step * args.batch_size : (step + 1) * args.batch_size]  # [B]
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
        ticks += [plumbing.synced(batch)] * 2  # generated; "scored" too: the teacher runs inside the update
        state, metrics = step_fn(state, frozen, batch, teacher_weights)
        lengths = common.to_host(sequence_lengths) + 1  # completion tokens through each stop (R without one)
        qb = common.query_length(batch)
        real = int(query_mask[idx].sum() + lengths.sum())
        logged = plumbing.phase_metrics([metrics], ticks, int(lengths.sum()))
        del logged["charts/score_time"]  # no phase of its own: the teacher's forward is inside the update's
        run.log(
            {
                **logged,
                "completions/mean_length": float(lengths.mean()),  # TRL's completion metrics
                "completions/max_length": float(lengths.max()),
                "completions/min_length": float(lengths.min()),
                "completions/truncated_fraction": float(np.mean(lengths >= r)),
            },
            tokens=real,
            padded=len(idx) * (qb + r),
            flops=real * flops_per_token,
        )
        if args.sample_every and (step % args.sample_every == 0 or step + 1 == max_steps):
            # each cut before its stop token
            texts = common.decode_completions(tokenizer, batch, sequence_lengths, qb, stops)[0]
            for i in range(2):
                print(f"step {step + 1} sample: {prompts[idx[i]]!r} -> {texts[i]!r}")
        run.checkpoint((state[0], state[1], jax.random.key_data(key)))

    # ---- outputs: the student (LoRA merged) as a KerasHub preset; the teacher is not saved ----
    run.finish(lambda path: common.save_model(model, state[0], path))


if __name__ == "__main__":
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
