"""GRPO: group-relative policy optimisation with verifiable rewards (no value model).

Shao et al. 2024 (DeepSeekMath); loss variants from DAPO (Yu et al. 2025) and Dr. GRPO (Liu et al. 2025).
    python grpo.py --model runs/sft…/model --reward-fn my_checks.py:correct my_checks.py:formatted
Offline, toy checker data/toy.py:batch_score (the defaults are for real models; `tiny` takes its own):
    python grpo.py --model tiny --max-steps 30 --batch-size 64 --learning-rate 3e-4 \
        --max-prompt-length 64 --response-length 16 --beta 0.04
"""

import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Literal

import common  # first: --help without heavy imports, KERAS_BACKEND=jax before keras loads

import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax


@dataclass
class Args:
    # model
    model: str = "tiny"
    """policy init: alias (gemma_2b, …), KerasHub preset, kaggle:// / hf:// handle, local preset / HF dir, `tiny`"""
    chat_template: Literal["gemma", "llama3", "mistral", "chatml"] | None = None
    """how chats (message lists) are rendered; None: --model's family's (Gemma: gemma, Llama 3: llama3,
    Mistral: mistral, Qwen: chatml)"""
    dtype: Literal["bfloat16", "float32"] | None = None
    """compute dtype; weights and optimizer state stay float32. None: bfloat16 on TPU/GPU, float32 on CPU"""
    lora_rank: int = 0
    """0 = full fine-tuning; >0 = LoRA on the backbone (the reference is then the LoRA-off base)"""
    mesh: str | None = None
    """device mesh, e.g. `data=4,model=2`; None: every device on `data`"""
    remat: Literal["auto", "on", "off"] = "auto"
    """recompute each decoder block's activations in the backward pass (KV-cached sampling is not affected);
    auto: on only if the step compiled without it would not fit the device's memory (never on CPU)"""
    # rewards
    reward_fn: tuple[str, ...] = (os.path.join(common.HERE, "data", "toy.py") + ":batch_score",)
    """one or more `path.py:function`, each f(prompts, responses) -> scores; used when --reward-model is not given"""
    reward_weights: tuple[float, ...] = ()
    """weight of each --reward-fn in the summed reward; empty: all 1"""
    reward_model: str | None = None
    """reward.py's `model/` dir: its score on the last real token is the reward"""
    # data
    dataset: str = os.path.join(common.HERE, "data", "prompts_train.jsonl")
    """prompts (`prompt`: string or message list): .jsonl/.json/.parquet, or a Hugging Face dataset"""
    max_prompt_length: int = 512
    """prompt tokens (BOS included); longer prompts are cut from the left (TRL GRPOConfig ≤ 0.2x: 512)"""
    # rollouts
    num_generations: int = 8
    """G: completions sampled per prompt (one group)"""
    response_length: int = 256
    """new tokens sampled per completion (TRL's max_completion_length: 256); without EOS by then: `clipped`"""
    temperature: float = 1.0
    """sampling temperature; log-probs are computed from logits / temperature to match"""
    # optimisation
    max_steps: int | None = None
    """GRPO iterations (one generation batch each); None: ceil(--num-epochs × prompts / prompts a step)"""
    num_epochs: float = 3.0
    """passes over --dataset that set --max-steps when it is None (TRL's num_train_epochs: 3)"""
    batch_size: int = 8
    """completions per generation batch, global (prompts a step = batch_size / G; TRL: 8 per device)"""
    num_iterations: int = 1
    """μ: optimisation passes over each generation batch (>1 keeps the rollout log-probs as π_old)"""
    num_mini_batches: int = 1
    """mini-batches per pass (each a whole number of groups is not required: advantages are fixed first)"""
    learning_rate: float = 1e-6
    """AdamW learning rate (TRL GRPOConfig: 1e-6), constant after warm-up (TRL: linear decay to 0);
    the `tiny` demos use 5e-5"""
    warmup_steps: int = 0
    """linear warm-up, in optimizer updates"""
    max_grad_norm: float = 1.0
    """global gradient-norm clip"""
    seed: int = 0
    """seeds init (tiny), prompt order and sampling"""
    # algorithm
    beta: float = 0.0
    """β: weight of the k3 KL to the reference (TRL GRPOConfig: 0.0; DeepSeekMath: 0.04); 0 drops the
    reference model entirely"""
    epsilon: float = 0.2
    """ε: ratio clip, lower side (and upper side unless --epsilon-high is given)"""
    epsilon_high: float | None = None
    """ε_high: upper ratio clip (DAPO's clip-higher: 0.28); None: --epsilon"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """advantage scale: `group` (÷ group std, GRPO), `batch` (÷ batch std), `none` (Dr. GRPO: no division)"""
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = "dapo"
    """aggregation: `dapo` (token mean over the batch), `grpo` (per-sequence mean, then batch mean),
    `dr_grpo` (token sum ÷ (batch × response_length)); see docs/grpo.md for why `dapo` is the default"""
    mask_truncated_completions: bool = False
    """leave completions without EOS out of the loss (DAPO's overlong filtering)"""
    # logging and outputs
    export_hf: bool = False
    """also write the final model as a Hugging Face checkpoint (safetensors + config.json) in <output-dir>/model_hf/"""
    output_dir: str | None = None
    """None: runs/grpo__{model}__{seed}__{time}"""
    sample_every: int = 10
    """print one group's decoded completions with their rewards every N steps (0: never)"""
    save_every: int = 0
    """checkpoint every N steps (0: only on SIGTERM/SIGINT); the newest 3 are kept"""
    resume: bool = False
    """continue from the newest complete checkpoint in --output-dir"""
    overwrite: bool = False
    """replace a run already in --output-dir (otherwise refused)"""
    track: bool = False
    """also log to Weights & Biases"""
    # multi-host (TPU pods and clusters are detected without these)
    coordinator_address: str | None = None
    """host:port of process 0, for jax.distributed"""
    num_processes: int | None = None
    """number of processes in the run"""
    process_id: int | None = None
    """this process's index"""



# ---------------------------------------------------------------------------
# Data: prompt texts (common.read_dataset: strings or chats) -> left-padded query ids [N, Q]
# ---------------------------------------------------------------------------
def tokenize_prompts(prompts, tokenizer, max_prompt_length):
    """-> (queries [N, Q] left-padded, query_mask [N, Q]), Q a multiple of 8."""
    ids = [[tokenizer.start_token_id] + list(x) for x in tokenizer.tokenize(prompts)]
    ids = [x[:1] + x[1:][-(max_prompt_length - 1):] for x in ids]  # cut from the left, BOS kept
    q = min(max_prompt_length, 8 * math.ceil(max(len(x) for x in ids) / 8))
    queries, mask = np.zeros((len(ids), q), np.int32), np.zeros((len(ids), q), bool)
    for i, x in enumerate(ids):  # left padding: every prompt ends at column Q-1, responses start at Q
        queries[i, q - len(x):], mask[i, q - len(x):] = x, True
    return queries, mask


# ---------------------------------------------------------------------------
# ALGO LOGIC: KV-cached sampling (fixed shapes: compiled once), forwards of the policy, reference and
# reward model on query + response, group-relative advantages, the k3 KL, the clipped surrogate
# ---------------------------------------------------------------------------
def generate(backbone, params, frozen, queries, query_mask, key, response_length, temperature):
    """Sample `response_length` tokens after left-padded queries [B, Q] -> responses [B, R].

    One prefill writes the prompt into the cache; a `lax.scan` then feeds one token
    per step. Tokens after an EOS are sampled too and cut later (truncate_response),
    so every shape is fixed: one compilation per run.
    """
    b, q = queries.shape
    padding_mask = jnp.concatenate([query_mask, jnp.ones((b, response_length), bool)], 1)  # [B, S]
    state = zip(backbone.trainable_variables + backbone.non_trainable_variables, params + frozen)
    with keras.StatelessScope(state_mapping=state):
        cache = common.empty_cache(backbone, b, q + response_length)  # [B, L, 2, S, K, H]
        logits, cache = common.cached_forward(backbone, queries, padding_mask, cache, 0)  # prefill

        def step(carry, _):
            logits, cache, index, key = carry
            key, sample_key = jax.random.split(key)
            token = jax.random.categorical(sample_key, logits / temperature).astype(jnp.int32)
            logits, cache = common.cached_forward(backbone, token[:, None], padding_mask, cache, index)
            return (logits[:, -1], cache, index + 1, key), token

        _, tokens = jax.lax.scan(step, (logits[:, -1], cache, jnp.int32(q), key), None, length=response_length)
    return tokens.T  # [B, R]


def truncate_response(responses, eos_id, pad_id):
    """Keep tokens up to and including the first EOS, pad after it.

    -> (responses [B, R], sequence_lengths [B]: index of the last real token,
    the EOS, or R-1 when none was sampled).
    """
    r = responses.shape[1]
    is_eos = responses == eos_id
    first_eos = jnp.where(is_eos.any(1), jnp.argmax(is_eos, 1), r - 1)
    return jnp.where(jnp.arange(r)[None] > first_eos[:, None], pad_id, responses), first_eos


def hidden_states(backbone, params, frozen, token_ids, padding_mask):
    """Final-norm hidden states [B, T, D] (stateless: weights passed as values)."""
    state = zip(backbone.trainable_variables + backbone.non_trainable_variables, params + frozen)
    with keras.StatelessScope(state_mapping=state):
        return backbone({"token_ids": token_ids, "padding_mask": padding_mask})


def response_logps(backbone, params, frozen, token_ids, padding_mask, context_length, temperature):
    """log π(response token) from logits / temperature, and the entropy: [B, R] each, float32.

    Position t predicts token t+1, so response token Q+i is scored by hidden[Q+i-1].
    The [B, R, V] logits are made one response position at a time under jax.checkpoint.
    """
    hidden = hidden_states(backbone, params, frozen, token_ids, padding_mask)[:, context_length - 1:-1]
    labels = token_ids[:, context_length:]  # [B, R]
    state = zip(backbone.trainable_variables + backbone.non_trainable_variables, params + frozen)
    with keras.StatelessScope(state_mapping=state):
        @jax.checkpoint
        def position(h, y):  # [B, D], [B] -> [B], [B]
            logits = common.logits(backbone, h) / temperature  # f32
            logz = jax.nn.logsumexp(logits, -1)
            entropy = logz - jnp.sum(jax.nn.softmax(logits, -1) * logits, -1)
            return jnp.take_along_axis(logits, y[:, None], -1)[:, 0] - logz, entropy

        logps, entropy = jax.lax.map(lambda hy: position(*hy), (hidden.swapaxes(0, 1), labels.T))
    return logps.T, entropy.T


def reward_scores(backbone, params, frozen, head, token_ids, padding_mask, last_index):
    """Reward-model score r(x, y) at the last real token (index [B] into T): [B]."""
    hidden = hidden_states(backbone, params, frozen, token_ids, padding_mask)
    h = jnp.take_along_axis(hidden, last_index[:, None, None], 1)[:, 0].astype(jnp.float32)
    return (h @ head["weight"])[:, 0] + head["bias"]


def masked_mean(x, mask):
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(mask.sum(), 1)


def group_advantages(rewards, num_generations, scale_rewards="group", eps=1e-4):
    """Â_i = (r_i − mean(group)) / (std(group) + ε)   (eq. 2 of docs/grpo.md).

    rewards [B] hold B/G groups of G consecutive completions of one prompt. std has
    Bessel's correction (as TRL); `batch` divides by the std of all B rewards instead,
    `none` not at all (Dr. GRPO). A group whose rewards are all equal gets Â = 0: it
    carries no signal. -> (advantages [B], group std [B/G]).
    """
    grouped = rewards.reshape(-1, num_generations)  # [B/G, G]
    std = grouped.std(1, ddof=1)
    advantages = grouped - grouped.mean(1, keepdims=True)
    if scale_rewards == "group":
        advantages = advantages / (std[:, None] + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std(ddof=1) + eps)
    return advantages.reshape(-1), std


def k3_kl(logps, ref_logps):
    """Per-token KL(π ‖ π_ref) estimate k3 = π_ref/π − log(π_ref/π) − 1 (Schulman 2020): ≥ 0, unbiased
    on tokens sampled from π, lower variance than k1 = log π − log π_ref.   (eq. 4)"""
    log_ratio = ref_logps - logps
    return jnp.expm1(log_ratio) - log_ratio


def aggregate(per_token, mask, loss_type):
    """Per-token losses [B, R] -> scalar, by --loss-type (eq. 5); masked tokens never count."""
    x = jnp.where(mask, per_token, 0.0)
    if loss_type == "grpo":  # mean over each completion's tokens, then over completions
        return jnp.mean(x.sum(1) / jnp.maximum(mask.sum(1), 1))
    if loss_type == "dr_grpo":  # a constant denominator: no length normalisation at all
        return x.sum() / x.size
    return x.sum() / jnp.maximum(mask.sum(), 1)  # dapo: every token of the batch weighs the same


def grpo_loss(logps, old_logps, ref_logps, advantages, mask, epsilon, epsilon_high, beta, loss_type):
    """Clipped surrogate (eq. 3) + β·k3 KL (eq. 4), aggregated by `loss_type` (eq. 5).

    logps / old_logps / ref_logps [B, R] per response token (ref_logps None when β = 0),
    advantages [B] (one per completion, the same for each of its tokens), mask [B, R].
    """
    ratio = jnp.exp(logps - old_logps)  # π_θ / π_θold; with one update per batch old = sg(π_θ): ratio 1
    a = advantages[:, None]
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    per_token = -jnp.minimum(ratio * a, clipped * a)  # pessimistic: the clip only ever removes gradient
    metrics = {}
    if beta:
        kl = k3_kl(logps, ref_logps)
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl, mask)
    low = (ratio < 1.0 - epsilon) & (a < 0)  # clipped from below: pushing further down is blocked
    high = (ratio > 1.0 + epsilon_high) & (a > 0)  # clipped from above
    metrics.update({"clip_ratio/low_mean": masked_mean(low, mask), "clip_ratio/high_mean": masked_mean(high, mask),
                    "clip_ratio": masked_mean(low | high, mask)})
    return aggregate(per_token, mask, loss_type), metrics


