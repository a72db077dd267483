r"""Supervised fine-tuning (SFT): next-token NLL on completions / assistant turns.

Data: `text`, `prompt` + `completion`, or chat `messages` (TRL formats).
    python sft.py --model gemma_2b --dataset my_data.jsonl
Offline, minutes on a laptop CPU (the defaults are for real models; `tiny` from scratch takes its own):
    python sft.py --model tiny --max-steps 200 --batch-size 32 --learning-rate 1e-3 \
        --warmup-steps 20 --max-length 512
"""

import os
from dataclasses import dataclass
from functools import partial

import plumbing  # the run shell: shared flags, Run, the exit boundary (instant to import)

# `python sft.py --help`: from Args' source, before the imports below
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (mesh, models, data files, batches)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


@dataclass
class Args(plumbing.SharedArgs):
    """The shared flags (plumbing.SharedArgs: model, dtype, mesh, outputs, …) and SFT's own."""

    # data
    dataset: str = os.path.join(common.HERE, "data", "sft_train.jsonl")
    """training data: .jsonl/.json/.parquet, or a Hugging Face dataset id / saved dir"""
    eval_dataset: str | None = os.path.join(common.HERE, "data", "sft_eval.jsonl")
    """held-out data for eval/loss (same formats); empty to skip evaluation; the bundled
    file is used only with the bundled --dataset"""
    eval_split: str | None = None
    """evaluate on this split (e.g. `test`) of --dataset, or of --eval-dataset if given (TRL's dataset_test_split)"""
    max_length: int = 1024
    """tokens per example (TRL SFTConfig: 1024); longer prompts are cut from the left, then whole examples dropped"""
    packing: bool = False
    """several examples a row of --max-length (TRL's packing, best fit; --batch-size counts rows): none sees
    another's tokens, positions restart at each, the loss the same token mean; no padding paid for"""
    group_by_length: bool = False
    """batches of similar lengths (less padding): each window of 50 batches is sorted by length and dealt
    out in a seeded order (TRL/HF group_by_length)"""
    completion_only_loss: bool = True
    """loss on completion / assistant tokens only; False also trains on the prompt"""
    # optimisation
    learning_rate: float = 2e-5
    """peak AdamW learning rate (TRL SFTConfig: 2e-5)"""
    grad_accum_steps: int = 1
    """micro-batches per update (memory ÷ this; same result)"""
    skip_nonfinite: bool = False
    """skip (and count) updates whose loss or gradient is not finite, instead of stopping"""
    # logging and outputs
    export_hf: bool = False
    """also write the final model as a Hugging Face checkpoint, tokenizer and chat template in <output-dir>/model_hf/"""
    log_every: int = 10
    """fetch metrics from the device and log every N steps"""
    eval_every: int = 50
    """evaluate every N steps (and at the end)"""
    num_samples: int = 4
    """greedy generations printed at the end: from eval prompts, else from training prompts (marked)"""
    print_example: int = 0
    """print the first N rows of --dataset as the model trains on them (the text the chat template renders,
    the trained parts in [[ ]]; each token `id:piece`, `*` where the loss covers it) and exit, training nothing"""


# ---------------------------------------------------------------------------
# Data: rows (common.read_dataset: TRL formats -> text segments) -> (token ids, loss mask) -> batches
# ---------------------------------------------------------------------------
def tokenize_dataset(segs, tokenizer, max_length, completion_only_loss, path):
    """[(text, is_completion)] per example -> list of (ids, mask), plus counts.

    ids = [BOS] + segments + [EOS]. EOS is appended (and trained on) so the model
    learns to stop. Too long: cut the prompt from the left (BOS kept), then drop what
    still does not fit.
    """
    # differs from dpo.py's: segments (text, is_completion) of one sequence, the loss on completions by flag
    flat = [t for s in segs for t, _ in s]
    ids_flat = iter(tokenizer.tokenize(flat))  # one batched call: fast
    examples = []
    truncated = 0
    dropped = 0
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
            ids, mask = ids[:1] + ids[1 + cut :], mask[:1] + mask[1 + cut :]
            truncated += 1
        examples.append((np.array(ids, np.int32), np.array(mask, bool)))
    if not examples:
        raise common.UsageError(f"{path}: every example is longer than --max-length {max_length}")
    return examples, {"examples": len(examples), "truncated": truncated, "dropped": dropped}


