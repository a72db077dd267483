"""GRPO: group-relative policy optimisation with verifiable rewards (no value model).

Shao et al. 2024 (DeepSeekMath); loss variants from DAPO (Yu et al. 2025) and Dr. GRPO (Liu et al. 2025).
    python grpo.py --model runs/sft…/model --reward-fn my_checks.py:correct my_checks.py:formatted
Offline, on CPU, with the toy task's checker (data/toy.py:batch_score):
    python grpo.py --model tiny
"""

import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import common  # first: sets KERAS_BACKEND=jax before keras loads

import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import tyro
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm


@dataclass
class Args:
    # model
    model: str = "tiny"
    """policy init: alias (gemma_2b, …), KerasHub preset, kaggle:// or hf:// handle, local preset / HF dir, or `tiny`"""
    dtype: str | None = None
    """parameter dtype: bfloat16 or float32 (default: bfloat16 on TPU/GPU, float32 on CPU)"""
    lora_rank: int = 0
    """0 = full fine-tuning; >0 = LoRA on the backbone (the reference is then the LoRA-off base)"""
    mesh: str | None = None
    """device mesh, e.g. `data=4,model=2` (default: every device on `data`)"""
    remat: bool = True
    """recompute each decoder block's activations in the backward pass (KV-cached sampling is not affected)"""
    # rewards
    reward_fn: tuple[str, ...] = (os.path.join(common.HERE, "data", "toy.py") + ":batch_score",)
    """one or more `path.py:function`, each f(prompts, responses) -> scores; used when --reward-model is not given"""
    reward_weights: tuple[float, ...] = ()
    """weight of each --reward-fn in the summed reward (default: all 1)"""
    reward_model: str | None = None
    """reward.py's `model/` dir: its score on the last real token is the reward"""
    # data
    dataset: str = os.path.join(common.HERE, "data", "prompts_train.jsonl")
    """prompts (`prompt`: string or message list): .jsonl/.json/.parquet, or a Hugging Face dataset"""
    max_prompt_length: int = 64
    """prompt tokens (BOS included); longer prompts are cut from the left"""
    # rollouts
    num_generations: int = 8
    """G: completions sampled per prompt (one group)"""
    response_length: int = 16
    """new tokens sampled per completion; a completion without EOS by then is `clipped`"""
    temperature: float = 1.0
    """sampling temperature; log-probs are computed from logits / temperature to match"""
    # optimisation
    max_steps: int = 30
    """GRPO iterations (one generation batch each)"""
    batch_size: int = 64
    """completions per generation batch, global (prompts per step = batch_size / G)"""
    num_iterations: int = 1
    """μ: optimisation passes over each generation batch (>1 keeps the rollout log-probs as π_old)"""
    num_mini_batches: int = 1
    """mini-batches per pass (each a whole number of groups is not required: advantages are fixed first)"""
    learning_rate: float = 3e-4
    """AdamW learning rate, constant after warm-up; 3e-4 suits `tiny` from scratch, an SFT'd model wants
    about 3e-5 (TRL's default for real models: 1e-6)"""
    warmup_steps: int = 0
    """linear warm-up, in optimizer updates"""
    max_grad_norm: float = 1.0
    """global gradient-norm clip"""
    seed: int = 0
    """seeds init (tiny), prompt order and sampling"""
    # algorithm
    beta: float = 0.04
    """β: weight of the k3 KL to the reference (DeepSeekMath: 0.04); 0 drops the reference model entirely"""
    epsilon: float = 0.2
    """ε: ratio clip, lower side (and upper side unless --epsilon-high is given)"""
    epsilon_high: float | None = None
    """ε_high: upper ratio clip (DAPO's clip-higher: 0.28); default: --epsilon"""
    scale_rewards: str = "group"
    """advantage scale: `group` (÷ group std, GRPO), `batch` (÷ batch std), `none` (Dr. GRPO: no division)"""
    loss_type: str = "dapo"
    """aggregation: `dapo` (token mean over the batch), `grpo` (per-sequence mean, then batch mean),
    `dr_grpo` (token sum ÷ (batch × response_length)); see docs/grpo.md for why `dapo` is the default"""
    mask_truncated_completions: bool = False
    """leave completions without EOS out of the loss (DAPO's overlong filtering)"""
    # logging and outputs
    output_dir: str | None = None
    """default: runs/grpo__{model}__{seed}__{time}"""
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
# Data: prompts -> left-padded query ids [N, Q]
# ---------------------------------------------------------------------------
CHAT_TEMPLATES = {  # (user turn prefix, assistant turn prefix, turn end) per model family
    "gemma": ("<start_of_turn>user\n", "<start_of_turn>model\n", "<end_of_turn>\n"),
    "llama3": ("<|start_header_id|>user<|end_header_id|>\n\n",
               "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "chatml": ("<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n"),
}


def chat_template(backbone):
    name = type(backbone).__name__.lower()
    return CHAT_TEMPLATES["llama3" if "llama3" in name else "chatml" if "qwen" in name else "gemma"]


def read_rows(path):
    """List of (row, line number) from .jsonl/.json, or via `datasets` for anything else."""
    if path.endswith(".jsonl"):
        rows = []
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append((json.loads(line), i))
                    except json.JSONDecodeError as e:
                        raise common.UsageError(f"{path}:{i}: invalid JSON ({e.msg})")
    elif path.endswith(".json"):
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise common.UsageError(f"{path}:{e.lineno}: invalid JSON ({e.msg})")
        rows = [(r, i) for i, r in enumerate(data if isinstance(data, list) else [data], 1)]
    else:
        try:
            import datasets
        except ImportError:
            raise common.UsageError(f"{path}: parquet files and Hub datasets need `pip install datasets`")
        ds = (datasets.load_dataset("parquet", data_files=path, split="train") if path.endswith(".parquet")
              else datasets.load_from_disk(path) if os.path.isdir(path)
              else datasets.load_dataset(path, split="train"))
        rows = [(r, i) for i, r in enumerate(ds, 1)]
    if not rows:
        raise common.UsageError(f"{path}: no examples")
    return rows


def to_prompt(row, where, template):
    """`prompt` string as is; a message list rendered with the chat template, opening the model turn."""
    value = row.get("prompt") if isinstance(row, dict) else None
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                 for m in value):
        user, model, end = template
        return "".join((model if m.get("role") == "assistant" else user) + m["content"] + end
                       for m in value) + model
    raise common.UsageError(f"{where}: need 'prompt' (a non-empty string or a list of {{role, content}})")