def rollout_logps(backbone, params, ref_params, frozen, batch, context_length, temperature):
    """π_old and π_ref log-probs of a finished generation batch ({} entries left out when not needed)."""
    ids, mask = batch["query_responses"], batch["padding_mask"]
    out = {}
    if params is not None:
        out["old_logps"] = response_logps(backbone, params, frozen, ids, mask, context_length, temperature)[0]
    if ref_params is not None:
        out["ref_logps"] = response_logps(backbone, ref_params, frozen, ids, mask, context_length, temperature)[0]
    return out


# ---------------------------------------------------------------------------
# train_step: one update of the policy on a (mini-)batch of completions
# ---------------------------------------------------------------------------
def train_step(backbone, optimizer, args, state, frozen, batch, context_length):
    """One update on a (mini-)batch of completions. state = (params, opt_state).

    batch: query_responses / padding_mask [B, Q+R], response_mask [B, R], advantages [B],
    and, when computed at rollout time, old_logps / ref_logps [B, R].
    """
    params, opt_state = state
    ids, mask = batch["query_responses"], batch["padding_mask"]

    def loss_fn(p):
        logps, entropy = response_logps(backbone, p, frozen, ids, mask, context_length, args.temperature)
        # one update per generation batch: π_old is π_θ itself, held constant (ratio 1, gradient of π_θ)
        old = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(logps)
        loss, metrics = grpo_loss(logps, old, batch.get("ref_logps"), batch["advantages"], batch["response_mask"],
                                  args.epsilon, args.epsilon if args.epsilon_high is None else args.epsilon_high,
                                  args.beta, args.loss_type)
        return loss, {**metrics, "entropy": masked_mean(entropy, batch["response_mask"])}

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state), {**metrics, "train/loss": loss, "train/grad_norm": optax.global_norm(grads)}


