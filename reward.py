"""Reward model: Bradley–Terry loss on preference pairs, scalar head on the last real token.

Ouyang et al. 2022 (InstructGPT) §3.5; data: `prompt` + `chosen` + `rejected` (TRL formats).
    python reward.py --model gemma_2b --dataset my_prefs.jsonl
Offline, a couple of minutes on a laptop CPU (an SFT'd start learns faster: --model runs/sft…/model):
    python reward.py --model tiny
"""

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
from tqdm import tqdm


@dataclass
class Args:
    # model
    model: str = "tiny"
    """alias (gemma_2b, …), KerasHub preset, kaggle:// or hf:// handle, local preset / HF dir, or `tiny`"""
    dtype: str | None = None
    """parameter dtype: bfloat16 or float32 (default: bfloat16 on TPU/GPU, float32 on CPU)"""
    lora_rank: int = 0
    """0 = full fine-tuning; >0 = KerasHub LoRA of this rank on the backbone (the head is always trained)"""
    mesh: str | None = None
    """device mesh, e.g. `data=4,model=2` (default: every device on `data`)"""
    remat: bool = True
    """recompute each decoder block's activations in the backward pass (memory for ~1/3 more FLOPs)"""
    # data
    dataset: str = os.path.join(common.HERE, "data", "prefs_train.jsonl")
    """preference pairs: .jsonl/.json/.parquet, or a Hugging Face dataset id / saved dir"""
    eval_dataset: str | None = os.path.join(common.HERE, "data", "prefs_eval.jsonl")
    """held-out pairs for eval/accuracy (same formats); empty to skip evaluation"""
    max_length: int = 512
    """tokens per sequence (prompt + response); longer prompts are cut from the left, then pairs dropped"""
    # optimisation
    max_steps: int = 80
    """optimizer updates"""
    batch_size: int = 32
    """preference pairs per update, global over all devices and accumulation steps"""
    grad_accum_steps: int = 1
    """micro-batches per update (memory ÷ this; same result)"""
    learning_rate: float = 1e-3
    """peak AdamW learning rate (after linear warmup, cosine decay to 10%)"""
    warmup_steps: int = 10
    """linear warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay (matrices only)"""
    max_grad_norm: float = 1.0
    """global gradient-norm clip"""
    seed: int = 0
    """seeds init (tiny, head), data order"""
    # algorithm
    normalize: bool = False
    """shift the head bias so the training set's chosen responses score mean 0 (stats in reward_head.json)"""
    normalize_samples: int = 512
    """how many training pairs' chosen responses set the normalisation mean"""
    # logging and outputs
    output_dir: str | None = None
    """default: runs/reward__{model}__{seed}__{time}"""
    log_every: int = 10
    """fetch metrics from the device and log every N steps"""
    eval_every: int = 40
    """evaluate every N steps (and at the end)"""
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
# Data: preference rows -> (prompt ids, chosen ids, rejected ids) -> fixed-shape batches
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


def render(value, key, where, template, as_response):
    """A string, or a message list rendered with the chat template (responses end their turn)."""
    if isinstance(value, str) and value.strip():
        return value
    if not (isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in value)):
        raise common.UsageError(f"{where}: field {key!r} must be a non-empty string or a list of "
                                f"{{role, content}} objects, got {value!r:.40}")
    user, model, end = template
    text = "".join((model + m["content"] + end if m.get("role") == "assistant" else user + m["content"] + end)
                   for m in value)
    if as_response and value[-1].get("role") == "assistant":
        text = text[:-1] if text.endswith("\n") else text  # the EOS follows the last turn directly
    if not as_response:
        text += model  # the prompt ends by opening the model's turn
    return text


