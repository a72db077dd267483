r"""Reward model: Bradley–Terry loss on preference pairs, scalar head on the last real token.

Ouyang et al. 2022 (InstructGPT) §3.5; data: `prompt` + `chosen` + `rejected` (TRL formats).
    python reward.py --model gemma_2b --dataset my_prefs.jsonl
Offline, minutes on a laptop CPU (the defaults are for real models; `tiny` from scratch takes its own):
    python reward.py --model tiny --max-steps 80 --batch-size 32 --learning-rate 1e-3 \
        --warmup-steps 10 --max-length 512
"""

import json
import math
import os
from dataclasses import dataclass
from functools import partial

import plumbing  # the run shell: shared flags, Run, the exit boundary (instant to import)

# `python reward.py --help`: from Args' source, before the imports below
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (mesh, models, data files, batches)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


@dataclass
class Args(plumbing.SharedArgs):
    """The shared flags (plumbing.SharedArgs: model, dtype, mesh, outputs, …) and the reward model's own."""

    # data
    dataset: str = os.path.join(common.HERE, "data", "prefs_train.jsonl")
    """preference pairs: .jsonl/.json/.parquet, or a Hugging Face dataset id / saved dir"""
    eval_dataset: str | None = os.path.join(common.HERE, "data", "prefs_eval.jsonl")
    """held-out pairs for eval/accuracy (same formats); empty to skip evaluation; the bundled
    file is used only with the bundled --dataset"""
    eval_split: str | None = None
    """evaluate on this split (e.g. `test`) of --dataset, or of --eval-dataset if given (TRL's dataset_test_split)"""
    max_length: int = 1024
    """tokens per prompt + response (TRL RewardConfig: 1024); longer: prompt cut from the left, then pair dropped"""
    group_by_length: bool = False
    """batches of similar lengths (less padding): each window of 50 batches is sorted by length and dealt
    out in a seeded order (TRL/HF group_by_length)"""
    # optimisation
    grad_accum_steps: int = 1
    """micro-batches per update (memory ÷ this; same result)"""
    learning_rate: float = 1e-4
    """peak AdamW learning rate (TRL RewardConfig: 1e-4)"""
    # algorithm
    normalize: bool = False
    """shift the head bias so the training set's chosen responses score mean 0 (stats in reward_head.json)"""
    normalize_samples: int = 512
    """how many training pairs' chosen responses set the normalisation mean"""
    # logging and outputs
    log_every: int = 10
    """fetch metrics from the device and log every N steps"""
    eval_every: int = 40
    """evaluate every N steps (and at the end)"""


# ---------------------------------------------------------------------------
# Data: (prompt, chosen, rejected) texts (common.read_dataset) -> token ids -> fixed-shape batches
# ---------------------------------------------------------------------------
def tokenize_pairs(triples, tokenizer, max_length, path):
    """-> list of (chosen ids, rejected ids), plus counts. Each = [BOS] + prompt + response + [EOS].

    Prompt and responses are tokenized apart (as dpo.py does), so a pair shares its prompt's
    tokens exactly. Too long: cut the prompt from the left (BOS kept), then drop the pair if a
    response alone still does not fit.
    """
    ids = iter(tokenizer.tokenize([t for triple in triples for t in triple]))  # one batched call
    bos, eos = tokenizer.start_token_id, tokenizer.end_token_id
    pairs = []
    truncated = 0
    dropped = 0
    for _ in triples:
        prompt, chosen, rejected = (list(next(ids)) for _ in range(3))
        cut = max(len(chosen), len(rejected)) + 2 + len(prompt) - max_length
        if cut > len(prompt):
            dropped += 1
            continue
        truncated += cut > 0
        prompt = prompt[max(cut, 0) :]
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
            ids[i, : len(pair[j])], mask[i, : len(pair[j])] = pair[j], True
        out[f"{side}_token_ids"], out[f"{side}_padding_mask"] = ids, mask
    return out


def pair_lengths(data):
    """[N, 2]: the real tokens of each pair's chosen and rejected sequences."""
    return np.stack([data["chosen_padding_mask"].sum(-1), data["rejected_padding_mask"].sum(-1)], -1)


def get_batch(data, lengths, step, args):
    """Batch for `step` (a pure function of it, so --resume is exact), cut to the length bucket of
    its longest sequence: [A, B/A/P, T] per process; and its (real, padded) tokens over all processes."""
    idx, length, real = common.length_batch(
        lengths, step, args.batch_size, args.seed, args.max_length, group=args.group_by_length
    )
    batch = {k: v[idx, :length].reshape(args.grad_accum_steps, -1, length) for k, v in data.items()}
    return batch, (real, 2 * args.batch_size * length)


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
    """Backbone hidden state at the last real token (the appended EOS), float32: [B, D]; and the forward's
    aux_loss (a mixture of experts' router load-balancing loss, common.forward; 0.0 for a dense model)."""
    hidden, aux_loss = common.forward(backbone, params, frozen, token_ids, padding_mask)  # [B, T, D], scalar
    last = jnp.sum(padding_mask, -1).astype(jnp.int32) - 1  # right padding: index of the final real token
    hidden = jnp.take_along_axis(hidden, last[:, None, None], 1)[:, 0]  # [B, D]
    return hidden.astype(jnp.float32), aux_loss  # f32 upcast