def tokenize_prompts(path, tokenizer, template, max_prompt_length):
    """-> (prompt strings, queries [N, Q] left-padded, query_mask [N, Q]), Q a multiple of 8."""
    rows = read_rows(path)
    prompts = [to_prompt(r, f"{path}:{line}", template) for r, line in rows]
    ids = [[tokenizer.start_token_id] + list(x) for x in tokenizer.tokenize(prompts)]
    ids = [x[:1] + x[1:][-(max_prompt_length - 1):] for x in ids]  # cut from the left, BOS kept
    q = min(max_prompt_length, 8 * math.ceil(max(len(x) for x in ids) / 8))
    queries, mask = np.zeros((len(ids), q), np.int32), np.zeros((len(ids), q), bool)
    for i, x in enumerate(ids):  # left padding: every prompt ends at column Q-1, responses start at Q
        queries[i, q - len(x):], mask[i, q - len(x):] = x, True
    return prompts, queries, mask


def load_reward_fn(spec):
    """`path.py:function` -> the function."""
    path, _, name = spec.rpartition(":")
    if not path or not os.path.exists(path):
        raise common.UsageError(f"--reward-fn {spec!r}: expected an existing `path.py:function`")
    module_spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise common.UsageError(f"--reward-fn {spec!r}: {path} has no function {name!r}")
    return getattr(module, name)


# Copied from reward.py (each script is self-contained): model/ = preset + reward_head.npz.
HEAD_FILE = "reward_head.npz"


def load_reward_model(path, mesh, dtype=None):
    """-> (CausalLM, head {weight [D, 1], bias []}) from a reward.py `model/` directory."""
    if not os.path.exists(os.path.join(path, HEAD_FILE)):
        raise common.UsageError(f"{path}: no {HEAD_FILE} here; expected the model/ dir written by reward.py")
    model = common.load_model(path, mesh, dtype, 0)
    with np.load(os.path.join(path, HEAD_FILE)) as f:
        head = {"weight": jnp.asarray(f["weight"], jnp.float32), "bias": jnp.asarray(f["bias"], jnp.float32)}
    return model, head


