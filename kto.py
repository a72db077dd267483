r"""Kahneman-Tversky Optimization (KTO): learn from examples labelled good or bad, no pairs needed.

Ethayarajh et al. 2024 (arXiv:2402.01306), as TRL's KTOTrainer; also `--loss-type apo_zero_unpaired`.
Data: `prompt` / `completion` / `label` (TRL's unpaired format), or preference pairs, unpaired as TRL does.
    python kto.py --model gemma_2b --dataset my_labelled.jsonl
Offline, minutes on a laptop CPU (the defaults are for real models; `tiny` from scratch takes its own):
    python kto.py --model tiny --max-steps 40 --batch-size 32 --learning-rate 6e-4 --warmup-steps 5 --max-length 512
"""

import os
from dataclasses import dataclass
from functools import partial
from typing import Literal

import plumbing  # the run shell: shared flags, Run, the exit boundary (instant to import)

# `python kto.py --help`: from Args' source, before the imports below
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (mesh, models, data files, batches)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


@dataclass
class Args(plumbing.SharedArgs):
    """The shared flags (plumbing.SharedArgs: model, dtype, mesh, outputs, …) and KTO's own."""

    # data
    dataset: str = os.path.join(common.HERE, "data", "kto_train.jsonl")
    """`prompt`/`completion`/`label` rows or preference pairs: .jsonl/.json/.parquet, a HF dataset id / dir"""
    eval_dataset: str | None = os.path.join(common.HERE, "data", "kto_eval.jsonl")
    """held-out examples for eval/ metrics (same formats; the bundled file only with the bundled --dataset)"""
    eval_split: str | None = None
    """evaluate on this split (e.g. `test`) of --dataset, or of --eval-dataset if given (TRL's dataset_test_split)"""
    max_length: int = 1024
    """tokens per prompt + completion (TRL KTOConfig: 1024); longer: prompt cut from the left, then dropped"""
    group_by_length: bool = False
    """batches of similar lengths: each window of 50 batches sorted by length, dealt in a seeded order (TRL)"""
    # optimisation
    learning_rate: float = 1e-6
    """peak AdamW learning rate (TRL KTOConfig: 1e-6)"""
    grad_accum_steps: int = 1
    """micro-batches per update (memory ÷ this; same result: z₀ is estimated over the whole batch)"""
    # algorithm
    beta: float = 0.1
    """β: strength of the implicit KL penalty to the reference, the slope of the value function (Eq. 3)"""
    desirable_weight: float = 1.0
    """λ_D: weight of a desirable example's loss (Eq. 4); keep λ_D·n_D / (λ_U·n_U) in [1, 4/3] (Eq. 6)"""
    undesirable_weight: float = 1.0
    """λ_U: weight of an undesirable example's loss (Eq. 4)"""
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    """kto: the value of Eq. 3 around the reference point z₀ (Eq. 2); apo_zero_unpaired: APO-zero's
    unpaired loss, the same with z₀ = 0 (Eq. 5: no mismatched pairs, no KL forward)"""
    precompute_ref: bool = False
    """reference log-probs in one pass before training, no reference forward after (LoRA: the LoRA-off base)"""
    # logging and outputs
    export_hf: bool = False
    """also write the final model as a Hugging Face checkpoint, tokenizer and chat template in <output-dir>/model_hf/"""
    log_every: int = 10
    """fetch metrics from the device and log every N steps"""
    eval_every: int = 20
    """evaluate every N steps (and before the first and after the last)"""


# ---------------------------------------------------------------------------
# Data: (prompt, completion, label) texts -> token ids + masks, each with a mismatched pair -> batches
# ---------------------------------------------------------------------------
def read_examples(path, template, flag="--dataset", config=None, split="train"):
    """(prompt, completion, label) texts of TRL's unpaired rows (common.unpaired_example), or of preference
    pairs (prompt/chosen/rejected) unpaired as TRL's unpair_preference_dataset does: each chosen a desirable
    example, each rejected an undesirable one (all chosen first). TRL decides the form by the first row."""
    rows = common.read_rows(path, flag, config, split)
    if not (isinstance(rows[0][0], dict) and {"chosen", "rejected"} <= rows[0][0].keys()):
        return [common.unpaired_example(row, f"{path}:{line}", template) for row, line in rows]
    triples = [common.preference_triple(row, f"{path}:{line}", template) for row, line in rows]
    return [(p, c, True) for p, c, _ in triples] + [(p, r, False) for p, _, r in triples]