def sequence_scores(backbone, params, frozen, head, token_ids, padding_mask):
    """r(x, y) = w·h_last + b: [B]; and the forward's aux_loss."""
    h, aux_loss = last_token_hidden(backbone, params, frozen, token_ids, padding_mask)
    return (h @ head["weight"])[:, 0] + head["bias"], aux_loss


def reward_loss(chosen_scores, rejected_scores):
    """Bradley–Terry: mean of -log σ(r(x,y+) - r(x,y-)) (eq. 1 of docs/reward.md).

    log σ(z) is computed as -softplus(-z): stable for large |z|.
    """
    margins = chosen_scores - rejected_scores
    loss = jnp.mean(jax.nn.softplus(-margins))
    metrics = {
        "rewards/chosen": chosen_scores.mean(),
        "rewards/rejected": rejected_scores.mean(),
        "rewards/margins": margins.mean(),
        "rewards/accuracies": (margins > 0).mean(),
    }
    return loss, metrics


def pair_scores(backbone, params, frozen, head, batch):
    """Chosen and rejected in one forward, concatenated on the batch axis -> ({chosen_scores,
    rejected_scores}, [B] each; its aux_loss)."""
    ids = jnp.concatenate([batch["chosen_token_ids"], batch["rejected_token_ids"]])  # [2B, T]
    mask = jnp.concatenate([batch["chosen_padding_mask"], batch["rejected_padding_mask"]])
    scores, aux_loss = sequence_scores(backbone, params, frozen, head, token_ids=ids, padding_mask=mask)
    chosen, rejected = jnp.split(scores, 2)
    return {"chosen_scores": chosen, "rejected_scores": rejected}, aux_loss


def compute_loss(scores):
    """This run's loss on a batch's pair_scores -> (loss, metrics): the Bradley–Terry reward_loss. The
    training step and the evaluation both call it, so a term added here is trained and evaluated alike."""
    return reward_loss(scores["chosen_scores"], scores["rejected_scores"])


# ---------------------------------------------------------------------------
# train_step: one optimizer update over `A` accumulated micro-batches
# ---------------------------------------------------------------------------
def train_step(backbone, optimizer, args, state, frozen, batch):
    """state = ((backbone params, head), opt_state); batch arrays are [A, B/A, T].

    `frozen` (non-trainable weights: the whole base model under LoRA) is an input only,
    never donated, so the Keras variables keep their buffers for saving.
    """
    params, opt_state = state
    accum = batch["chosen_token_ids"].shape[0]

    def micro_loss(p, micro):
        scores, aux_loss = pair_scores(backbone, p[0], frozen, p[1], micro)
        loss, metrics = compute_loss(scores)
        loss = loss + aux_loss  # + the router load-balancing loss (a mixture of experts; 0.0 dense)
        return loss / accum, {**metrics, "aux_loss": aux_loss}  # mean over micro-batches = over the batch

    def accumulate(grads, micro):
        (loss, metrics), g = jax.value_and_grad(micro_loss, has_aux=True)(params, micro)
        return jax.tree.map(jnp.add, grads, g), (loss, metrics)

    grads, (losses, metrics) = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {k: v.mean() for k, v in metrics.items()}  # [A] -> the whole batch
    return (params, opt_state), {
        **metrics,
        "train/loss": losses.sum(),
        "train/grad_norm": optax.global_norm(grads),
    }