def print_examples(rows, tokenizer, args):
    """--print-example N: each row's segments rendered (trained text in [[ ]]) and tokenised as training is."""
    for i, segs in enumerate(rows):
        ((ids, mask),), _ = tokenize_dataset(
            [segs], tokenizer, args.max_length, args.completion_only_loss, f"{args.dataset} row {i + 1}"
        )
        pieces = " ".join(
            f"{t}{'*' if m else ''}:{tokenizer.id_to_token(int(t))!r}" for t, m in zip(ids, mask)
        )
        print(
            f"--- row {i + 1}: {len(ids)} tokens, {mask.sum()} trained (* below)\n"
            + "".join(f"[[{t}]]" if trained else t for t, trained in segs)
            + f"\n{pieces}"
        )


def pad_examples(examples, length):
    """-> token_ids, padding_mask, loss_mask, each [N, length] (right padding). Packed rows (ids, mask,
    segment ids): padding_mask holds the segment ids (1, 2, … an example, 0 padding), which the forward reads."""
    # differs from dpo.py's: one sequence per example, or a packed row
    n = len(examples)
    token_ids = np.zeros((n, length), np.int32)
    loss_mask = np.zeros((n, length), bool)
    padding_mask = np.zeros((n, length), np.int32 if len(examples[0]) == 3 else bool)
    for i, (ids, mask, *segments) in enumerate(examples):
        token_ids[i, : len(ids)] = ids
        loss_mask[i, : len(ids)] = mask
        padding_mask[i, : len(ids)] = segments[0] if segments else True
    return {"token_ids": token_ids, "padding_mask": padding_mask, "loss_mask": loss_mask}


def get_batch(data, lengths, step, args):
    """Batch for `step` (a pure function of it, so --resume is exact), cut to the length bucket of
    its longest example: [A, B/A/P, T] per process; and its (real, padded) tokens over all processes."""
    # differs from simpo.py's: one sequence per example, so the padded tokens are B × T, not 2 × B × T
    idx, length, real = common.length_batch(
        lengths, step, args.batch_size, args.seed, args.max_length, group=args.group_by_length
    )
    batch = {k: v[idx, :length].reshape(args.grad_accum_steps, -1, length) for k, v in data.items()}
    return batch, (real, args.batch_size * length)


# ---------------------------------------------------------------------------
# ALGO LOGIC: per-token log-probs and the SFT loss
# ---------------------------------------------------------------------------
def token_logps(backbone, params, frozen, token_ids, padding_mask):
    """log p(token[t+1] | tokens[≤t]) in float32: [B, T-1]; and the forward's aux_loss (a mixture of
    experts' router load-balancing loss, common.forward; 0.0 for a dense model).

    The [B, T, V] logits are never materialised: common.token_logps projects --logits-chunk
    positions at a time under jax.checkpoint, so one [B, chunk, V] float32 block is alive at
    a time, forward and backward.
    """
    hidden, aux_loss = common.forward(backbone, params, frozen, token_ids, padding_mask)  # [B, T, D], scalar
    with common.weights(backbone, params, frozen):  # the output layer's weights, from `params`
        logps = common.token_logps(backbone, hidden[:, :-1], token_ids[:, 1:])  # logits at t predict t+1
    return logps, aux_loss  # [B, T-1], scalar  # [B, T-1], scalar


def sft_loss(logps, loss_mask, num_loss_tokens):
    """Summed NLL over loss tokens ÷ the loss-token count of the whole update.

    `loss_mask` is aligned with the tokens; shifting it by one aligns it with
    `logps` (position t scores token t+1). Dividing by the count of the whole
    accumulated batch makes the loss a true token mean however it is split.
    """
    mask = loss_mask[:, 1:]  # [B, T-1]: is token t+1 a loss token
    nll = -jnp.sum(jnp.where(mask, logps, 0.0))
    return nll / num_loss_tokens, {"nll_sum": nll, "num_tokens": mask.sum()}