def tokenize_dataset(examples, tokenizer, max_length, path, seed, mismatched=True):
    """(prompt, completion, label) texts -> [((ids, mask) of the example[, of its mismatched pair]), label],
    and counts. ids = [BOS] + prompt + completion + [EOS]; the mask marks completion tokens and EOS. The
    mismatched pair (Eq. 2): the prompt with the completion of the example before it in an order drawn from
    `seed` (TRL's rotation by one, once over the data: batches are reshuffled each epoch, and --precompute-ref
    needs the pairs fixed). Too long: cut the prompt from the left (BOS kept) for both, then drop it."""
    # differs from dpo.py's: (prompt, completion, label) rows, each with the mismatched pair KTO's z0 needs
    pieces = [list(x) for x in tokenizer.tokenize([t for p, c, _ in examples for t in (p, c)])]  # one call
    prompts, completions = pieces[0::2], pieces[1::2]
    order = np.random.default_rng(seed).permutation(len(examples))
    other = np.empty_like(order)
    other[order] = np.roll(order, 1)  # other[i]: whose completion example i's mismatched pair takes
    out = []
    truncated = 0
    dropped = 0
    for i, (_, _, label) in enumerate(examples):
        prompt = prompts[i]
        responses = [completions[i]] + [completions[other[i]]] * mismatched
        cut = 2 + len(prompt) + max(map(len, responses)) - max_length
        if cut > len(prompt):
            dropped += 1
            continue
        if cut > 0:
            prompt = prompt[cut:]
            truncated += 1
        out.append(
            (
                tuple(
                    (
                        np.array(
                            [tokenizer.start_token_id] + prompt + response + [tokenizer.end_token_id],
                            np.int32,
                        ),
                        np.array([False] * (1 + len(prompt)) + [True] * (len(response) + 1), bool),
                    )
                    for response in responses
                ),
                label,
            )
        )
    if not out:
        raise common.UsageError(f"{path}: every example is longer than --max-length {max_length}")
    desirable = sum(label for _, label in out)
    return out, {
        "examples": len(out),
        "desirable": desirable,
        "undesirable": len(out) - desirable,
        "truncated": truncated,
        "dropped": dropped,
    }


def pad_examples(examples, length):
    """-> {completion,KL}_{ids,padding_mask,loss_mask}, each [N, length] (right padding; KL_ only with
    mismatched pairs), and label [N] (True: desirable)."""
    # differs from dpo.py's: an example and its mismatched pair (completion, KL), plus the label
    n = len(examples)
    data = {"label": np.array([label for _, label in examples], bool)}
    for j, name in enumerate(("completion", "KL")[: len(examples[0][0])]):
        ids = np.zeros((n, length), np.int32)
        pad = np.zeros((n, length), bool)
        mask = np.zeros((n, length), bool)
        for i, (sequences, _) in enumerate(examples):
            x, m = sequences[j]
            ids[i, : len(x)] = x
            pad[i, : len(x)] = True
            mask[i, : len(x)] = m
        data.update({f"{name}_ids": ids, f"{name}_padding_mask": pad, f"{name}_loss_mask": mask})
    return data


def example_lengths(data):
    """[N, k]: the real tokens of each example's k sequences (itself and its mismatched pair, if any)."""
    return np.stack(
        [
            data[f"{name}_padding_mask"].sum(-1)
            for name in ("completion", "KL")
            if f"{name}_padding_mask" in data
        ],
        -1,
    )


