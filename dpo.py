r"""Direct Preference Optimization (DPO): learn from preference pairs, no reward model.

Rafailov et al. 2023 (arXiv:2305.18290); also IPO (`--loss-type ipo`), hinge and cDPO
label smoothing. Data: `prompt` / `chosen` / `rejected` (strings or chat messages, TRL formats).
    python dpo.py --model gemma_2b --dataset my_prefs.jsonl
Offline, minutes on a laptop CPU (the defaults are for real models; `tiny` from scratch takes its own):
    python dpo.py --model tiny --max-steps 60 --batch-size 32 --learning-rate 3e-4 --warmup-steps 5 \
        --max-length 512
"""

import os
from dataclasses import dataclass
from functools import partial
from typing import Literal

import plumbing  # the run shell: shared flags, Run, the exit boundary (instant to import)

# `python dpo.py --help`: from Args' source, before the imports below
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (mesh, models, data files, batches)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


@dataclass
class Args(plumbing.SharedArgs):
    """The shared flags (plumbing.SharedArgs: model, dtype, mesh, outputs, …) and DPO's own."""

    # data
    dataset: str = os.path.join(common.HERE, "data", "prefs_train.jsonl")
    """preference pairs: .jsonl/.json/.parquet, or a Hugging Face dataset id / saved dir"""
    eval_dataset: str | None = os.path.join(common.HERE, "data", "prefs_eval.jsonl")
    """held-out pairs for eval/ metrics (same formats); empty to skip evaluation; the bundled
    file is used only with the bundled --dataset"""
    eval_split: str | None = None
    """evaluate on this split (e.g. `test`) of --dataset, or of --eval-dataset if given (TRL's dataset_test_split)"""
    max_length: int = 1024
    """tokens per prompt + response (TRL DPOConfig: 1024); longer: prompt cut from the left, then pair dropped"""
    group_by_length: bool = False
    """batches of similar lengths (less padding): each window of 50 batches is sorted by length and dealt
    out in a seeded order (TRL/HF group_by_length)"""
    # optimisation
    learning_rate: float = 1e-6
    """peak AdamW learning rate (TRL DPOConfig: 1e-6)"""
    grad_accum_steps: int = 1
    """micro-batches per update (memory ÷ this; same result)"""
    # algorithm
    beta: float = 0.1
    """β: strength of the implicit KL penalty to the reference (τ of IPO)"""
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """sigmoid: DPO (Eq. 1); ipo: squared loss on average log-probs (Eq. 3); hinge: SLiC (Eq. 4)"""
    label_smoothing: float = 0.0
    """ε of conservative DPO (cDPO): the probability that a pair's label is flipped (sigmoid only)"""
    sft_weight: float = 0.0
    """α: add α × the chosen responses' NLL (token mean over the update); TRL's loss_type=[sigmoid, sft] with
    loss_weights=[1, α], RPO's (Pang et al. 2024: 1.0); it holds the chosen up against pairs with a shortcut"""
    precompute_ref: bool = False
    """compute reference log-probs in one pass before training, then run no reference forward
    (with --lora-rank the reference is the LoRA-off base; otherwise a frozen copy)"""
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


def get_batch(data, lengths, step, args, ref_logps=None):
    """Batch for `step` (a pure function of it, so --resume is exact), cut to the length bucket of
    its longest sequence: [A, B/A/P, T] per process; and its (real, padded) tokens over all processes.
    ref_logps: --precompute-ref's {ref_chosen_logps, ref_rejected_logps}, [N] each -> [A, B/A/P] each."""
    idx, length, real = common.length_batch(
        lengths, step, args.batch_size, args.seed, args.max_length, group=args.group_by_length
    )
    batch = {k: v[idx, :length].reshape(args.grad_accum_steps, -1, length) for k, v in data.items()}
    if ref_logps:  # differs from simpo.py's and orpo.py's: only DPO precomputes reference log-probs
        batch.update({k: v[idx].reshape(args.grad_accum_steps, -1) for k, v in ref_logps.items()})
    return batch, (real, 2 * args.batch_size * length)


# ---------------------------------------------------------------------------
# ALGO LOGIC: log-probs of chosen and rejected, and the DPO loss
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