# ---------------------------------------------------------------------------
# Rollouts: jitted KV-cached sampling with fixed shapes (compiles once)
# ---------------------------------------------------------------------------
def cached_forward(backbone, token_ids, padding_mask, cache, index):
    """GemmaCausalLM.call_with_cache plus a key padding mask, so left-padded prompts work.

    token_ids [B, t] are written at cache positions index…index+t-1; padding_mask [B, S]
    covers the whole cache, masking the prompts' left padding as attention keys.
    RoPE positions then count the padding too, which changes nothing: RoPE scores
    depend only on the distance between query and key.
    """
    x = backbone.token_embedding(token_ids)
    x = x * jnp.sqrt(jnp.asarray(backbone.hidden_dim, x.dtype))  # Gemma's embedding scale
    caches = []
    for i, layer in enumerate(backbone.transformer_layers):
        x, c = layer(x, padding_mask=padding_mask, cache=cache[:, i], cache_update_index=index)
        caches.append(c)
    logits = backbone.token_embedding(backbone.layer_norm(x), reverse=True).astype(jnp.float32)
    return logits, jnp.stack(caches, 1)  # [B, t, V], [B, L, 2, S, K, H]


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
        cache = jnp.zeros((b, backbone.num_layers, 2, q + response_length, backbone.num_key_value_heads,
                           backbone.head_dim), backbone.compute_dtype)
        logits, cache = cached_forward(backbone, queries, padding_mask, cache, 0)  # prefill

        def step(carry, _):
            logits, cache, index, key = carry
            key, sample_key = jax.random.split(key)
            token = jax.random.categorical(sample_key, logits / temperature).astype(jnp.int32)
            logits, cache = cached_forward(backbone, token[:, None], padding_mask, cache, index)
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


# ---------------------------------------------------------------------------
# Forwards of the policy / reference / reward model on query + response
# ---------------------------------------------------------------------------
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
            logits = backbone.token_embedding(h, reverse=True).astype(jnp.float32) / temperature  # f32
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


# ---------------------------------------------------------------------------
# ALGO LOGIC: group-relative advantages, the k3 KL, the clipped surrogate
# ---------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------
# train_step
# ---------------------------------------------------------------------------
def train_step(backbone, optimizer, state, frozen, batch, context_length, args):
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


def rollout_logps(backbone, params, ref_params, frozen, batch, context_length, temperature):
    """π_old and π_ref log-probs of a finished generation batch ({} entries left out when not needed)."""
    ids, mask = batch["query_responses"], batch["padding_mask"]
    out = {}
    if params is not None:
        out["old_logps"] = response_logps(backbone, params, frozen, ids, mask, context_length, temperature)[0]
    if ref_params is not None:
        out["ref_logps"] = response_logps(backbone, ref_params, frozen, ids, mask, context_length, temperature)[0]
    return out


def resume_or_start(args, checkpoints, output_dir, params, opt_state, key, rng):
    """(params, opt_state, key, first step, RunLog): with --resume, the params, the optimizer state,
    the sampling key and the NumPy generator (mini-batch shuffles) from the newest checkpoint."""
    start = 0
    like = (params, opt_state, jax.random.key_data(key))
    if args.resume and (restored := checkpoints.restore_latest(like)):
        start, (params, opt_state, key_data), meta = restored
        params, opt_state = jax.device_put((params, opt_state), jax.tree.map(lambda x: x.sharding, like[:2]))
        key = jax.random.wrap_key_data(key_data)
        rng.bit_generator.state = meta["rng"]
        print(f"resumed from step {start}")
    log = common.RunLog(output_dir, args, args.track, resume_step=start if args.resume else None)
    return params, opt_state, key, start, log