def to_pair(row, where, template):
    """One row -> (prompt, chosen, rejected) strings; implicit prompt = longest common prefix."""
    if not isinstance(row, dict):
        raise common.UsageError(f"{where}: expected a JSON object")
    for key in ("chosen", "rejected"):
        if key not in row:
            raise common.UsageError(f"{where}: need 'chosen' and 'rejected' (and optionally 'prompt'), "
                                    f"got {sorted(row)}")
    chosen = render(row["chosen"], "chosen", where, template, True)
    rejected = render(row["rejected"], "rejected", where, template, True)
    if "prompt" in row:
        prompt = render(row["prompt"], "prompt", where, template, False)
        if isinstance(row["prompt"], list):  # assistant-only responses after a rendered prompt
            model = template[1]
            chosen, rejected = (s[len(model):] if s.startswith(model) else s for s in (chosen, rejected))
        return prompt, chosen, rejected
    n = len(os.path.commonprefix([chosen, rejected]))
    if n == 0 or n == min(len(chosen), len(rejected)):
        raise common.UsageError(f"{where}: without 'prompt', chosen and rejected must share a prompt "
                                "prefix and then differ")
    return chosen[:n], chosen[n:], rejected[n:]


def tokenize_pairs(path, tokenizer, template, max_length):
    """-> list of (chosen ids, rejected ids), plus counts. Each = [BOS] + prompt + response + [EOS].

    Too long: cut the prompt from the left (BOS kept), then drop the pair if a
    response alone still does not fit.
    """
    rows = read_rows(path)
    triples = [to_pair(r, f"{path}:{line}", template) for r, line in rows]
    ids = iter(tokenizer.tokenize([t for tr in triples for t in tr]))  # one batched call
    bos, eos = tokenizer.start_token_id, tokenizer.end_token_id
    pairs, truncated, dropped = [], 0, 0
    for _ in triples:
        prompt, chosen, rejected = (list(next(ids)) for _ in range(3))
        cut = max(len(chosen), len(rejected)) + 2 + len(prompt) - max_length
        if cut > len(prompt):
            dropped += 1
            continue
        truncated += cut > 0
        prompt = prompt[max(cut, 0):]
        pairs.append(tuple(np.array([bos] + prompt + r + [eos], np.int32) for r in (chosen, rejected)))
    if not pairs:
        raise common.UsageError(f"{path}: every pair is longer than --max-length {max_length}")
    return pairs, {"examples": len(pairs), "truncated": truncated, "dropped": dropped}


def pad_pairs(pairs, length):
    """-> {chosen,rejected}_{token_ids,padding_mask}, each [N, length] (right padding)."""
    out = {}
    for j, side in enumerate(("chosen", "rejected")):
        ids, mask = np.zeros((len(pairs), length), np.int32), np.zeros((len(pairs), length), bool)
        for i, pair in enumerate(pairs):
            ids[i, :len(pair[j])], mask[i, :len(pair[j])] = pair[j], True
        out[f"{side}_token_ids"], out[f"{side}_padding_mask"] = ids, mask
    return out