def main(args):
    # ---- set-up: every flag, file and row checked before the model loads ----
    # nothing written yet
    run = plumbing.Run(
        __file__,
        args,
        log_every=args.log_every,
        eval_every=args.eval_every,
        grad_accum_steps=args.grad_accum_steps,
    )
    if args.normalize and args.normalize_samples < 1:
        raise common.UsageError(
            f"--normalize-samples {args.normalize_samples}: must be >= 1 with --normalize"
        )
    template = common.chat_template(args.model, args.chat_template)
    eval_path, eval_split, eval_flag = common.eval_source(
        args.dataset, args.eval_dataset, args.eval_split, (Args.dataset, Args.eval_dataset)
    )
    eval_rows = (
        common.read_dataset(
            eval_path, "preference", template, flag=eval_flag, config=args.dataset_config, split=eval_split
        )
        if eval_path
        else []
    )
    train_rows = common.read_dataset(
        args.dataset, "preference", template, config=args.dataset_config, split=args.dataset_split
    )
    max_steps = run.resolve_max_steps(len(train_rows))  # --max-steps, or --num-epochs' worth of pairs
    model = common.load_model(
        args.model, run.mesh, run.dtype, args.seed, logits_chunk=args.logits_chunk, **args.lora
    )
    remat = plumbing.Remat(args.remat, model.backbone)  # --remat: a checkpoint switch on each decoder block
    backbone, tokenizer = model.backbone, model.preprocessor.tokenizer
    train, counts = tokenize_pairs(train_rows, tokenizer, args.max_length, args.dataset)
    evals = tokenize_pairs(eval_rows, tokenizer, args.max_length, eval_path)[0] if eval_rows else []
    print(
        f"data: {counts['examples']} pairs ({counts['truncated']} prompt-truncated, "
        f"{counts['dropped']} dropped as too long); {len(evals)} eval pairs"
    )
    # Host arrays at the run's longest bucket; each batch is cut to its own (common.bucket_length).
    length = common.bucket_length(max(len(s) for p in train + evals for s in p), args.max_length)
    train_data, eval_data = pad_pairs(train, length), pad_pairs(evals, length) if evals else None
    lengths = pair_lengths(train_data)

    # over max_steps, unless resumed (run.schedule_steps)
    optimizer, schedule, warmup = plumbing.make_optimizer(args, run.schedule_steps)
    params, frozen = common.split_variables(backbone, frozen_dtype=run.frozen_dtype)
    head = jax.tree.map(
        lambda x: common.put_global(x, common.replicated(run.mesh)), init_head(backbone, args.seed)
    )
    opt_state, opt_shardings = common.init_optimizer(optimizer, (params, head), run.mesh)
    state, _ = run.resume(((params, head), opt_state))  # params incl. the head, optimizer state
    # Layouts pinned in and out (donated, updated in place): one compilation per length bucket.
    state_shardings = (common.shardings(state[0]), opt_shardings)
    state = jax.device_put(state, state_shardings)
    step_fn = remat.jit(
        partial(train_step, backbone, optimizer, args),
        length,
        split=2,  # auto may halve the batch's micro-batches: the same update (equal micro-batches, summed)
        donate_argnums=0,
        out_shardings=(state_shardings, common.replicated(run.mesh)),
    )
    # args.json: the mode --remat auto chose, the warmup steps
    run.record(remat=remat, num_warmup_steps=warmup)

    eval_fn = jax.jit(
        lambda p, f, b: pair_scores(backbone, p[0], f, p[1], jax.tree.map(lambda x: x[0], b))[0]
    )

    def scores_of(params, data):  # every pair's {chosen_scores, rejected_scores}, [N] each
        return common.per_example(
            lambda b: eval_fn(params, frozen, b),
            data,
            args.batch_size,
            run.mesh,
            lengths=pair_lengths(data),
            max_length=args.max_length,
        )

    def evaluate(params):  # every eval pair's scores, then the loss over all of them at once
        loss, metrics = compute_loss(scores_of(params, eval_data))
        # TRL's eval/accuracy first (Run prints the first three): the share of pairs ranked right
        return {
            "eval/accuracy": metrics["rewards/accuracies"],
            "eval/margins": metrics["rewards/margins"],
            "eval/loss": loss,
        }

    # ---- the loop: batch -> step -> log -> eval -> checkpoint ----
    # FLOPs per token: 6N (forward + backward) on chosen and rejected tokens alike (docs/design.md).
    for step in run.steps(6 * plumbing.count_params(backbone), schedule, show=("rewards/accuracies",)):
        batch, tokens = get_batch(train_data, lengths, step, args)  # tokens: (real, padded)
        state, metrics = step_fn(state, frozen, common.shard_batch(run.mesh, batch))
        run.log(metrics, *tokens)  # tokens/s and MFU count real tokens
        if eval_data is not None and run.eval_due():
            run.log_eval(evaluate(state[0]))
        run.checkpoint(state)

    # ---- outputs: normalised head (eq. 2, optional), backbone preset + head ----
    params, head = state[0]
    info = {"normalized": args.normalize}
    if args.normalize:  # reference set: chosen responses of the first N training pairs
        first = {k: v[: args.normalize_samples] for k, v in train_data.items()}
        ref = scores_of(state[0], first)["chosen_scores"]
        head = {"weight": head["weight"], "bias": head["bias"] - float(ref.mean())}
        info.update(
            {
                "reference_set": f"chosen responses of the first {len(ref)} pairs of {args.dataset}",
                "mean_before": float(ref.mean()),
                "std": float(ref.std()),
            }
        )

    # model/: the backbone as a KerasHub preset (LoRA merged), the scalar head beside it (common.HEAD_FILE)
    def save(path):
        common.save_model(model, params, path)
        if jax.process_index() == 0:
            np.savez(  # weight [D, 1], bias []
                os.path.join(path, common.HEAD_FILE),
                weight=np.asarray(head["weight"]),
                bias=np.asarray(head["bias"]),
            )
            with open(os.path.join(path, common.HEAD_INFO), "w") as f:  # how it was normalised
                json.dump(info, f, indent=2)

    run.finish(save)


if __name__ == "__main__":
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