def check_args(args, mesh):
    """Inconsistent sizes and unknown choices stop before any compute (UsageError)."""
    g, b = args.num_generations, args.batch_size
    if args.num_mini_batches < 1 or args.num_iterations < 1 or args.temperature <= 0:
        raise common.UsageError("--num-mini-batches and --num-iterations must be ≥ 1, --temperature > 0")
    mini = b // args.num_mini_batches
    if g < 2 or b % g:
        raise common.UsageError(f"--batch-size {b} must be a multiple of --num-generations {g} (≥ 2: a group "
                                "of one has no relative advantage)")
    if b % args.num_mini_batches or mini % mesh.shape["data"]:
        raise common.UsageError(f"--batch-size {b} must split into --num-mini-batches {args.num_mini_batches} "
                                f"each divisible by the data axis ({mesh.shape['data']})")
    if args.scale_rewards not in ("group", "batch", "none") or args.loss_type not in ("dapo", "grpo", "dr_grpo"):
        raise common.UsageError("--scale-rewards: group, batch or none; --loss-type: dapo, grpo or dr_grpo")
    if args.reward_weights and len(args.reward_weights) != len(args.reward_fn):
        raise common.UsageError(f"--reward-weights: {len(args.reward_weights)} weights for "
                                f"{len(args.reward_fn)} --reward-fn functions")