# ---------------------------------------------------------------------------
# main's pieces: flag checks, optimizer, rollout, rewards, phase times
# ---------------------------------------------------------------------------
def check_args(args, mesh):
    """Inconsistent sizes, unsupported choices, a --reward-model that is not one: stop before the model loads."""
    g, b = args.num_generations, args.batch_size
    if args.num_mini_batches < 1 or args.num_iterations < 1 or args.temperature <= 0:
        raise common.UsageError("--num-mini-batches and --num-iterations must be ≥ 1, --temperature > 0")
    if g < 2 or b % g:
        raise common.UsageError(f"--batch-size {b} must be a multiple of --num-generations {g} (≥ 2: a group "
                                "of one has no relative advantage)")
    if b % args.num_mini_batches or b // args.num_mini_batches % mesh.shape["data"]:
        raise common.UsageError(f"--batch-size {b} must split into --num-mini-batches {args.num_mini_batches} "
                                f"each divisible by the data axis ({mesh.shape['data']})")
    if args.scale_rewards not in ("group", "batch", "none") or args.loss_type not in ("dapo", "grpo", "dr_grpo"):
        raise common.UsageError("--scale-rewards: group, batch or none; --loss-type: dapo, grpo or dr_grpo")
    if args.reward_weights and len(args.reward_weights) != len(args.reward_fn):
        raise common.UsageError(f"--reward-weights: {len(args.reward_weights)} weights for "
                                f"{len(args.reward_fn)} --reward-fn functions")
    common.check_sampler(args.model)  # a family whose decoder layers the sampler knows