def get_batch(data, lengths, step, args):
    """Batch for `step` (a pure function of it, so --resume is exact), cut to the length bucket of
    its longest sequence: [A, B/A/P, T] per process; and its (real, padded) tokens over all processes."""
    # differs from simpo.py's: labels and precomputed log-probs are [N] (no T axis to cut); k sequences
    # an example
    idx, length, real = common.length_batch(
        lengths, step, args.batch_size, args.seed, args.max_length, group=args.group_by_length
    )
    # label and --precompute-ref's log-probs: [N], no T axis to cut
    cut = {k: v[idx, :length] if v.ndim > 1 else v[idx] for k, v in data.items()}
    batch = {k: v.reshape(args.grad_accum_steps, -1, *v.shape[1:]) for k, v in cut.items()}
    return batch, (real, lengths.shape[1] * args.batch_size * length)


# ---------------------------------------------------------------------------
# ALGO LOGIC: log-probs of completions and mismatched pairs, and the KTO loss
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


def concatenated_forward(backbone, params, frozen, batch, names=("completion", "KL")):
    """The `names` sequences of each example through the model in ONE forward (stacked on the batch axis):
    batch {name}_{ids,padding_mask,loss_mask}, each [B, T] -> per-sequence log-probs, [B] for each name,
    then the forward's aux_loss (token_logps)."""
    # differs from dpo.py's: the sequences are `names` (an example and its mismatched pair), summed
    # log-probs only
    both = {
        k: jnp.concatenate([batch[f"{name}_{k}"] for name in names])  # [len(names)·B, T]
        for k in ("ids", "padding_mask", "loss_mask")
    }
    logps, aux_loss = token_logps(backbone, params, frozen, both["ids"], both["padding_mask"])  # [nB, T-1]
    return (*jnp.split(sequence_logps(logps, both["loss_mask"]), len(names)), aux_loss)


def kto_loss(
    logps,
    ref_logps,
    kl_logps,
    ref_kl_logps,
    labels,
    *,
    beta=0.1,
    desirable_weight=1.0,
    undesirable_weight=1.0,
    loss_type="kto",
):
    """KTO on per-sequence log-probs -> (mean loss, metrics). logps, ref_logps, labels (True: desirable): [B];
    kl_logps, ref_kl_logps: [M], of mismatched pairs (z₀'s sample; unread for apo_zero_unpaired).
    r = logπ(y|x) − logπref(y|x) (Eq. 1); z₀ = max(0, the mean r of the mismatched pairs), detached (Eq. 2);
    per example (Eq. 3), weighted by λ_D or λ_U, then the batch mean (Eq. 4); equations: docs/kto.md.
      kto:               desirable 1 − σ(β(r − z₀)),  undesirable 1 − σ(β(z₀ − r))
      apo_zero_unpaired: the same with z₀ = 0 (Eq. 5)
    A mean over one kind of example is 0 where the batch has none (count/chosen or count/rejected: 0)."""
    logratios = logps - ref_logps  # r, [B]
    if loss_type == "kto":
        # z₀: the batch's mean log-ratio on mismatched pairs (on a mesh the batch axis spans every device, as
        # TRL's gather), clamped at 0, under stop_gradient: a reference point, not a target (TRL: .detach())
        kl = jnp.maximum(jax.lax.stop_gradient(kl_logps - ref_kl_logps).mean(), 0.0)
    elif loss_type == "apo_zero_unpaired":
        kl = jnp.zeros((), logratios.dtype)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    # ... losses below it
    losses = jnp.where(
        labels,
        1 - jax.nn.sigmoid(beta * (logratios - kl)),  # [B]: gains above z₀ ...
        1 - jax.nn.sigmoid(beta * (kl - logratios)),
    )
    weights = jnp.where(labels, desirable_weight, undesirable_weight)  # λ_y
    rewards, logps = jax.lax.stop_gradient((beta * logratios, logps))  # implicit reward β·r (TRL's)
    metrics = {}
    for kind, mask in (("chosen", labels), ("rejected", ~labels)):  # TRL's names: chosen = desirable
        n = mask.sum()
        metrics[f"rewards/{kind}"] = jnp.where(mask, rewards, 0.0).sum() / jnp.maximum(n, 1)  # 0 over none
        metrics[f"logps/{kind}"] = jnp.where(mask, logps, 0.0).sum() / jnp.maximum(n, 1)
        metrics[f"count/{kind}"] = n
    both = (metrics["count/chosen"] > 0) & (metrics["count/rejected"] > 0)
    margins = jnp.where(both, metrics["rewards/chosen"] - metrics["rewards/rejected"], 0.0)
    return (weights * losses).mean(), {"rewards/margins": margins, "kl": kl, **metrics}


