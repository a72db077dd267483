"""Supervised fine-tuning (SFT): next-token NLL on completions / assistant turns.

Data: `text`, `prompt` + `completion`, or chat `messages` (TRL formats).
    python sft.py --model gemma_2b --dataset my_data.jsonl
Offline, a couple of minutes on a laptop CPU:
    python sft.py --model tiny
"""

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from functools import partial

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
    """0 = full fine-tuning; >0 = KerasHub LoRA of this rank on the backbone"""
    mesh: str | None = None
    """device mesh, e.g. `data=4,model=2` (default: every device on `data`)"""
    remat: bool = True
    """recompute each decoder block's activations in the backward pass (memory for ~1/3 more FLOPs)"""
    # data
    dataset: str = os.path.join(common.HERE, "data", "sft_train.jsonl")
    """training data: .jsonl/.json/.parquet, or a Hugging Face dataset id / saved dir"""
    eval_dataset: str | None = os.path.join(common.HERE, "data", "sft_eval.jsonl")
    """held-out data for eval/loss (same formats); empty to skip evaluation"""
    max_length: int = 512
    """tokens per example; longer prompts are cut from the left, then whole examples dropped"""
    completion_only_loss: bool = True
    """loss on completion / assistant tokens only; False also trains on the prompt"""
    # optimisation
    max_steps: int = 200
    """optimizer updates"""
    batch_size: int = 32
    """examples per update, global over all devices and accumulation steps"""
    grad_accum_steps: int = 1
    """micro-batches per update (memory ÷ this; same result)"""
    learning_rate: float = 1e-3
    """peak AdamW learning rate (after linear warmup, cosine decay to 10%)"""
    warmup_steps: int = 20
    """linear warmup steps"""
    weight_decay: float = 0.0
    """AdamW weight decay (matrices only)"""
    max_grad_norm: float = 1.0
    """global gradient-norm clip"""
    seed: int = 0
    """seeds init (tiny), data order and sampling"""
    # logging and outputs
    output_dir: str | None = None
    """default: runs/sft__{model}__{seed}__{time}"""
    log_every: int = 10
    """fetch metrics from the device and log every N steps"""
    eval_every: int = 50
    """evaluate every N steps (and at the end)"""
    save_every: int = 0
    """checkpoint every N steps (0: only on SIGTERM/SIGINT); the newest 3 are kept"""
    resume: bool = False
    """continue from the newest complete checkpoint in --output-dir"""
    overwrite: bool = False
    """replace a run already in --output-dir (otherwise refused)"""
    skip_nonfinite: bool = False
    """skip (and count) updates whose loss or gradient is not finite, instead of stopping"""
    num_samples: int = 4
    """greedy generations from eval prompts printed at the end"""
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
# Data: rows -> (token ids, loss mask) -> fixed-shape batches
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


def to_segments(row, where, template):
    """One row -> [(text, is_completion)] in order; validates field names and types."""
    def text(key):
        v = row.get(key)
        if not isinstance(v, str) or not v.strip():
            raise common.UsageError(f"{where}: field {key!r} must be a non-empty string, got {v!r:.40}")
        return v

    if not isinstance(row, dict):
        raise common.UsageError(f"{where}: expected a JSON object")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
            raise common.UsageError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        user, model, end = template
        segments = []
        for m in msgs:  # system turns are folded into the user prefix, as Gemma's template does
            if m.get("role") == "assistant":
                segments += [(model, False), (m["content"] + end.strip("\n"), True), ("\n", False)]
            else:
                segments.append((user + m["content"] + end, False))
        return segments[:-1]  # the EOS follows the last assistant turn directly
    if "prompt" in row or "completion" in row:
        return [(text("prompt"), False), (text("completion"), True)]
    if "text" in row:
        return [(text("text"), True)]
    raise common.UsageError(f"{where}: need 'text', 'prompt'+'completion' or 'messages' (got {sorted(row)})")