def compute_loss(backbone, params, frozen, batch, num_loss_tokens):
    """This run's loss on a batch [B, T] -> (loss, the forward's aux_loss): sft_loss over its loss tokens ÷
    num_loss_tokens, the count of a whole update (the training step sums its micro-batches') or of the whole
    eval set (the evaluation sums its batches'). Both call it, so a term added here is trained and evaluated
    alike."""
    logps, aux_loss = token_logps(backbone, params, frozen, batch["token_ids"], batch["padding_mask"])
    return sft_loss(logps, batch["loss_mask"], num_loss_tokens)[0], aux_loss


# ---------------------------------------------------------------------------
# train_step: one optimizer update over `A` accumulated micro-batches
# ---------------------------------------------------------------------------
def train_step(backbone, optimizer, args, state, frozen, batch):
    """state = (params, opt_state); batch arrays are [A, B/A, T].

    `frozen` (non-trainable weights: the whole base model under LoRA) is an input only,
    never donated, so the Keras variables keep their buffers for saving.
    """
    params, opt_state = state
    accum = batch["token_ids"].shape[0]
    num_loss_tokens = jnp.maximum(batch["loss_mask"][:, :, 1:].sum(), 1)

    def micro_loss(p, micro):
        loss, aux_loss = compute_loss(backbone, p, frozen, micro, num_loss_tokens)
        # + the router load-balancing loss (a mixture of experts; 0.0 dense), per forward: ÷ A, its mean
        return loss + aux_loss / accum, aux_loss

    def accumulate(grads, micro):
        (loss, aux_loss), g = jax.value_and_grad(micro_loss, has_aux=True)(params, micro)
        return jax.tree.map(jnp.add, grads, g), (loss, aux_loss)

    grads, (losses, aux_losses) = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), batch)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    loss = losses.sum()
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if args.skip_nonfinite:  # keep the old weights and optimizer state for a non-finite batch
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_params, new_opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
    metrics = {
        "train/loss": loss,
        "train/grad_norm": grad_norm,
        "train/num_loss_tokens": num_loss_tokens,
        "train/skipped_nonfinite": 1.0 - finite,
        "aux_loss": aux_losses.mean(),
    }
    return (new_params, new_opt_state), metrics


def sample_prompt(segments):
    """A row's text up to its last answer, the earlier answers of a chat included: what a sample continues."""
    last = max(i for i, (_, is_completion) in enumerate(segments) if is_completion)
    return "".join(text for text, _ in segments[:last])