def concatenated_forward(backbone, params, frozen, batch, average=False):
    """Chosen and rejected through the model in ONE forward pass (stacked on the batch axis).

    batch: {chosen,rejected}_{ids,padding_mask,loss_mask}, each [B, T] -> ({chosen_logps, rejected_logps, nll:
    the chosen responses' summed NLL (--sft-weight's)}, [B] each; the forward's aux_loss (token_logps)).
    """
    both = {
        k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]])  # [2B, T]
        for k in ("ids", "padding_mask", "loss_mask")
    }
    logps, aux_loss = token_logps(backbone, params, frozen, both["ids"], both["padding_mask"])  # [2B, T-1]
    seq = sequence_logps(logps, both["loss_mask"], average)
    b = batch["chosen_ids"].shape[0]
    nll = -sequence_logps(logps[:b], batch["chosen_loss_mask"])  # summed, also under `average`
    return {"chosen_logps": seq[:b], "rejected_logps": seq[b:], "nll": nll}, aux_loss


def dpo_loss(
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    *,
    beta=0.1,
    loss_type="sigmoid",
    label_smoothing=0.0,
    nll_loss=0.0,
    sft_weight=0.0,
):
    """DPO and its variants on per-sequence log-probs, each [B] -> (mean loss, metrics); plus
    `sft_weight`·`nll_loss` (the chosen responses' token-mean NLL; RPO, Eq. 6).

    h = (logπ(y+) − logπref(y+)) − (logπ(y−) − logπref(y−)), the log-ratio margin.
    Equation numbers: docs/dpo.md.
      sigmoid (Eq. 1, cDPO Eq. 2): −(1−ε)·log σ(βh) − ε·log σ(−βh)
      ipo     (Eq. 3):             (h − 1/(2β))²
      hinge   (Eq. 4):             max(0, 1 − βh)
    """
    chosen_rewards = beta * (chosen_logps - ref_chosen_logps)  # implicit reward r = β log π/πref (Eq. 5)
    rejected_rewards = beta * (rejected_logps - ref_rejected_logps)
    h = (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)  # [B]
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * jax.nn.log_sigmoid(beta * h) - label_smoothing * jax.nn.log_sigmoid(
            -beta * h
        )
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = jax.nn.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
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


def reference_logps(backbone, ref_params, frozen, batch, average=False):
    """πref's {ref_chosen_logps, ref_rejected_logps}, [B] each: precomputed ones from the batch, else a
    forward with the reference params."""
    if "ref_chosen_logps" in batch:
        return {k: batch[k] for k in ("ref_chosen_logps", "ref_rejected_logps")}
    # stop_gradient: the reference is frozen (no gradient flows into the shared `frozen` weights); so is its
    # router: its aux_loss is not trained (TRL's reference forward returns none)
    logps = jax.lax.stop_gradient(concatenated_forward(backbone, ref_params, frozen, batch, average)[0])
    return {"ref_chosen_logps": logps["chosen_logps"], "ref_rejected_logps": logps["rejected_logps"]}


def compute_loss(logps, args, num_chosen_tokens):
    """This run's loss on a batch's log-probs (concatenated_forward's and reference_logps') -> (loss,
    metrics): dpo_loss with the run's flags, the chosen NLL a token mean over num_chosen_tokens. The training
    step and the evaluation both call it, so a term added here is trained and evaluated alike."""
    return dpo_loss(
        logps["chosen_logps"],
        logps["rejected_logps"],
        logps["ref_chosen_logps"],
        logps["ref_rejected_logps"],
        beta=args.beta,
        loss_type=args.loss_type,
        label_smoothing=args.label_smoothing,
        nll_loss=logps["nll"].sum() / num_chosen_tokens,
        sft_weight=args.sft_weight,
    )


def lora_off(backbone, params):
    """The LoRA-disabled reference: LoRA factors zeroed (ΔW = A·B = 0); the base weights stay
    in `frozen`, shared with the policy, so no second copy of the model exists."""
    return [
        jnp.zeros_like(p) if "lora_kernel" in v.path else jnp.copy(p)
        for v, p in zip(backbone.trainable_variables, params)
    ]


def precompute_reference_logps(backbone, ref_params, frozen, data, lengths, *, average, args, mesh):
    """--precompute-ref: πref's log-probs of every pair in one pass before training, so that no step runs a
    reference forward. data: {chosen,rejected}_{ids,padding_mask,loss_mask}, [N, T] each; lengths: [N, 2]
    -> {ref_chosen_logps, ref_rejected_logps}, [N] each, in the data's order (get_batch indexes them)."""

    # Weights are jit arguments, never closed over (that would bake them into the program as constants).
    @jax.jit
    def forward(ref_params, frozen, batch):
        batch = jax.tree.map(lambda x: x[0], batch)  # [1, B, ...] -> [B, ...]
        return reference_logps(backbone, ref_params, frozen, batch, average)

    return common.per_example(
        partial(forward, ref_params, frozen),
        data,
        args.batch_size,
        mesh,
        lengths=lengths,
        max_length=args.max_length,
    )