def main(args):
    # ---- set-up: mesh, model, data, rewards (all validation before any compute) ----
    common.init_distributed(args.coordinator_address, args.num_processes, args.process_id)
    output_dir = args.output_dir or common.default_output_dir("grpo", args.model, args.seed)
    stop = common.StopSignal()  # before anything is written: a preemption is never lost
    try:
        common.check_output_dir(output_dir, args.resume, args.overwrite)
        mesh = common.make_mesh(args.mesh)
        check_args(args, mesh)
        model = common.load_model(args.model, mesh, args.dtype, args.seed, args.lora_rank)
        backbone, tokenizer = model.backbone, model.preprocessor.tokenizer
        if "gemma" not in type(backbone).__name__.lower():
            raise common.UsageError(f"--model {args.model}: the KV-cached sampler supports Gemma backbones")
        prompts, queries, query_mask = tokenize_prompts(args.dataset, tokenizer, chat_template(backbone),
                                                        args.max_prompt_length)
        reward_fns = [] if args.reward_model else [load_reward_fn(s) for s in args.reward_fn]
        weights = np.asarray(args.reward_weights or [1.0] * max(len(reward_fns), 1), np.float32)  # RM: [1]
        rm = load_reward_model(args.reward_model, mesh, args.dtype) if args.reward_model else None
        if rm is not None and rm[0].preprocessor.tokenizer.vocabulary_size() != tokenizer.vocabulary_size():
            raise common.UsageError(f"--reward-model {args.reward_model}: its tokenizer differs from the policy's "
                                    "(it scores the policy's token ids directly)")
    except (common.UsageError, FileNotFoundError) as e:
        common.fail(e)
    if args.remat:  # calls with a KV cache (the sampler) are left alone
        common.enable_remat(backbone)
    q, r, g, eos, pad = queries.shape[1], args.response_length, args.num_generations, tokenizer.end_token_id, \
        tokenizer.pad_token_id
    n_prompts, mini = args.batch_size // g, args.batch_size // args.num_mini_batches
    print(f"data: {len(prompts)} prompts, queries padded to {q} tokens; {n_prompts} prompts × G={g} completions "
          f"of {r} tokens per step; reward: {args.reward_model or ', '.join(args.reward_fn)}")

    # Policy trainable; reference = frozen copy of its initial values (with LoRA: the zero-init
    # adapters, i.e. the LoRA-off base), only when β > 0.
    params, frozen = common.split_variables(backbone)
    # Through one jit with explicit out_shardings, so the trainable values carry the mesh in their
    # types and are committed to their devices, as the updated ones will be: the sampler then sees
    # identical input types every step (no recompilation, on one device too).
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=common.shardings(params))(params)
    ref_params = jax.tree.map(jnp.copy, params) if args.beta else None
    off_policy = args.num_iterations > 1 or args.num_mini_batches > 1  # π_old differs from π_θ at some update
    schedule = optax.join_schedules([optax.linear_schedule(0.0, args.learning_rate, args.warmup_steps),
                                     optax.constant_schedule(args.learning_rate)], [args.warmup_steps])
    optimizer = optax.chain(optax.clip_by_global_norm(args.max_grad_norm), optax.adamw(schedule))
    opt_state, opt_shardings = common.init_optimizer(optimizer, params, mesh)  # scalars replicated
    key = jax.random.key(args.seed)
    rng = np.random.default_rng(args.seed)
    order = np.concatenate([rng.permutation(len(prompts)) for _ in range(
        -(-args.max_steps * n_prompts // len(prompts)))])
    checkpoints = common.Checkpoints(output_dir)
    params, opt_state, key, start, log = resume_or_start(args, checkpoints, output_dir, params, opt_state, key, rng)
    state = (params, opt_state)

    # Weights go in as arguments (as in ppo.py), so every input of a compiled function shows at its call.
    gen_fn = jax.jit(lambda p, f, qs, qm, k: generate(backbone, p, f, qs, qm, k, r, args.temperature))
    logps_fn = jax.jit(lambda p, rp, f, b: rollout_logps(backbone, p, rp, f, b, q, args.temperature))
    # The updated state keeps the shardings it started with, so the sampler (which takes the
    # params) sees the same input types every step.
    state_shardings = (common.shardings(params), opt_shardings)
    step_fn = jax.jit(lambda s, f, b: train_step(backbone, optimizer, s, f, b, q, args), donate_argnums=0,
                      out_shardings=(state_shardings, common.replicated(mesh)))
    if rm is not None:
        rm_params, rm_frozen = common.split_variables(rm[0].backbone)
        rm_head = jax.tree.map(lambda x: common.put_global(x, common.replicated(mesh)), rm[1])
        rm_weights = (rm_params, rm_frozen, rm_head)
        score_fn = jax.jit(lambda w, ids, m, last: reward_scores(rm[0].backbone, *w, ids, m, last))
    on_data = NamedSharding(mesh, P("data"))  # rollout arrays [B, ...]: batch over `data`
    # Every process samples, scores and updates the same global batch; host arrays go in with
    # put_global and come out whole with to_host (an allgather when there are several processes).

    # FLOPs: 2N per token per forward (sampling; π_old and π_ref when needed; reward model),
    # 6N per token per trained forward+backward (every iteration).
    n = common.count_params(backbone)
    flops_per_seq = (q + r) * (2 * n * (1 + off_policy + (args.beta > 0))
                               + (2 * common.count_params(rm[0].backbone) if rm is not None else 0)
                               + args.num_iterations * 6 * n)
    peak = common.peak_flops()

    # ---- the loop: rollout -> rewards -> advantages -> update ----
    bar = tqdm(range(start, args.max_steps), desc="grpo", dynamic_ncols=True, initial=start, total=args.max_steps)
    for step in bar:
        # rollout: G completions of each of B/G prompts (a group = G consecutive rows), cut after EOS
        t0 = time.perf_counter()
        idx = np.repeat(order[step * n_prompts:(step + 1) * n_prompts], g)  # [B] prompt index per completion
        key, gen_key = jax.random.split(key)
        qs, qm = common.put_global(queries[idx], on_data), common.put_global(query_mask[idx], on_data)
        responses, sequence_lengths = truncate_response(gen_fn(state[0], frozen, qs, qm, gen_key), eos, pad)
        responses.block_until_ready()
        t_generate = time.perf_counter() - t0

        # rewards: one scalar per completion, a weighted sum over the reward functions (or the RM score)
        response_mask = jnp.arange(r)[None] <= sequence_lengths[:, None]  # [B, R]: EOS included
        batch = {"query_responses": jnp.concatenate([qs, responses], 1),
                 "padding_mask": jnp.concatenate([qm, response_mask], 1)}
        host_responses, host_lengths = common.to_host(responses), common.to_host(sequence_lengths)
        has_eos = (host_responses == eos).any(1)
        texts = tokenizer.detokenize([list(x[:k + (x[k] != eos)]) for x, k in zip(host_responses, host_lengths)])
        if rm is not None:
            scores = score_fn(rm_weights, batch["query_responses"], batch["padding_mask"], q + sequence_lengths)
            per_fn = {"reward_model": common.to_host(scores)}
        else:
            per_fn = {f.__name__: np.asarray(f([prompts[i] for i in idx], texts), np.float32) for f in reward_fns}
        rewards = np.sum([w * v for w, v in zip(weights, per_fn.values())], 0)

        # advantages: relative to the other completions of the same prompt
        advantages, group_std = jax.device_get(group_advantages(jnp.asarray(rewards, jnp.float32), g,
                                                                args.scale_rewards))
        if args.mask_truncated_completions:  # DAPO: a cut-off completion is not judged at all
            response_mask = response_mask & common.put_global(has_eos[:, None], on_data)
        batch.update(advantages=common.put_global(advantages, on_data), response_mask=response_mask)
        if off_policy or ref_params is not None:  # else neither π_old nor π_ref needs a forward
            batch.update(logps_fn(state[0] if off_policy else None, ref_params, frozen, batch))
        jax.block_until_ready(batch)
        t_score = time.perf_counter() - t0 - t_generate

        # update: num_iterations passes, each over num_mini_batches shuffled mini-batches
        pending = []
        for _ in range(args.num_iterations):
            perm = rng.permutation(args.batch_size)
            for m in range(args.num_mini_batches):
                mb_idx = common.put_global(perm[m * mini:(m + 1) * mini], on_data)
                state, metrics = step_fn(state, frozen, jax.tree.map(lambda x: x[mb_idx], batch))
                pending.append(metrics)
        fetched = jax.device_get(pending)
        t_update = time.perf_counter() - t0 - t_generate - t_score

        elapsed = time.perf_counter() - t0
        lengths = host_lengths + 1 - has_eos  # completion tokens before the EOS
        row = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]}
        row.update({"reward": float(rewards.mean()), "reward_std": float(np.mean(group_std)),
                    "frac_reward_zero_std": float(np.mean(np.isclose(group_std, 0.0))),
                    **{f"rewards/{k}/mean": float(v.mean()) for k, v in per_fn.items()},
                    **{f"rewards/{k}/std": float(v.std()) for k, v in per_fn.items()},
                    "completions/mean_length": float(lengths.mean()),
                    "completions/min_length": float(lengths.min()), "completions/max_length": float(lengths.max()),
                    "completions/clipped_ratio": float(1.0 - has_eos.mean()),
                    "charts/learning_rate": float(schedule(step * args.num_iterations * args.num_mini_batches)),
                    "charts/generate_tokens_per_sec": args.batch_size * r / t_generate,
                    "charts/generate_time": t_generate, "charts/score_time": t_score, "charts/update_time": t_update,
                    "charts/tokens_per_sec": args.batch_size * (q + r) / elapsed,
                    "charts/mfu": args.batch_size * flops_per_seq / elapsed / peak,
                    "charts/generate_compilations": float(gen_fn._cache_size())})
        if not np.isfinite(row["train/loss"]):
            log.close()
            print(f"error: non-finite train/loss at step {step + 1}; the last good checkpoint is kept "
                  f"(rerun with --resume and a lower --learning-rate)", file=sys.stderr)
            sys.exit(1)
        log.log(step + 1, row)
        bar.set_postfix(reward=f"{row['reward']:.3f}", zero_std=f"{row['frac_reward_zero_std']:.2f}")
        if args.sample_every and (step % args.sample_every == 0 or step + 1 == args.max_steps):
            for i in range(min(4, g)):  # the first group: one prompt, its completions, their advantages
                tqdm.write(f"step {step + 1} sample: {prompts[idx[i]]!r} -> {texts[i]!r} reward {rewards[i]:.3f} "
                           f"advantage {float(advantages[i]):+.2f}")
        stopping = stop.name  # read once, so a signal arriving now is handled at the next step
        if stopping or (args.save_every and (step + 1) % args.save_every == 0):
            checkpoints.save(step + 1, (state[0], state[1], jax.random.key_data(key)),
                             {"step": step + 1, "rng": rng.bit_generator.state})
        if stopping:
            log.close()
            print(f"{stopping}: checkpoint saved at step {step + 1}; continue with --resume")
            return

    # ---- outputs: the policy (LoRA merged) as a KerasHub preset ----
    common.save_model(model, state[0], os.path.join(output_dir, "model"))
    log.close()
    print(f"done: outputs in {output_dir}")


if __name__ == "__main__":
    main(tyro.cli(Args))