def main(args):
    # ---- set-up: every flag, file and row checked before the model loads ----
    # nothing written yet
    run = plumbing.Run(
        __file__,
        args,
        log_every=args.log_every,
        eval_every=args.eval_every,
        grad_accum_steps=args.grad_accum_steps,
        export_hf=args.export_hf,
        skip_nonfinite=args.skip_nonfinite,
    )
    template = common.chat_template(args.model, args.chat_template)
    eval_path, eval_split, eval_flag = common.eval_source(
        args.dataset, args.eval_dataset, args.eval_split, (Args.dataset, Args.eval_dataset)
    )
    eval_rows = (
        common.read_dataset(
            eval_path, "sft", template, flag=eval_flag, config=args.dataset_config, split=eval_split
        )
        if eval_path
        else []
    )
    train_rows = common.read_dataset(
        args.dataset, "sft", template, config=args.dataset_config, split=args.dataset_split
    )
    if args.print_example:  # the rows as the model sees them, and no run
        model = common.load_model(args.model, run.mesh, run.dtype, args.seed)
        return print_examples(train_rows[: args.print_example], model.preprocessor.tokenizer, args)
    model = common.load_model(
        args.model, run.mesh, run.dtype, args.seed, logits_chunk=args.logits_chunk, **args.lora
    )
    remat = plumbing.Remat(args.remat, model.backbone)  # --remat: a checkpoint switch on each decoder block
    backbone, tokenizer = model.backbone, model.preprocessor.tokenizer
    train, counts = tokenize_dataset(
        train_rows, tokenizer, args.max_length, args.completion_only_loss, args.dataset
    )
    evals = (
        tokenize_dataset(eval_rows, tokenizer, args.max_length, args.completion_only_loss, eval_path)[0]
        if eval_rows
        else []
    )
    train = plumbing.pack(train, args.max_length) if args.packing else train  # rows of several examples
    print(
        f"data: {counts['examples']} examples ({counts['truncated']} prompt-truncated, "
        f"{counts['dropped']} dropped as too long{f'; packed into {len(train)} rows' if args.packing else ''}); "
        f"{len(evals)} eval examples"
    )
    # --max-steps, or --num-epochs' worth of rows (packed: of packed rows, as TRL counts them)
    max_steps = run.resolve_max_steps(len(train) if args.packing else len(train_rows))
    # Host arrays at the run's longest bucket; each batch is cut to its own (common.bucket_length).
    length = common.bucket_length(max(len(x[0]) for x in train + evals), args.max_length)
    train_data, eval_data = pad_examples(train, length), pad_examples(evals, length) if evals else None
    lengths = (train_data["padding_mask"] > 0).sum(-1)

    # over max_steps, unless resumed (run.schedule_steps)
    optimizer, schedule, warmup = plumbing.make_optimizer(args, run.schedule_steps)
    params, frozen = common.split_variables(backbone, frozen_dtype=run.frozen_dtype)
    opt_state, opt_shardings = common.init_optimizer(optimizer, params, run.mesh)
    (params, opt_state), _ = run.resume((params, opt_state))
    state_shardings = (common.shardings(params), opt_shardings)
    state = jax.device_put((params, opt_state), state_shardings)
    # Layouts pinned in and out (donated, updated in place): one compilation per length bucket.
    step_fn = remat.jit(
        partial(train_step, backbone, optimizer, args),
        length,
        split=2,  # auto may halve the batch's micro-batches: the same update (equal micro-batches, summed)
        donate_argnums=0,
        out_shardings=(state_shardings, common.replicated(run.mesh)),
    )
    # args.json: the mode --remat auto chose, the warmup steps
    run.record(remat=remat, num_warmup_steps=warmup)
    eval_fn = jax.jit(lambda p, f, b, n: compute_loss(backbone, p, f, jax.tree.map(lambda x: x[0], b), n)[0])

    # the loss summed over eval batches [1, B, T] (each example once, ÷ all their tokens)
    def evaluate(params):
        num_loss_tokens = max(eval_data["loss_mask"][:, 1:].sum(), 1)
        loss = common.per_example(
            lambda b: eval_fn(params, frozen, b, num_loss_tokens),
            eval_data,
            args.batch_size,
            run.mesh,
            lengths=eval_data["padding_mask"].sum(-1),
            max_length=args.max_length,
        )
        return {"eval/loss": float(loss)}

    # ---- the loop: batch -> step -> log -> eval -> checkpoint ----
    # FLOPs per token: 6N (forward + backward), N = all matmul weights incl. embedding (docs/design.md).
    if eval_data is not None and run.start == 0:
        run.log_eval(evaluate(state[0]))  # the starting point, before any update
    for step in run.steps(6 * plumbing.count_params(backbone), schedule, summed=("train/skipped_nonfinite",)):
        batch, tokens = get_batch(train_data, lengths, step, args)  # tokens: (real, padded)
        state, metrics = step_fn(state, frozen, common.shard_batch(run.mesh, batch))
        run.log(metrics, *tokens)  # tokens/s and MFU count real tokens
        if eval_data is not None and run.eval_due():
            run.log_eval(evaluate(state[0]))
        run.checkpoint(state)

    # ---- outputs: final model (LoRA merged) and a few greedy samples from it ----
    def save_and_sample(path):
        common.save_model(model, state[0], path)  # also writes the trained values into `model`
        # held-out prompts; without eval data, training prompts, marked as such (their answers were trained on)
        mark = "sample:" if eval_rows else "sample (a training prompt: no eval data):"
        prompts = [sample_prompt(segs) for segs in (eval_rows or train_rows)[: args.num_samples]]
        samples = model.generate(prompts, max_length=length, strip_prompt=True) if prompts else []
        for p, out in zip(prompts, samples):
            print(f"{mark} {p!r} -> {out!r}")

    run.finish(save_and_sample)


if __name__ == "__main__":
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