# ---------------------------------------------------------------------------
# train_step: one optimizer update over `A` accumulated micro-batches
# ---------------------------------------------------------------------------
def train_step(backbone, optimizer, args, state, frozen, batch, ref_params):
    """state = (params, opt_state); batch arrays are [A, B/A, ...]; ref_params None if precomputed.

    `frozen` (non-trainable weights: the whole base model under LoRA) is an input only: it is
    neither donated nor returned, so the Keras variables keep their buffers for saving.
    """
    params, opt_state = state
    accum = batch["chosen_ids"].shape[0]
    average = args.loss_type == "ipo"
    num_chosen_tokens = jnp.maximum(batch["chosen_loss_mask"][:, :, 1:].sum(), 1)  # whole update

    def micro_loss(p, micro):
        logps, aux_loss = concatenated_forward(backbone, p, frozen, micro, average)
        logps.update(reference_logps(backbone, ref_params, frozen, micro, average))
        # ÷ accum below: the chosen NLL stays a token mean over the whole update
        loss, metrics = compute_loss(logps, args, num_chosen_tokens / accum)
        loss = loss + aux_loss  # + the policy's router load-balancing loss (a mixture of experts; 0.0 dense)
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
    if args.beta <= 0 or not 0 <= args.label_smoothing < 0.5 or args.sft_weight < 0:
        raise common.UsageError("need --beta > 0, 0 <= --label-smoothing < 0.5 and --sft-weight >= 0")
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
    average = args.loss_type == "ipo"
    # The reference πref = the initial policy, three ways: LoRA-off base (no copy), a frozen copy,
    # or (--precompute-ref) its log-probs stored per example before training.
    ref_params = None  # the weights of the online reference forward; None: its log-probs are precomputed
    train_ref_logps, eval_ref_logps = {}, {}  # --precompute-ref's, [N] each
    if args.precompute_ref:
        initial = lora_off(backbone, params) if args.lora_rank else params  # read here, before any update
        precompute = partial(
            precompute_reference_logps, backbone, initial, frozen, average=average, args=args, mesh=run.mesh
        )
        train_ref_logps = precompute(train_data, lengths)
        if eval_data is not None:
            eval_ref_logps = precompute(eval_data, eval_lengths)
    elif args.lora_rank:
        ref_params = lora_off(backbone, params)
    else:  # a copy (the policy's buffers are donated to each update), held in --frozen-dtype: nothing updates it
        ref_params = common.frozen_copy(params, run.frozen_dtype)
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
    @jax.jit
    def eval_fn(params, ref_params, frozen, batch):  # [1, B, ...] -> what compute_loss reads, [B] each
        batch = jax.tree.map(lambda x: x[0], batch)
        logps = concatenated_forward(backbone, params, frozen, batch, average)[0]
        return {**logps, **reference_logps(backbone, ref_params, frozen, batch, average)}

    def evaluate(params):  # every eval pair's log-probs, then the loss over all of them at once
        logps = common.per_example(
            partial(eval_fn, params, ref_params, frozen),
            {**eval_data, **eval_ref_logps},  # with --precompute-ref, its log-probs ride along
            args.batch_size,
            run.mesh,
            lengths=eval_lengths,
            max_length=args.max_length,
        )
        loss, metrics = compute_loss(logps, args, eval_data["chosen_loss_mask"][:, 1:].sum())
        # accuracy and margin first: Run prints the first three
        return {**{f"eval/{k}": v for k, v in metrics.items()}, "eval/loss": loss}

    # ---- the loop: batch -> step -> log -> eval -> checkpoint ----
    # FLOPs per token: 6N (forward + backward) + 2N for the online reference forward (docs/design.md);
    # N = all matmul weights incl. embedding; tokens = chosen + rejected.
    flops_per_token = (6 + 2 * (not args.precompute_ref)) * plumbing.count_params(backbone)
    if eval_data is not None and run.start == 0:
        run.log_eval(evaluate(state[0]))  # the starting point: policy == reference
    for step in run.steps(flops_per_token, schedule, show=("rewards/margins",)):
        batch, tokens = get_batch(train_data, lengths, step, args, train_ref_logps)  # tokens: (real, padded)
        state, metrics = step_fn(state, frozen, common.shard_batch(run.mesh, batch), ref_params)
        run.log(metrics, *tokens)  # metrics of the pre-update forward; tokens/s, MFU: real tokens
        if eval_data is not None and run.eval_due():
            run.log_eval(evaluate(state[0]))
        run.checkpoint(state)

    # ---- outputs: the final model (LoRA merged) ----
    run.finish(lambda path: common.save_model(model, state[0], path))


if __name__ == "__main__":
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