def make_optimizer(args):
    """Clip, AdamW (optax defaults), linear warm-up then a constant learning rate. -> (optimizer, schedule)"""
    schedule = optax.join_schedules([optax.linear_schedule(0.0, args.learning_rate, args.warmup_steps),
                                     optax.constant_schedule(args.learning_rate)], [args.warmup_steps])
    return optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.adamw(schedule)), schedule


def rollout(gen_fn, params, frozen, queries, query_mask, key, eos, pad, on_data):
    """Responses to host queries [B, Q] (whole on every process), cut after the first EOS -> (batch, lengths [B])."""
    qs, qm = common.put_global(queries, on_data), common.put_global(query_mask, on_data)
    responses, sequence_lengths = truncate_response(gen_fn(params, frozen, qs, qm, key), eos, pad)
    response_mask = jnp.arange(responses.shape[1])[None] <= sequence_lengths[:, None]  # [B, R]: EOS included
    return {"query_responses": jnp.concatenate([qs, responses], 1), "response_mask": response_mask,
            "padding_mask": jnp.concatenate([qm, response_mask], 1)}, sequence_lengths


def score_completions(reward, weights, tokenizer, prompts, batch, sequence_lengths, context_length):
    """r_i, eq. (1): the weighted sum of the reward functions on the decoded texts, or the reward model's
    score at the last real token. -> (rewards [B], texts, has_eos [B], rewards/* and completions/* metrics)"""
    responses = common.to_host(batch["query_responses"][:, context_length:])  # whole on every process
    lengths, eos = common.to_host(sequence_lengths), tokenizer.end_token_id
    texts = tokenizer.detokenize([list(x[:n + (x[n] != eos)]) for x, n in zip(responses, lengths)])  # no EOS
    has_eos = (responses == eos).any(1)
    if isinstance(reward, tuple):  # (score_fn, weights): r_φ(x, y) on the token ids
        per_fn = {"reward_model": common.to_host(reward[0](reward[1], batch["query_responses"],
                                                           batch["padding_mask"], sequence_lengths))}
    else:  # the reward functions f_k(x, y) on the texts
        per_fn = {f.__name__: np.asarray(f(prompts, texts), np.float32) for f in reward}
    rewards = np.sum([w * v for w, v in zip(weights, per_fn.values())], 0)
    lengths = lengths + 1 - has_eos  # completion tokens before the EOS
    return rewards, texts, has_eos, {
        "reward": float(rewards.mean()), **{f"rewards/{k}/mean": float(v.mean()) for k, v in per_fn.items()},
        **{f"rewards/{k}/std": float(v.std()) for k, v in per_fn.items()},
        "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(1.0 - has_eos.mean())}


def mini_batches(rng, batch_size, num_mini_batches, num_epochs, on_data):
    """Index arrays [B / num_mini_batches]: num_epochs passes over the batch, reshuffled for each."""
    mini = batch_size // num_mini_batches
    for _ in range(num_epochs):
        perm = rng.permutation(batch_size)
        for m in range(num_mini_batches):
            yield common.put_global(perm[m * mini:(m + 1) * mini], on_data)


def main(args):
    # ---- set-up: every flag, file and row checked before the models load ----
    run = common.Run("grpo", args)
    check_args(args, run.mesh)
    prompts, _ = run.read_data("prompt")
    reward = [] if args.reward_model else [common.load_reward_fn(s) for s in args.reward_fn]
    weights = np.asarray(args.reward_weights or [1.0] * max(len(reward), 1), np.float32)  # reward model: [1]
    rm = common.load_reward_model(args.reward_model, run.mesh, args.dtype) if args.reward_model else None
    model = run.load_model()  # sharded, with --lora-rank and --remat (calls with a KV cache are left alone)
    backbone, tokenizer = model.backbone, model.preprocessor.tokenizer
    if rm is not None and rm[0].preprocessor.tokenizer.vocabulary_size() != tokenizer.vocabulary_size():
        raise common.UsageError(f"--reward-model {args.reward_model}: its tokenizer differs from the policy's "
                                "(it scores the policy's token ids directly)")
    queries, query_mask = tokenize_prompts(prompts, tokenizer, args.max_prompt_length)
    q, r, g = queries.shape[1], args.response_length, args.num_generations
    n_prompts = args.batch_size // g
    print(f"data: {len(prompts)} prompts, queries padded to {q} tokens; {n_prompts} prompts × G={g} completions "
          f"of {r} tokens per step; reward: {args.reward_model or ', '.join(args.reward_fn)}")

    # Policy trainable; reference = frozen copy of its initial values (with LoRA: the zero-init
    # adapters, i.e. the LoRA-off base), only when β > 0.
    params, frozen = common.split_variables(backbone)
    # Through one jit with explicit out_shardings, so the trainable values carry the mesh in their types and are
    # committed to their devices, as the updated ones will be: the sampler sees the same input types every step.
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=common.shardings(params))(params)
    ref_params = jax.tree.map(jnp.copy, params) if args.beta else None
    off_policy = args.num_iterations > 1 or args.num_mini_batches > 1  # π_old differs from π_θ at some update
    optimizer, schedule = make_optimizer(args)
    opt_state, opt_shardings = common.init_optimizer(optimizer, params, run.mesh)  # scalars replicated
    state_shardings = (common.shardings(params), opt_shardings)
    key, rng = jax.random.key(args.seed), np.random.default_rng(args.seed)
    order = np.concatenate([rng.permutation(len(prompts)) for _ in range(
        -(-args.max_steps * n_prompts // len(prompts)))])
    # --resume: params, optimizer state, sampling key, mini-batch shuffler (the prompt order is a function of the step)
    (params, opt_state, key_data), meta = run.resume((params, opt_state, jax.random.key_data(key)),
                                                     {"rng": rng.bit_generator.state})
    key, rng.bit_generator.state = jax.random.wrap_key_data(key_data), meta["rng"]
    state = jax.device_put((params, opt_state), state_shardings)

    gen_fn = jax.jit(lambda p, f, qs, qm, k: generate(backbone, p, f, qs, qm, k, r, args.temperature))
    logps_fn = jax.jit(lambda p, rp, f, b: rollout_logps(backbone, p, rp, f, b, q, args.temperature))
    step_fn = run.jit_step(partial(train_step, backbone, optimizer, args, context_length=q), donate_argnums=0,
                           out_shardings=(state_shardings, common.replicated(run.mesh)))
    if rm is not None:  # r_φ(x, y) at the last real token, from the reward model's loaded weights
        score_fn = jax.jit(lambda w, ids, m, sl: reward_scores(rm[0].backbone, *w, ids, m, q + sl))
        reward = (score_fn, (*common.split_variables(rm[0].backbone), rm[1]))
    # Every process samples, scores and updates the same global batch: rollout arrays [B, ...] over `data`.
    on_data = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec("data"))
    # FLOPs: 2N per token per forward (sampling; π_old and π_ref when needed; reward model),
    # 6N per token per trained forward+backward (every iteration).
    n, n_rm = common.count_params(backbone), common.count_params(rm[0].backbone) if rm is not None else 0
    flops_per_seq = (q + r) * (2 * n * (1 + off_policy + (args.beta > 0)) + 2 * n_rm + args.num_iterations * 6 * n)

    # ---- the loop: rollout -> rewards -> advantages -> update ----
    for step in run.steps(learning_rate=lambda s: schedule(s * args.num_iterations * args.num_mini_batches),
                          show=("reward", "frac_reward_zero_std")):
        ticks, idx = [time.perf_counter()], np.repeat(order[step * n_prompts:(step + 1) * n_prompts], g)  # [B]
        # rollout: G completions of each of B/G prompts (a group = G consecutive rows), cut after EOS
        key, gen_key = jax.random.split(key)
        batch, sequence_lengths = rollout(gen_fn, state[0], frozen, queries[idx], query_mask[idx], gen_key,
                                          tokenizer.end_token_id, tokenizer.pad_token_id, on_data)
        ticks.append(common.synced(batch))
        # rewards: one scalar per completion, a weighted sum over the reward functions (or the RM score)
        rewards, texts, has_eos, reward_metrics = score_completions(
            reward, weights, tokenizer, [prompts[i] for i in idx], batch, sequence_lengths, q)
        # advantages: relative to the other completions of the same prompt
        advantages, group_std = jax.device_get(group_advantages(jnp.asarray(rewards, jnp.float32), g,
                                                                args.scale_rewards))
        if args.mask_truncated_completions:  # DAPO: a cut-off completion is not judged at all
            batch["response_mask"] = batch["response_mask"] & common.put_global(has_eos[:, None], on_data)
        batch["advantages"] = common.put_global(advantages, on_data)
        if off_policy or ref_params is not None:  # else neither π_old nor π_ref needs a forward
            batch.update(logps_fn(state[0] if off_policy else None, ref_params, frozen, batch))
        ticks.append(common.synced(batch))
        # update: num_iterations passes, each over num_mini_batches shuffled mini-batches
        updates = []
        for mb_idx in mini_batches(rng, args.batch_size, args.num_mini_batches, args.num_iterations, on_data):
            state, metrics = step_fn(state, frozen, jax.tree.map(lambda x: x[mb_idx], batch))
            updates.append(metrics)
        run.log({**common.phase_metrics(updates, ticks, len(idx) * r), **reward_metrics,
                 "reward_std": float(np.mean(group_std)),
                 "frac_reward_zero_std": float(np.mean(np.isclose(group_std, 0.0))),
                 "charts/generate_compilations": float(gen_fn._cache_size())},
                tokens=len(idx) * (q + r), flops=len(idx) * flops_per_seq)
        if args.sample_every and (step % args.sample_every == 0 or step + 1 == args.max_steps):
            for i in range(min(4, g)):  # the first group: one prompt, its completions, their advantages
                print(f"step {step + 1} sample: {prompts[idx[i]]!r} -> {texts[i]!r} reward {rewards[i]:.3f} "
                      f"advantage {float(advantages[i]):+.2f}")
        run.checkpoint((state[0], state[1], jax.random.key_data(key)), {"rng": rng.bit_generator.state})

    # ---- outputs: the policy (LoRA merged) as a KerasHub preset ----
    run.finish(lambda path: common.save_model(model, state[0], path))


if __name__ == "__main__":
    main(common.cli(Args))