def compute_loss(logps, args):
    """This run's loss on examples' log-probs -> (loss, metrics): kto_loss with the run's flags on
    {completion_logps, ref_completion_logps, label}, [B] each, with z₀ from {KL_logps, ref_KL_logps} (the
    whole batch's mismatched pairs; none for apo_zero_unpaired). The training step (each micro-batch's loss,
    the whole batch's metrics) and the evaluation call it, so a term added here is trained and evaluated
    alike."""
    return kto_loss(
        logps["completion_logps"],
        logps["ref_completion_logps"],
        logps.get("KL_logps"),
        logps.get("ref_KL_logps"),
        logps["label"],
        beta=args.beta,
        desirable_weight=args.desirable_weight,
        undesirable_weight=args.undesirable_weight,
        loss_type=args.loss_type,
    )


# Means over one kind of example, and the counts that weight each step's value in a --log-every interval's
# average (plumbing.Run's `counted`); margins: by the step's desirable × undesirable.
COUNTED = {
    "rewards/chosen": ("count/chosen",),
    "logps/chosen": ("count/chosen",),
    "rewards/rejected": ("count/rejected",),
    "logps/rejected": ("count/rejected",),
    "rewards/margins": ("count/chosen", "count/rejected"),
}


def reference_logps(backbone, ref_params, frozen, batch, names=("completion", "KL")):
    """πref log-probs of the `names` sequences: precomputed ones from the batch, else a reference forward."""
    # differs from dpo.py's: the sequences are `names` (an example, its mismatched pair), not chosen/rejected
    if "ref_completion_logps" in batch:
        return tuple(batch[f"ref_{name}_logps"] for name in names)
    # stop_gradient: the reference is frozen (no gradient into the shared `frozen`); its aux_loss is dropped
    return jax.lax.stop_gradient(concatenated_forward(backbone, ref_params, frozen, batch, names)[:-1])


def lora_off(backbone, params):
    """The LoRA-disabled reference: LoRA factors zeroed (ΔW = A·B = 0); the base weights stay
    in `frozen`, shared with the policy, so no second copy of the model exists."""
    return [
        jnp.zeros_like(p) if "lora_kernel" in v.path else jnp.copy(p)
        for v, p in zip(backbone.trainable_variables, params)
    ]


def precompute_reference_logps(backbone, ref_params, frozen, data, lengths, *, names, args, mesh):
    """--precompute-ref: πref's log-probs of every example's `names` sequences (itself, its mismatched pair) in
    one pass before training, so that no step runs a reference forward. data: {name}_{ids,padding_mask,
    loss_mask}, [N, T] each; lengths: [N, k] -> {ref_{name}_logps}, [N] each, in the data's order."""
    # differs from dpo.py's: the sequences are `names` (an example, its mismatched pair), not chosen/rejected

    # Weights are jit arguments, never closed over (that would bake them into the program as constants).
    @jax.jit
    def forward(ref_params, frozen, batch):
        batch = jax.tree.map(lambda x: x[0], batch)  # [1, B, ...] -> [B, ...]
        return concatenated_forward(backbone, ref_params, frozen, batch, names)[:-1]  # less the aux_loss

    logps = common.per_example(
        partial(forward, ref_params, frozen),
        data,
        args.batch_size,
        mesh,
        lengths=lengths,
        max_length=args.max_length,
    )
    return {f"ref_{name}_logps": x for name, x in zip(names, logps)}