def get_batch(data, step, batch_size, accum, seed):
    """Batch for `step` of an endless, per-epoch reshuffled stream: [A, B/A/P, T] per process."""
    n = len(data["chosen_token_ids"])
    start = step * batch_size
    idx = np.concatenate([np.random.default_rng([seed, e]).permutation(n)
                          for e in range(start // n, (start + batch_size - 1) // n + 1)])
    idx = idx[start % n:start % n + batch_size]
    per_proc = batch_size // jax.process_count()
    idx = idx[jax.process_index() * per_proc:(jax.process_index() + 1) * per_proc]
    return {k: v[idx].reshape(accum, per_proc // accum, -1) for k, v in data.items()}


# ---------------------------------------------------------------------------
# ALGO LOGIC: the scalar reward r(x, y) and the Bradley–Terry loss
# ---------------------------------------------------------------------------
def init_head(backbone, seed):
    """Scalar head D -> 1 in float32: weight ~ N(0, 1/(D+1)) as in Huang et al.'s
    reference code (small, so initial scores are O(1)), bias 0."""
    d = backbone.hidden_dim
    w = np.random.default_rng(seed).normal(0.0, 1.0 / math.sqrt(d + 1), (d, 1))
    return {"weight": jnp.asarray(w, jnp.float32), "bias": jnp.zeros((), jnp.float32)}


def last_token_hidden(backbone, params, frozen, token_ids, padding_mask):
    """Backbone hidden state at the last real token (the appended EOS), float32: [B, D]."""
    state = zip(backbone.trainable_variables + backbone.non_trainable_variables, params + frozen)
    with keras.StatelessScope(state_mapping=state):
        hidden = backbone({"token_ids": token_ids, "padding_mask": padding_mask})  # [B, T, D]
    last = jnp.sum(padding_mask, -1).astype(jnp.int32) - 1  # right padding: index of the final real token
    return jnp.take_along_axis(hidden, last[:, None, None], 1)[:, 0].astype(jnp.float32)  # f32 upcast


def sequence_scores(backbone, params, frozen, head, token_ids, padding_mask):
    """r(x, y) = w·h_last + b: [B]."""
    h = last_token_hidden(backbone, params, frozen, token_ids, padding_mask)
    return (h @ head["weight"])[:, 0] + head["bias"]


def reward_loss(chosen_scores, rejected_scores):
    """Bradley–Terry: mean of -log σ(r(x,y+) - r(x,y-)) (eq. 1 of docs/reward.md).

    log σ(z) is computed as -softplus(-z): stable for large |z|.
    """
    margins = chosen_scores - rejected_scores
    loss = jnp.mean(jax.nn.softplus(-margins))
    metrics = {"rewards/chosen": chosen_scores.mean(), "rewards/rejected": rejected_scores.mean(),
               "rewards/margins": margins.mean(), "rewards/accuracies": (margins > 0).mean()}
    return loss, metrics


def pair_scores(backbone, params, frozen, head, micro):
    """Chosen and rejected in one forward, concatenated on the batch axis: ([B], [B])."""
    ids = jnp.concatenate([micro["chosen_token_ids"], micro["rejected_token_ids"]])  # [2B, T]
    mask = jnp.concatenate([micro["chosen_padding_mask"], micro["rejected_padding_mask"]])
    scores = sequence_scores(backbone, params, frozen, head, ids, mask)
    return jnp.split(scores, 2)


# ---------------------------------------------------------------------------
# train_step: one optimizer update over `A` accumulated micro-batches
# ---------------------------------------------------------------------------
def train_step(backbone, optimizer, state, frozen, batch):
    """state = ((backbone params, head), opt_state); batch arrays are [A, B/A, T].

    `frozen` (non-trainable weights: the whole base model under LoRA) is an input only,
    never donated, so the Keras variables keep their buffers for saving.
    """
    params, opt_state = state
    accum = batch["chosen_token_ids"].shape[0]

    def micro_loss(p, micro):
        chosen, rejected = pair_scores(backbone, p[0], frozen, p[1], micro)
        loss, metrics = reward_loss(chosen, rejected)
        return loss / accum, metrics  # mean over micro-batches = mean over the whole batch

    def accumulate(grads, micro):
        (loss, metrics), g = jax.value_and_grad(micro_loss, has_aux=True)(params, micro)
        return jax.tree.map(jnp.add, grads, g), (loss, metrics)

    grads, (losses, metrics) = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {k: v.mean() for k, v in metrics.items()}
    metrics.update({"train/loss": losses.sum(), "train/grad_norm": optax.global_norm(grads)})
    return (params, opt_state), metrics


def make_optimizer(args):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.learning_rate, max(args.warmup_steps, 1), max(args.max_steps, args.warmup_steps + 1),
        end_value=0.1 * args.learning_rate)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no decay on norms / biases
    return optax.chain(optax.clip_by_global_norm(args.max_grad_norm),
                       optax.adamw(schedule, weight_decay=args.weight_decay, mask=decay_mask)), schedule


# ---------------------------------------------------------------------------
# Output layout: model/ = KerasHub preset of the CausalLM + reward_head.npz + reward_head.json
# ---------------------------------------------------------------------------
HEAD_FILE, HEAD_INFO = "reward_head.npz", "reward_head.json"


def save_reward_model(model, params, head, info, path):
    common.save_model(model, params, path)
    if jax.process_index() == 0:
        np.savez(os.path.join(path, HEAD_FILE), weight=np.asarray(head["weight"]),
                 bias=np.asarray(head["bias"]))
        with open(os.path.join(path, HEAD_INFO), "w") as f:
            json.dump(info, f, indent=2)


def load_reward_model(path, mesh, dtype=None, lora_rank=0):
    """-> (CausalLM, head {weight [D, 1], bias []}) from a reward.py `model/` directory."""
    if not os.path.exists(os.path.join(path, HEAD_FILE)):
        raise common.UsageError(f"{path}: no {HEAD_FILE} here; expected the model/ dir written by reward.py")
    model = common.load_model(path, mesh, dtype, 0, lora_rank)
    with np.load(os.path.join(path, HEAD_FILE)) as f:
        head = {"weight": jnp.asarray(f["weight"], jnp.float32), "bias": jnp.asarray(f["bias"], jnp.float32)}
    return model, head


def resume_or_start(args, checkpoints, output_dir, params, opt_state):
    """(params incl. the head, opt_state, first step, RunLog): restored from the newest checkpoint
    with --resume (the data position is the step: get_batch is a function of it), else as given."""
    start = 0
    if args.resume and (restored := checkpoints.restore_latest((params, opt_state))):
        start, (params, opt_state), _ = restored
        print(f"resumed from step {start}")
    log = common.RunLog(output_dir, args, args.track, resume_step=start if args.resume else None)
    return params, opt_state, start, log


def main(args):
    # ---- set-up: mesh, model, data (all validation before any compute) ----
    common.init_distributed(args.coordinator_address, args.num_processes, args.process_id)
    output_dir = args.output_dir or common.default_output_dir("reward", args.model, args.seed)
    stop = common.StopSignal()  # before anything is written: a preemption is never lost
    try:
        common.check_output_dir(output_dir, args.resume, args.overwrite)
        mesh = common.make_mesh(args.mesh)
        if args.batch_size % (mesh.shape["data"] * args.grad_accum_steps):
            raise common.UsageError(f"--batch-size {args.batch_size} must divide by data axis "
                                    f"({mesh.shape['data']}) × --grad-accum-steps ({args.grad_accum_steps})")
        model = common.load_model(args.model, mesh, args.dtype, args.seed, args.lora_rank)
        backbone, tokenizer = model.backbone, model.preprocessor.tokenizer
        if args.remat:
            common.enable_remat(backbone)
        template = chat_template(backbone)
        train, counts = tokenize_pairs(args.dataset, tokenizer, template, args.max_length)
        evals = tokenize_pairs(args.eval_dataset, tokenizer, template, args.max_length)[0] if args.eval_dataset else []
    except (common.UsageError, FileNotFoundError) as e:
        common.fail(e)
    print(f"data: {counts['examples']} pairs ({counts['truncated']} prompt-truncated, "
          f"{counts['dropped']} dropped as too long); {len(evals)} eval pairs")
    # One fixed padded length for the whole run: one compilation.
    length = min(args.max_length, 8 * math.ceil(max(len(s) for p in train + evals for s in p) / 8))
    train_data = pad_pairs(train, length)

    optimizer, schedule = make_optimizer(args)
    params, frozen = common.split_variables(backbone)
    params = (params, jax.device_put(init_head(backbone, args.seed), common.replicated(mesh)))
    checkpoints = common.Checkpoints(output_dir)
    opt_state, opt_shardings = common.init_optimizer(optimizer, params, mesh)
    params, opt_state, start, log = resume_or_start(args, checkpoints, output_dir, params, opt_state)
    # Layouts pinned in and out (donated, updated in place): one compilation for the run.
    state_shardings = (common.shardings(params), opt_shardings)
    state = jax.device_put((params, opt_state), state_shardings)
    step_fn = jax.jit(lambda s, f, b: train_step(backbone, optimizer, s, f, b), donate_argnums=0,
                      out_shardings=(state_shardings, common.replicated(mesh)))
    score_fn = jax.jit(lambda p, f, h, ids, m: sequence_scores(backbone, p, f, h, ids, m))

    # FLOPs per token: 6N (forward + backward) on chosen and rejected tokens alike.
    flops_per_token = 6 * common.count_params(backbone)
    peak = common.peak_flops()

    def scores_of(params, ids_list):
        """Scores of many token sequences, in full batches (the last one padded): one shape."""
        bs, data = args.batch_size, pad_pairs([(s, s) for s in ids_list], length)
        out = []
        for i in range(0, len(ids_list), bs):
            ids, mask = data["chosen_token_ids"][i:i + bs], data["chosen_padding_mask"][i:i + bs]
            n = len(ids)
            ids, mask = np.pad(ids, ((0, bs - n), (0, 0))), np.pad(mask, ((0, bs - n), (0, 0)), constant_values=1)
            batch = common.shard_batch(mesh, {"ids": ids[None], "mask": mask[None]})
            out.append(np.asarray(score_fn(params[0], frozen, params[1], batch["ids"][0], batch["mask"][0]))[:n])
        return np.concatenate(out)

    def evaluate(params):
        chosen, rejected = scores_of(params, [c for c, _ in evals]), scores_of(params, [r for _, r in evals])
        return {"eval/accuracy": float(np.mean(chosen > rejected)),
                "eval/margins": float(np.mean(chosen - rejected))}

    def flush(step, pending, t0, tokens):
        """Fetch the interval's metrics (one host sync), stop on a non-finite loss, log."""
        fetched = jax.device_get(pending)
        elapsed = time.perf_counter() - t0  # after the fetch: dispatch is asynchronous
        bad = [step - len(fetched) + 1 + i for i, m in enumerate(fetched) if not np.isfinite(m["train/loss"])]
        if bad:
            log.close()
            print(f"error: non-finite train/loss at step {bad[0]}; the last good checkpoint is kept "
                  f"(rerun with --resume and a lower --learning-rate)", file=sys.stderr)
            sys.exit(1)
        row = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]}
        row.update({"charts/learning_rate": float(schedule(step - 1)),
                    "charts/tokens_per_sec": tokens / elapsed,
                    "charts/mfu": tokens / elapsed * flops_per_token / peak})
        log.log(step, row)
        bar.set_postfix(loss=f"{row['train/loss']:.4f}", acc=f"{row['rewards/accuracies']:.2f}")

    # ---- the loop ----
    pending, t0, tokens = [], time.perf_counter(), 0
    bar = tqdm(range(start, args.max_steps), desc="reward", dynamic_ncols=True, initial=start,
               total=args.max_steps)
    for step in bar:
        batch = common.shard_batch(mesh, get_batch(train_data, step, args.batch_size,
                                                   args.grad_accum_steps, args.seed))
        state, metrics = step_fn(state, frozen, batch)
        pending.append(metrics)
        tokens += 2 * args.batch_size * length
        done = step + 1
        stopping = stop.name  # read once: a signal during this step's flush is handled at the next one
        saving = stopping or (args.save_every and done % args.save_every == 0)
        if done % args.log_every == 0 or done == args.max_steps or saving:
            flush(done, pending, t0, tokens)
            pending, t0, tokens = [], time.perf_counter(), 0
        if evals and (done % args.eval_every == 0 or done == args.max_steps):
            row = evaluate(state[0])
            log.log(done, row)
            print(f"step {done}: eval/accuracy {row['eval/accuracy']:.3f}")
            t0 = time.perf_counter()  # eval time is not training throughput
        if saving:
            checkpoints.save(done, state, {"step": done})  # params incl. head, optimizer state
        if stopping:
            log.close()
            print(f"{stopping}: checkpoint saved at step {done}; continue with --resume")
            return

    # ---- outputs: normalised head (optional), backbone preset + head ----
    (params, head), info = state[0], {"normalized": args.normalize}
    if args.normalize:  # reference set: chosen responses of the first N training pairs
        ref = scores_of(state[0], [c for c, _ in train[:args.normalize_samples]])
        head = {"weight": head["weight"], "bias": head["bias"] - float(ref.mean())}
        info.update({"reference_set": f"chosen responses of the first {len(ref)} pairs of {args.dataset}",
                     "mean_before": float(ref.mean()), "std": float(ref.std())})
    save_reward_model(model, params, head, info, os.path.join(output_dir, "model"))
    log.close()
    print(f"done: outputs in {output_dir}")


if __name__ == "__main__":
    main(tyro.cli(Args))