def tokenize_dataset(path, tokenizer, template, max_length, completion_only_loss):
    """-> list of (ids, mask), plus counts. ids = [BOS] + segments + [EOS].

    EOS is appended (and trained on) so the model learns to stop. Too long:
    cut the prompt from the left (BOS kept), then drop what still does not fit.
    """
    rows = read_rows(path)
    segs = [to_segments(r, f"{path}:{line}", template) for r, line in rows]
    flat = [t for s in segs for t, _ in s]
    ids_flat = iter(tokenizer.tokenize(flat))  # one batched call: fast
    examples, truncated, dropped = [], 0, 0
    for s in segs:
        ids, mask = [], []
        for _, is_completion in s:
            piece = list(next(ids_flat))
            ids += piece
            mask += [is_completion or not completion_only_loss] * len(piece)
        ids, mask = [tokenizer.start_token_id] + ids + [tokenizer.end_token_id], [False] + mask + [True]
        if len(ids) > max_length:
            first = mask.index(True)  # cut prompt tokens right after BOS
            cut = len(ids) - max_length
            if cut > first - 1:
                dropped += 1
                continue
            ids, mask = ids[:1] + ids[1 + cut:], mask[:1] + mask[1 + cut:]
            truncated += 1
        examples.append((np.array(ids, np.int32), np.array(mask, bool)))
    if not examples:
        raise common.UsageError(f"{path}: every example is longer than --max-length {max_length}")
    return examples, {"examples": len(examples), "truncated": truncated, "dropped": dropped}


def pad_examples(examples, length):
    """-> token_ids, padding_mask, loss_mask, each [N, length] (right padding)."""
    n = len(examples)
    token_ids = np.zeros((n, length), np.int32)
    loss_mask = np.zeros((n, length), bool)
    padding_mask = np.zeros((n, length), bool)
    for i, (ids, mask) in enumerate(examples):
        token_ids[i, :len(ids)], loss_mask[i, :len(ids)], padding_mask[i, :len(ids)] = ids, mask, True
    return {"token_ids": token_ids, "padding_mask": padding_mask, "loss_mask": loss_mask}