# ---------------------------------------------------------------------------
# train_step: one optimizer update over `A` accumulated micro-batches
# ---------------------------------------------------------------------------
def train_step(backbone, optimizer, args, state, frozen, batch, ref_params):
    """state = (params, opt_state); batch arrays are [A, B/A, ...]; ref_params None if precomputed.
    `frozen` (non-trainable weights: the base model under LoRA) is an input only, neither donated
    nor returned: Keras keeps its buffers for saving. z₀: the whole batch's mismatched pairs, before
    any micro-batch's gradient (A changes nothing)."""
    params, opt_state = state
    accum = batch["completion_ids"].shape[0]

    def mismatched_logps(micro):  # π and πref log-probs of the mismatched pairs, [B/A] each: no gradients
        return {
            "KL_logps": jax.lax.stop_gradient(
                concatenated_forward(backbone, params, frozen, micro, ("KL",))[0]
            ),
            "ref_KL_logps": reference_logps(backbone, ref_params, frozen, micro, ("KL",))[0],
        }

    # z₀'s sample, the whole batch's [B] (apo_zero_unpaired reads none)
    z0 = jax.tree.map(jnp.ravel, jax.lax.map(mismatched_logps, batch)) if args.loss_type == "kto" else {}

    def micro_loss(p, micro):
        logps, aux_loss = concatenated_forward(backbone, p, frozen, micro, ("completion",))  # [B/A], scalar
        examples = {
            "completion_logps": logps,
            "ref_completion_logps": reference_logps(backbone, ref_params, frozen, micro, ("completion",))[0],
            "label": micro["label"],
        }
        loss, _ = compute_loss({**examples, **z0}, args)
        loss = loss + aux_loss  # + the policy's router load-balancing loss (a mixture of experts; 0.0 dense)
        return loss / accum, (jax.lax.stop_gradient(examples), aux_loss)  # equal micro-batches

    def accumulate(grads, micro):
        (_, out), g = jax.value_and_grad(micro_loss, has_aux=True)(params, micro)
        return jax.tree.map(jnp.add, grads, g), out

    grads, (examples, aux_loss) = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # The loss and metrics of the whole batch, [A, B/A] -> [B] (the loss: the sum of the micro-batches')
    loss, metrics = compute_loss({**jax.tree.map(jnp.ravel, examples), **z0}, args)
    return (params, opt_state), {
        "train/loss": loss + aux_loss.mean(),
        "aux_loss": aux_loss.mean(),
        **metrics,
        "train/grad_norm": optax.global_norm(grads),
    }


