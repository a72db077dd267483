r"""Simple Preference Optimization (SimPO): length-normalised reward with a margin, no reference model.

Meng et al. 2024 (arXiv:2405.14734). Data: `prompt` / `chosen` / `rejected` (strings or chat
messages, TRL formats).
    python simpo.py --model gemma_2b --dataset my_prefs.jsonl
Offline, minutes on a laptop CPU (the defaults are for real models; `tiny` from scratch takes its own):
    python simpo.py --model tiny --max-steps 60 --batch-size 32 --grad-accum-steps 1 \
        --learning-rate 3e-4 --warmup-steps 5 --max-length 512 --gamma 0.5
"""

import os
from dataclasses import dataclass
from functools import partial
from typing import Literal

import plumbing  # the run shell: shared flags, Run, the exit boundary (instant to import)

# `python simpo.py --help`: from Args' source, before the imports below
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (mesh, models, data files, batches)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


@dataclass
class Args(plumbing.SharedArgs):
    """The shared flags (plumbing.SharedArgs: model, dtype, mesh, outputs, …) and SimPO's own."""

    # data
    dataset: str = os.path.join(common.HERE, "data", "prefs_train.jsonl")
    """preference pairs: .jsonl/.json/.parquet, or a Hugging Face dataset id / saved dir"""
    eval_dataset: str | None = os.path.join(common.HERE, "data", "prefs_eval.jsonl")
    """held-out pairs for eval/ metrics (same formats); empty to skip evaluation; the bundled
    file is used only with the bundled --dataset"""
    eval_split: str | None = None
    """evaluate on this split (e.g. `test`) of --dataset, or of --eval-dataset if given (TRL's dataset_test_split)"""
    max_length: int = 2048
    """tokens per prompt + response (SimPO's recipe: 2048); longer: prompt cut from the left, then pair dropped"""
    group_by_length: bool = False
    """batches of similar lengths (less padding): each window of 50 batches is sorted by length and dealt
    out in a seeded order (TRL/HF group_by_length)"""
    # optimisation
    num_epochs: float = 1.0
    """passes over --dataset that set --max-steps when it is None (SimPO's recipe: 1)"""
    batch_size: int = 128
    """preference pairs per update, global over devices and accumulation (SimPO paper: 128)"""
    grad_accum_steps: int = 16
    """micro-batches per update (memory ÷ this; same result)"""
    learning_rate: float = 6e-7
    """peak AdamW learning rate (SimPO's Llama-3-Base recipe: 6e-7)"""
    lr_scheduler_type: Literal[
        "linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup"
    ] = "cosine"
    """the rate after the warmup (SimPO's recipe: cosine to 0; TRL's default: linear to 0)"""
    warmup_ratio: float = 0.1
    """warmup as a fraction of all updates when --warmup-steps is 0 (SimPO's recipe: 0.1; TRL: 0)"""
    # algorithm
    beta: float = 2.0
    """β: scale of the reward β·avg logπ(y|x) (the paper's value)"""
    gamma: float = 1.0
    """γ: target reward margin, as in the paper's loss (Eq. 2); TRL's `simpo_gamma`; the SimPO
    repo's gamma_beta_ratio is γ/β (its Llama-3-Base recipe: β 2.0, γ/β 0.5)"""
    sft_weight: float = 0.0
    """weight of an added NLL on the chosen response (0: pure SimPO; TRL's CPO-SimPO default cpo_alpha is 1)"""
    # logging and outputs
    export_hf: bool = False
    """also write the final model as a Hugging Face checkpoint, tokenizer and chat template in <output-dir>/model_hf/"""
    log_every: int = 10
    """fetch metrics from the device and log every N steps"""
    eval_every: int = 20
    """evaluate every N steps (and before the first and after the last)"""


# ---------------------------------------------------------------------------
# Data: (prompt, chosen, rejected) texts (common.read_dataset) -> token ids + masks -> batches
# ---------------------------------------------------------------------------
def tokenize_dataset(triples, tokenizer, max_length, path):
    """(prompt, chosen, rejected) texts -> list of ((chosen ids, mask), (rejected ids, mask)), plus counts.

    ids = [BOS] + prompt + response + [EOS]; the mask marks response tokens and
    EOS. Too long: cut the prompt from the left (BOS kept) by the same amount for
    both sequences, then drop the pair if a response still does not fit.
    """
    pieces = iter(tokenizer.tokenize([t for triple in triples for t in triple]))  # one batched call
    examples = []
    truncated = 0
    dropped = 0
    for _ in triples:
        prompt, chosen, rejected = (list(next(pieces)) for _ in range(3))
        cut = 2 + len(prompt) + max(len(chosen), len(rejected)) - max_length
        if cut > len(prompt):
            dropped += 1
            continue
        if cut > 0:
            prompt = prompt[cut:]
            truncated += 1
        examples.append(
            tuple(
                (
                    np.array(
                        [tokenizer.start_token_id] + prompt + response + [tokenizer.end_token_id], np.int32
                    ),
                    np.array([False] * (1 + len(prompt)) + [True] * (len(response) + 1), bool),
                )
                for response in (chosen, rejected)
            )
        )
    if not examples:
        raise common.UsageError(f"{path}: every pair is longer than --max-length {max_length}")
    return examples, {"examples": len(examples), "truncated": truncated, "dropped": dropped}