def get_batch(data, step, batch_size, accum, seed):
    """Batch for `step` of an endless, per-epoch reshuffled stream: [A, B/A/P, T] per process.

    A pure function of the step, so a resumed run sees exactly the same data order.
    """
    n = len(data["token_ids"])
    start = step * batch_size
    idx = np.concatenate([np.random.default_rng([seed, e]).permutation(n)
                          for e in range(start // n, (start + batch_size - 1) // n + 1)])
    idx = idx[start % n:start % n + batch_size]
    per_proc = batch_size // jax.process_count()
    idx = idx[jax.process_index() * per_proc:(jax.process_index() + 1) * per_proc]
    return {k: v[idx].reshape(accum, per_proc // accum, -1) for k, v in data.items()}


# ---------------------------------------------------------------------------
# ALGO LOGIC: per-token log-probs and the SFT loss
# ---------------------------------------------------------------------------
def token_logps(backbone, params, frozen, token_ids, padding_mask, chunk=128):
    """log p(token[t+1] | tokens[≤t]) in float32: [B, T-1].

    The [B, T, V] logits are never materialised: the unembedding runs over
    sequence chunks of `chunk` tokens under `jax.checkpoint`, so only one
    [B, chunk, V] float32 block is alive at a time, forward and backward.
    """
    state = zip(backbone.trainable_variables + backbone.non_trainable_variables, params + frozen)
    with keras.StatelessScope(state_mapping=state):
        hidden = backbone({"token_ids": token_ids, "padding_mask": padding_mask})  # [B, T, D]
        hidden, labels = hidden[:, :-1], token_ids[:, 1:]  # logits at t predict token t+1
        b, t, d = hidden.shape
        n = -(-t // chunk)
        hidden = jnp.pad(hidden, ((0, 0), (0, n * chunk - t), (0, 0))).reshape(b, n, chunk, d)
        labels = jnp.pad(labels, ((0, 0), (0, n * chunk - t))).reshape(b, n, chunk)

        @jax.checkpoint
        def chunk_logps(h, y):  # [B, C, D], [B, C] -> [B, C]
            logits = backbone.token_embedding(h, reverse=True).astype(jnp.float32)  # f32 upcast
            return jnp.take_along_axis(logits, y[..., None], -1)[..., 0] - jax.nn.logsumexp(logits, -1)

        logps = jax.lax.map(lambda hy: chunk_logps(*hy), (hidden.swapaxes(0, 1), labels.swapaxes(0, 1)))
    return logps.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]  # [B, T-1]


def sft_loss(logps, loss_mask, num_loss_tokens):
    """Summed NLL over loss tokens ÷ the loss-token count of the whole update.

    `loss_mask` is aligned with the tokens; shifting it by one aligns it with
    `logps` (position t scores token t+1). Dividing by the count of the whole
    accumulated batch makes the loss a true token mean however it is split.
    """
    mask = loss_mask[:, 1:]  # [B, T-1]: is token t+1 a loss token
    nll = -jnp.sum(jnp.where(mask, logps, 0.0))
    return nll / num_loss_tokens, {"nll_sum": nll, "num_tokens": mask.sum()}


# ---------------------------------------------------------------------------
# train_step: one optimizer update over `A` accumulated micro-batches
# ---------------------------------------------------------------------------
def train_step(backbone, optimizer, state, frozen, batch, skip_nonfinite=False):
    """state = (params, opt_state); batch arrays are [A, B/A, T].

    `frozen` (non-trainable weights: the whole base model under LoRA) is an input only,
    never donated, so the Keras variables keep their buffers for saving.
    """
    params, opt_state = state
    num_loss_tokens = jnp.maximum(batch["loss_mask"][:, :, 1:].sum(), 1)

    def micro_loss(p, micro):
        logps = token_logps(backbone, p, frozen, micro["token_ids"], micro["padding_mask"])
        return sft_loss(logps, micro["loss_mask"], num_loss_tokens)

    def accumulate(grads, micro):
        (loss, _), g = jax.value_and_grad(micro_loss, has_aux=True)(params, micro)
        return jax.tree.map(jnp.add, grads, g), loss

    grads, losses = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), batch)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    loss, grad_norm = losses.sum(), optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if skip_nonfinite:  # keep the old weights and optimizer state for a non-finite batch
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_params, new_opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
    metrics = {"train/loss": loss, "train/grad_norm": grad_norm, "train/num_loss_tokens": num_loss_tokens,
               "train/skipped_nonfinite": 1.0 - finite}
    return (new_params, new_opt_state), metrics


def eval_loss(backbone, params, frozen, batch):
    """Token-mean NLL of one eval batch: (nll sum, token count) to be summed over batches."""
    logps = token_logps(backbone, params, frozen, batch["token_ids"][0], batch["padding_mask"][0])
    _, aux = sft_loss(logps, batch["loss_mask"][0], 1)
    return aux["nll_sum"], aux["num_tokens"]


def make_optimizer(args):
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.learning_rate, max(args.warmup_steps, 1), max(args.max_steps, args.warmup_steps + 1),
        end_value=0.1 * args.learning_rate)
    decay_mask = lambda params: [p.ndim >= 2 for p in params]  # no decay on norms / biases
    return optax.chain(optax.clip_by_global_norm(args.max_grad_norm),
                       optax.adamw(schedule, weight_decay=args.weight_decay, mask=decay_mask)), schedule


def main(args):
    # ---- set-up: mesh, model, data (all validation before any compute) ----
    common.init_distributed(args.coordinator_address, args.num_processes, args.process_id)
    output_dir = args.output_dir or common.default_output_dir("sft", args.model, args.seed)
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
        train, counts = tokenize_dataset(args.dataset, tokenizer, template, args.max_length,
                                         args.completion_only_loss)
        evals = (tokenize_dataset(args.eval_dataset, tokenizer, template, args.max_length,
                                  args.completion_only_loss)[0] if args.eval_dataset else [])
    except (common.UsageError, FileNotFoundError) as e:
        common.fail(e)
    print(f"data: {counts['examples']} examples ({counts['truncated']} prompt-truncated, "
          f"{counts['dropped']} dropped as too long); {len(evals)} eval examples")
    # One fixed padded length for the whole run: one compilation.
    length = min(args.max_length, 8 * math.ceil(max(len(x[0]) for x in train + evals) / 8))
    train_data, eval_data = pad_examples(train, length), pad_examples(evals, length) if evals else None

    optimizer, schedule = make_optimizer(args)
    params, frozen = common.split_variables(backbone)
    opt_state, opt_shardings = common.init_optimizer(optimizer, params, mesh)
    checkpoints, start = common.Checkpoints(output_dir), 0
    if args.resume and (restored := checkpoints.restore_latest((params, opt_state))):
        start, (params, opt_state), _ = restored  # data position = step (get_batch is a function of it)
        print(f"resumed from step {start}")
    state_shardings = (common.shardings(params), opt_shardings)
    state = jax.device_put((params, opt_state), state_shardings)
    log = common.RunLog(output_dir, args, args.track, resume_step=start if args.resume else None)
    # Layouts pinned in and out (donated, updated in place): one compilation for the run.
    step_fn = jax.jit(partial(train_step, backbone, optimizer, skip_nonfinite=args.skip_nonfinite),
                      donate_argnums=0, out_shardings=(state_shardings, common.replicated(mesh)))
    eval_fn = jax.jit(partial(eval_loss, backbone))

    # FLOPs per token: 6N (forward + backward), N = all matmul weights incl. embedding.
    flops_per_token = 6 * common.count_params(backbone)
    peak = common.peak_flops()

    def evaluate(params):
        nll, n = 0.0, 0
        bs = args.batch_size
        for i in range(0, len(eval_data["token_ids"]) - bs + 1, bs):  # full batches only: one shape
            batch = common.shard_batch(mesh, {k: v[None, i:i + bs] for k, v in eval_data.items()})
            s, c = eval_fn(params, frozen, batch)
            nll, n = nll + float(s), n + int(c)
        return nll / max(n, 1)

    def flush(step, pending, t0, tokens):
        """Fetch the interval's metrics (one host sync), stop on a non-finite loss, log."""
        fetched = jax.device_get(pending)
        elapsed = time.perf_counter() - t0  # after the fetch: dispatch is asynchronous
        row = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]}
        row["train/skipped_nonfinite"] *= len(fetched)  # a count per interval, not a mean
        bad = [step - len(fetched) + 1 + i for i, m in enumerate(fetched) if not np.isfinite(m["train/loss"])]
        if bad and not args.skip_nonfinite:
            log.close()
            print(f"error: non-finite train/loss at step {bad[0]}; the last good checkpoint is kept "
                  f"(rerun with --resume and a lower --learning-rate, or --skip-nonfinite)", file=sys.stderr)
            sys.exit(1)
        row.update({"charts/learning_rate": float(schedule(step - 1)),
                    "charts/tokens_per_sec": tokens / elapsed,
                    "charts/mfu": tokens / elapsed * flops_per_token / peak})
        log.log(step, row)
        bar.set_postfix(loss=f"{row['train/loss']:.4f}", tok_s=f"{row['charts/tokens_per_sec']:.0f}")

    # ---- the loop ----
    if eval_data is not None and start == 0:
        log.log(0, {"eval/loss": evaluate(state[0])})  # the starting point, before any update
    pending, t0, tokens = [], time.perf_counter(), 0
    bar = tqdm(range(start, args.max_steps), desc="sft", dynamic_ncols=True, initial=start, total=args.max_steps)
    for step in bar:
        batch = common.shard_batch(mesh, get_batch(train_data, step, args.batch_size,
                                                   args.grad_accum_steps, args.seed))
        state, metrics = step_fn(state, frozen, batch)
        pending.append(metrics)
        tokens += args.batch_size * length
        done = step + 1
        stopping = stop.name  # read once: a signal arriving later in this step is handled at the next
        saving = stopping or (args.save_every and done % args.save_every == 0)
        if done % args.log_every == 0 or done == args.max_steps or saving:
            flush(done, pending, t0, tokens)
            pending, t0, tokens = [], time.perf_counter(), 0
        if eval_data is not None and (done % args.eval_every == 0 or done == args.max_steps):
            log.log(done, {"eval/loss": evaluate(state[0])})
            t0 = time.perf_counter()  # eval time is not training throughput
        if saving:
            checkpoints.save(done, state, {"step": done})
        if stopping:
            log.close()
            print(f"{stopping}: checkpoint saved at step {done}; continue with --resume")
            return

    # ---- outputs: final model (LoRA merged) and a few samples ----
    common.save_model(model, state[0], os.path.join(output_dir, "model"))
    log.close()
    if args.num_samples and evals:
        rows = read_rows(args.eval_dataset)[:args.num_samples]
        prompts = [r.get("prompt") or "".join(t for t, c in to_segments(r, "", template) if not c)
                   for r, _ in rows]
        for p, out in zip(prompts, model.generate(prompts, max_length=length, strip_prompt=True)):
            print(f"sample: {p!r} -> {out!r}")
    print(f"done: outputs in {output_dir}")


if __name__ == "__main__":
    main(tyro.cli(Args))