def main(args):
    # ---- set-up: every flag, file and row checked before the model loads ----
    run = plumbing.Run(
        __file__,
        args,
        log_every=args.log_every,
        eval_every=args.eval_every,  # nothing written yet
        grad_accum_steps=args.grad_accum_steps,
        export_hf=args.export_hf,
    )
    if args.beta <= 0 or min(args.desirable_weight, args.undesirable_weight) < 0:
        raise common.UsageError("need --beta > 0, --desirable-weight >= 0 and --undesirable-weight >= 0")
    template = common.chat_template(args.model, args.chat_template)
    eval_path, eval_split, eval_flag = common.eval_source(
        args.dataset, args.eval_dataset, args.eval_split, (Args.dataset, Args.eval_dataset)
    )
    eval_rows = (
        read_examples(eval_path, template, flag=eval_flag, config=args.dataset_config, split=eval_split)
        if eval_path
        else []
    )
    train_rows = read_examples(args.dataset, template, config=args.dataset_config, split=args.dataset_split)
    max_steps = run.resolve_max_steps(len(train_rows))  # --max-steps, or --num-epochs' worth of examples
    model = common.load_model(
        args.model, run.mesh, run.dtype, args.seed, logits_chunk=args.logits_chunk, **args.lora
    )
    remat = plumbing.Remat(args.remat, model.backbone)  # --remat: a checkpoint switch on each decoder block
    backbone, tokenizer = model.backbone, model.preprocessor.tokenizer
    mismatched = args.loss_type == "kto"  # z₀'s mismatched pairs (apo_zero_unpaired: z₀ = 0, none)
    names = ("completion", "KL") if mismatched else ("completion",)
    tokenize = partial(
        tokenize_dataset,
        tokenizer=tokenizer,
        max_length=args.max_length,
        seed=args.seed,
        mismatched=mismatched,
    )
    train, counts = tokenize(train_rows, path=args.dataset)
    evals = tokenize(eval_rows, path=eval_path)[0] if eval_rows else []
    print(
        "data: {examples} examples ({desirable} desirable, {undesirable} undesirable; {truncated} prompt-truncated, "
        "{dropped} dropped as too long); ".format(**counts)
        + f"{len(evals)} eval examples"
    )
    # Host arrays at the run's longest bucket; each batch is cut to its own (common.bucket_length).
    length = common.bucket_length(max(len(s[0]) for x, _ in train + evals for s in x), args.max_length)
    train_data, eval_data = pad_examples(train, length), pad_examples(evals, length) if evals else None
    lengths, eval_lengths = example_lengths(train_data), example_lengths(eval_data) if evals else None

    # over max_steps, unless resumed (run.schedule_steps)
    optimizer, schedule, warmup = plumbing.make_optimizer(args, run.schedule_steps)
    params, frozen = common.split_variables(backbone, frozen_dtype=run.frozen_dtype)
    opt_state, opt_shardings = common.init_optimizer(optimizer, params, run.mesh)
    # The reference πref = the initial policy, three ways: LoRA-off base (no copy), a frozen copy,
    # or (--precompute-ref) its log-probs stored per example (and per mismatched pair) before training.
    ref_params = None  # the weights of the online reference forward; None: its log-probs are precomputed
    if args.precompute_ref:  # the log-probs join the data, [N] each like the labels (get_batch, per_example)
        initial = lora_off(backbone, params) if args.lora_rank else params  # read here, before any update
        precompute = partial(
            precompute_reference_logps, backbone, initial, frozen, names=names, args=args, mesh=run.mesh
        )
        train_data.update(precompute(train_data, lengths))
        if eval_data is not None:
            eval_data.update(precompute(eval_data, eval_lengths))
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
        donate_argnums=0,
        out_shardings=(state_shardings, common.replicated(run.mesh)),
    )
    # args.json: the mode --remat auto chose, the warmup steps
    run.record(remat=remat, num_warmup_steps=warmup)

    # Weights are jit arguments, never closed over (that would bake them into the program as constants).
    @jax.jit
    def eval_fn(params, ref_params, frozen, batch):  # [1, B, ...] -> what compute_loss reads, [B] each
        batch = jax.tree.map(lambda x: x[0], batch)
        policy = concatenated_forward(backbone, params, frozen, batch, names)[:-1]  # less the aux_loss
        ref = reference_logps(backbone, ref_params, frozen, batch, names)
        logps = {f"{name}_logps": x for name, x in zip(names, policy)}
        return {**logps, **{f"ref_{name}_logps": x for name, x in zip(names, ref)}, "label": batch["label"]}

    # every eval example's log-probs, then the loss over all of them (z₀: every mismatched pair)
    def evaluate(params):
        logps = common.per_example(
            partial(eval_fn, params, ref_params, frozen),
            eval_data,
            args.batch_size,
            run.mesh,
            lengths=eval_lengths,
            max_length=args.max_length,
        )
        loss, metrics = compute_loss(logps, args)
        return {"eval/loss": loss, **{f"eval/{k}": v for k, v in metrics.items()}}  # Run prints the first 3

    # ---- the loop: batch -> step -> log -> eval -> checkpoint ----
    # FLOPs per token (docs/design.md): an example 6N (forward + backward) + 2N (online reference), its
    # mismatched pair 2N + 2N: 6N averaged over both (4N precomputed); apo_zero_unpaired: 8N (6N).
    flops_per_token = (6 - 2 * mismatched + 2 * (not args.precompute_ref)) * plumbing.count_params(backbone)
    if eval_data is not None and run.start == 0:
        run.log_eval(evaluate(state[0]))  # the starting point: policy == reference
    for step in run.steps(flops_per_token, schedule, show=("rewards/margins", "kl"), counted=COUNTED):
        batch, tokens = get_batch(train_data, lengths, step, args)  # tokens: (real, padded)
        state, metrics = step_fn(state, frozen, common.shard_batch(run.mesh, batch), ref_params)
        run.log(metrics, *tokens)  # metrics of the pre-update forward; tokens/s, MFU: real tokens
        if eval_data is not None and run.eval_due():
            run.log_eval(evaluate(state[0]))
        run.checkpoint(state)

    # ---- outputs: the final model (LoRA merged) ----
    run.finish(lambda path: common.save_model(model, state[0], path))


if __name__ == "__main__":
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