def pad_examples(examples, length):
    """-> {chosen,rejected}_{ids,padding_mask,loss_mask}, each [N, length] (right padding)."""
    n = len(examples)
    data = {}
    for j, name in enumerate(("chosen", "rejected")):
        ids = np.zeros((n, length), np.int32)
        pad = np.zeros((n, length), bool)
        mask = np.zeros((n, length), bool)
        for i, pair in enumerate(examples):
            x, m = pair[j]
            ids[i, : len(x)] = x
            pad[i, : len(x)] = True
            mask[i, : len(x)] = m
        data.update({f"{name}_ids": ids, f"{name}_padding_mask": pad, f"{name}_loss_mask": mask})
    return data


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
# ALGO LOGIC: log-probs of chosen and rejected, and the SimPO loss
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


def sequence_logps(logps, loss_mask, average=False):
    """Per-sequence log-prob of the response: [B, T-1] token log-probs -> [B].

    Shifting `loss_mask` by one aligns it with `logps` (position t scores token
    t+1), so BOS, prompt and padding drop out. Summed, or the per-token mean (`average`).
    """
    mask = loss_mask[:, 1:]  # [B, T-1]: is token t+1 a response token
    total = jnp.sum(jnp.where(mask, logps, 0.0), -1)
    return total / jnp.maximum(mask.sum(-1), 1) if average else total


def concatenated_forward(backbone, params, frozen, batch):
    """Chosen and rejected through the model in ONE forward pass (stacked on the batch axis).

    batch: {chosen,rejected}_{ids,padding_mask,loss_mask}, each [B, T] -> ({chosen_logps, rejected_logps:
    per-token mean log-probs of the responses, nll, nll_tokens: the chosen NLL sum and its token count}, [B]
    each; the forward's aux_loss (token_logps)).
    """
    # differs from dpo.py's: SimPO's log-probs are per-token means (length-normalised), and the chosen
    # NLL comes with its token count
    both = {
        k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]])  # [2B, T]
        for k in ("ids", "padding_mask", "loss_mask")
    }
    logps, aux_loss = token_logps(backbone, params, frozen, both["ids"], both["padding_mask"])  # [2B, T-1]
    total = sequence_logps(logps, both["loss_mask"])  # Σ response-token log-probs, [2B]
    count = both["loss_mask"][:, 1:].sum(-1)  # response tokens (EOS included), [2B]
    avg = total / jnp.maximum(count, 1)  # length normalisation (Eq. 1)
    b = batch["chosen_ids"].shape[0]
    pairs = {"chosen_logps": avg[:b], "rejected_logps": avg[b:]}
    return {**pairs, "nll": -total[:b], "nll_tokens": count[:b]}, aux_loss


def simpo_loss(chosen_logps, rejected_logps, nll_loss=0.0, *, beta=2.0, gamma=0.5, sft_weight=0.0):
    """SimPO on per-token mean log-probs, each [B] -> (mean loss, metrics).

    Eq. 2: −log σ(β·avg logπ(y+) − β·avg logπ(y−) − γ), plus `sft_weight`·NLL(y+) when
    asked (Eq. 3; `nll_loss`: token-mean NLL of the chosen responses). Equations: docs/simpo.md.
    """
    chosen_rewards = beta * chosen_logps  # r(x, y) = β/|y| · logπ(y|x) (Eq. 1)
    rejected_rewards = beta * rejected_logps
    losses = -jax.nn.log_sigmoid(chosen_rewards - rejected_rewards - gamma)  # [B]
    chosen_rewards, rejected_rewards = jax.lax.stop_gradient((chosen_rewards, rejected_rewards))
    metrics = {
        "rewards/accuracies": (chosen_rewards > rejected_rewards).mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "logps/chosen": jax.lax.stop_gradient(chosen_logps).mean(),
        "logps/rejected": jax.lax.stop_gradient(rejected_logps).mean(),
        "nll_loss": jax.lax.stop_gradient(nll_loss),
    }
    return losses.mean() + sft_weight * nll_loss, metrics


def compute_loss(logps, args, num_chosen_tokens):
    """This run's loss on a batch's log-probs (concatenated_forward's) -> (loss, metrics): simpo_loss with the
    run's flags, the chosen NLL a token mean over num_chosen_tokens. The training step and the evaluation both
    call it, so a term added here is trained and evaluated alike."""
    nll = logps["nll"].sum() / num_chosen_tokens
    return simpo_loss(
        logps["chosen_logps"],
        logps["rejected_logps"],
        nll,
        beta=args.beta,
        gamma=args.gamma,
        sft_weight=args.sft_weight,
    )


# ---------------------------------------------------------------------------
# train_step: one optimizer update over `A` accumulated micro-batches
# ---------------------------------------------------------------------------
def train_step(backbone, optimizer, args, state, frozen, batch):
    """state = (params, opt_state); batch arrays are [A, B/A, ...].

    `frozen` (non-trainable weights: the whole base model under LoRA) is an input only: it is
    neither donated nor returned, so the Keras variables keep their buffers for saving.
    """
    params, opt_state = state
    accum = batch["chosen_ids"].shape[0]
    num_chosen_tokens = jnp.maximum(batch["chosen_loss_mask"][:, :, 1:].sum(), 1)  # whole update

    def micro_loss(p, micro):
        logps, aux_loss = concatenated_forward(backbone, p, frozen, micro)
        # ÷ accum below: the chosen NLL stays a token mean over the whole update
        loss, metrics = compute_loss(logps, args, num_chosen_tokens / accum)
        loss = loss + aux_loss  # + the router load-balancing loss (a mixture of experts; 0.0 dense)
        return loss / accum, {"train/loss": loss, "aux_loss": aux_loss, **metrics}  # equal micro-batches

    def accumulate(grads, micro):
        (_, metrics), g = jax.value_and_grad(micro_loss, has_aux=True)(params, micro)
        return jax.tree.map(jnp.add, grads, g), metrics

    grads, metrics = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {k: v.mean() for k, v in metrics.items()}  # [A] -> the whole batch
    metrics["train/grad_norm"] = optax.global_norm(grads)
    return (params, opt_state), metrics


def main(args):
    # ---- set-up: every flag, file and row checked before the model loads ----
    # shared flags and --output-dir checked; nothing written
    run = plumbing.Run(
        __file__,
        args,
        log_every=args.log_every,
        eval_every=args.eval_every,
        grad_accum_steps=args.grad_accum_steps,
        export_hf=args.export_hf,
    )
    if args.beta <= 0 or args.sft_weight < 0:
        raise common.UsageError("need --beta > 0 and --sft-weight >= 0")
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
    train, counts = tokenize_dataset(train_rows, tokenizer, args.max_length, args.dataset)
    evals = tokenize_dataset(eval_rows, tokenizer, args.max_length, eval_path)[0] if eval_rows else []
    print(
        f"data: {counts['examples']} pairs ({counts['truncated']} prompt-truncated, "
        f"{counts['dropped']} dropped as too long); {len(evals)} eval pairs"
    )
    # Host arrays at the run's longest bucket; each batch is cut to its own (common.bucket_length).
    length = common.bucket_length(max(len(s[0]) for x in train + evals for s in x), args.max_length)
    train_data, eval_data = pad_examples(train, length), pad_examples(evals, length) if evals else None
    lengths, eval_lengths = pair_lengths(train_data), pair_lengths(eval_data) if evals else None

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
    # Weights are jit arguments, never closed over (that would bake them into the program as constants).
    first = lambda b: jax.tree.map(lambda x: x[0], b)  # [1, B, ...] -> [B, ...]
    eval_fn = jax.jit(lambda p, f, b: concatenated_forward(backbone, p, f, first(b))[0])

    def evaluate(params):  # every eval pair's log-probs, then the loss over all of them at once
        logps = common.per_example(
            lambda b: eval_fn(params, frozen, b),
            eval_data,
            args.batch_size,
            run.mesh,
            lengths=eval_lengths,
            max_length=args.max_length,
        )
        loss, metrics = compute_loss(logps, args, logps["nll_tokens"].sum())
        # accuracy and margin first: Run prints the first three
        return {**{f"eval/{k}": v for k, v in metrics.items()}, "eval/loss": loss}

    # ---- the loop: batch -> step -> log -> eval -> checkpoint ----
    # FLOPs per token: 6N (forward + backward; no reference model), N = all matmul weights incl.
    # embedding (docs/design.md); tokens = chosen + rejected.
    flops_per_token = 6 * plumbing.count_params(backbone)
    if eval_data is not None and run.start == 0:
        run.log_eval(evaluate(state[0]))  # the starting point
    for step in run.steps(flops_per_token, schedule, show=("rewards/margins",)):
        batch, tokens = get_batch(train_data, lengths, step, args)  # tokens: (real, padded)
        state, metrics = step_fn(state, frozen, common.shard_batch(run.mesh, batch))
        run.log(metrics, *tokens)  # metrics of the pre-update forward; tokens/s, MFU: real tokens
        if eval_data is not None and run.eval_due():
            run.log_eval(evaluate(state[0]))
        run.checkpoint(state)

    # ---- outputs: the final model (LoRA merged) ----
    run.finish(lambda path: common.save_model(model, state[0], path))


if __name__ == "__main__":
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
