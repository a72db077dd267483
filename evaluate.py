"""Evaluate any model on held-out prompts with one protocol: task score, win rate, KL, length.

Greedy and sampled responses from grpo.py's KV-cached sampler (imported, not copied); scores from a
`--reward-fn` and/or a reward.py `--reward-model`; win rate and KL(model || baseline) against a `--baseline`.
    python evaluate.py --model runs/dpo…/model --baseline runs/sft…/model
Offline (toy task, bundled held-out prompts):
    python evaluate.py --model tiny --baseline tiny --max-new-tokens 16
"""

import json
import math
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Literal, NamedTuple

import plumbing  # the exit boundary and fast --help (instant to import)

# `python evaluate.py --help`: from Args' source, before the imports below
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (mesh, models, data files, the scorer)
from grpo import generate, response_logps, tokenize_prompts, truncate_response  # noqa: E402  (the RL scripts')
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


@dataclass
class Args:  # not plumbing.SharedArgs: an evaluation has no training flags
    # models
    model: str = "tiny"
    """the model to evaluate: any --model form (alias, preset, handle, local dir, a run's model/ dir, `tiny`)"""
    chat_template: (
        Literal["gemma", "gemma4", "gemma4_large", "llama3", "mistral", "chatml", "qwen3.5"] | None
    ) = None
    """how chats (message lists) are rendered; None: --model's family's (Gemma 1-3: gemma, Gemma 4: gemma4,
    or gemma4_large at 26B-A4B / 31B, Llama 3: llama3, Mistral: mistral, Qwen 2.5 / 3: chatml, Qwen 3.5: qwen3.5)"""
    baseline: str | None = None
    """model to compare against (win rate, KL); same tokenizer as --model"""
    dtype: Literal["bfloat16", "float32"] | None = None
    """compute dtype, which the weights are held in too (nothing is trained). None: bfloat16 on TPU/GPU,
    float32 on CPU"""
    mesh: str | None = None
    """device mesh, e.g. `data=4,model=2`; None: every device on `data`"""
    # data and scorers
    prompts: str = os.path.join(common.HERE, "data", "prompts_eval.jsonl")
    """held-out prompts (`prompt`: string or message list): .jsonl/.json/.parquet or a HF dataset"""
    prompts_config: str | None = None
    """the configuration of a Hub dataset --prompts, e.g. `main` for gsm8k"""
    prompts_split: str | None = None
    """the split of --prompts, e.g. `test`; None: its only split (a file is one)"""
    num_prompts: int = 200
    """evaluate the first N prompts (0: all)"""
    reward_fn: tuple[str, ...] = (os.path.join(common.HERE, "data", "toy.py") + ":batch_score",)
    """`path.py:function`s (TRL's f(prompts, completions, **columns), or f(prompts, responses)), summed with
    --reward-weights: the task score (as grpo.py scores its rollouts)"""
    reward_weights: tuple[float, ...] = ()
    """one weight per --reward-fn (empty: all 1.0), as TRL's reward_weights"""
    reward_model: str | None = None
    """reward.py's `model/` dir: a second scorer (rm_* numbers)"""
    # generation
    max_prompt_length: int = 512
    """prompt tokens (BOS included); longer prompts are cut from the left (grpo.py's default; a batch is padded
    only to its own longest prompt's bucket)"""
    max_new_tokens: int = 256
    """tokens generated per prompt, at most (all stop once every response has ended; each is cut after its
    first stop token); grpo.py's --response-length and TRL's max_completion_length: 256"""
    stop_token: tuple[str, ...] = ()
    """tokens (text, else an id) that also end a response, besides the EOS and the chat template's turn end
    (grpo.py's --stop-token)"""
    temperature: float = 1.0
    """sampling temperature of the sampled responses (1.0: KL is the models' own KL)"""
    top_p: float = 1.0
    """top-p of the sampled responses: the likeliest tokens that hold this probability mass (1.0 = off)"""
    top_k: int = 0
    """top-k of the sampled responses: the k likeliest only (0 = off); any filter on: `kl` is over its samples"""
    min_p: float | None = None
    """min-p of the sampled responses: drop tokens under min_p × the top token's probability (None = off)"""
    batch_size: int = 64
    """prompts per generation batch (the last one is padded: one compiled shape)"""
    seed: int = 0
    """seeds the sampled responses (same seed, same numbers)"""
    # outputs
    output_dir: str | None = None
    """None: the run dir holding --model (…/eval), else runs/eval__{model}__{seed}__{time}"""
    num_examples: int = 8
    """example generations written to samples.jsonl"""
    overwrite: bool = False
    """replace an evaluation already in --output-dir (otherwise refused)"""


# ---------------------------------------------------------------------------
# Sampling: grpo.py's (tokenize_prompts: left-padded query ids; generate: jitted KV-cached sampling with the
# filters top-k, top-p, min-p, stopping once every response has reached a stop token; truncate_response;
# response_logps: the log-probs of the distribution sampled from), imported so that an evaluation samples and
# scores exactly as the RL scripts do
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# EVAL LOGIC: pure functions of scores and log-probs
# ---------------------------------------------------------------------------
def win_rate(scores, baseline_scores):
    """Fraction of prompts where the model's score beats the baseline's; ties count half."""
    s, b = np.asarray(scores, np.float64), np.asarray(baseline_scores, np.float64)
    return float(np.mean((s > b) + 0.5 * (s == b)))


def sequence_kl(logps, baseline_logps, response_mask):
    """Per-prompt KL estimate Σ_t [log π(y_t) − log π_base(y_t)] over real response tokens: [B].

    y ~ π (the model's own samples), so the mean over prompts estimates KL(π || π_base);
    prompt and padding are outside `response_mask` (response tokens up to and with the EOS).
    """
    # differs from rloo.py's: a KL between any two models' log-probs of the same samples (upcast to float32)
    diff = jnp.asarray(logps, jnp.float32) - jnp.asarray(baseline_logps, jnp.float32)
    return jnp.sum(jnp.where(response_mask, diff, 0.0), axis=1)


def response_lengths(responses, sequence_lengths, stop_ids):
    """Response length in tokens, the stop token (EOS, turn end) not counted (none: all R tokens)."""
    has_eos = np.isin(np.asarray(responses), np.asarray(stop_ids)).any(1)
    return np.where(has_eos, np.asarray(sequence_lengths), responses.shape[1]), has_eos


# ---------------------------------------------------------------------------
# Running the protocol: policies, batches, scores
# ---------------------------------------------------------------------------
class Policy(NamedTuple):
    name: str
    model: object  # the KerasHub CausalLM
    params: list  # trainable weight values (stateless_call order)
    frozen: list  # non-trainable weight values
    fns: dict  # jitted generate / log-prob functions, shared by policies of one architecture


def make_fns(backbone, args, stops, pad):
    """Jitted sampling and log-probs: the policy's of the distribution it sampled from (filtered), the
    baseline's of logits / T alone (as grpo.py's reference: a filtered one's support is not the policy's)."""
    r = args.max_new_tokens
    t = args.temperature
    filters = {"top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p}

    def jitted_logps(**f):  # -> fn(params, frozen, ids, mask, q) -> [B, R], q (the query width) static
        def fn(params, frozen, ids, mask, q):
            logps, _, _ = response_logps(
                backbone, params, frozen, ids, mask, context_length=q, temperature=t, **f
            )
            return logps

        return jax.jit(fn, static_argnums=4)

    return {
        "greedy": jax.jit(
            partial(generate, backbone, response_length=r, temperature=0.0, stop_ids=stops, pad_id=pad)
        ),
        "sampled": jax.jit(
            partial(
                generate, backbone, response_length=r, temperature=t, stop_ids=stops, pad_id=pad, **filters
            )
        ),
        "logps": jitted_logps(**filters),
        "ref_logps": jitted_logps(),
    }


def compute_dtype(args):
    return args.dtype or common.default_dtype()


def load_policy(name, mesh, args, like=None, flag="--model"):
    """Load a model; with `like` (a Policy of the same architecture) its compiled functions are reused."""
    common.check_sampler(name, flag)
    model = common.load_model(name, mesh, args.dtype, args.seed)
    # nothing is trained: every weight held in the compute dtype (half the memory under bfloat16)
    params, frozen = common.split_variables(model.backbone, frozen_dtype=compute_dtype(args), all_frozen=True)
    same = like is not None and like.model.backbone.get_config() == model.backbone.get_config()
    tokenizer = model.preprocessor.tokenizer
    stops = common.stop_token_ids(tokenizer, common.chat_template(name, args.chat_template), args.stop_token)
    return Policy(
        name,
        model,
        params,
        frozen,
        like.fns if same else make_fns(model.backbone, args, stops, tokenizer.pad_token_id),
    )


def batched(fn, arrays, batch_size, query_mask):
    """fn(i, rows, drop, *batch) over rows of host arrays [N, ...] in fixed-size batches i (the last one padded
    with repeats), rows: the batch's row indices, drop: the leading query columns [N, Q] no prompt of the batch
    uses (Q minus its longest prompt's bucket: a batch compiles once per bucket met) -> host outputs [N, ...]."""
    n = len(arrays[0])
    outs = []
    for i, start in enumerate(range(0, n, batch_size)):
        idx = np.minimum(np.arange(start, start + batch_size), n - 1)
        q = query_mask.shape[1]
        drop = q - common.bucket_length(int(query_mask[idx].sum(1).max()), q)
        outs.append(jax.device_get(fn(i, idx, drop, *[a[idx] for a in arrays])))
    return jax.tree.map(lambda *xs: np.concatenate(xs)[:n], *outs)


def respond(policy, data, kind, key, batch_size, mesh):
    """Greedy or sampled responses to every prompt -> dict of host arrays and decoded texts."""
    put = partial(jax.device_put, device=NamedSharding(mesh, P("data")))

    def gen(i, rows, drop, qs, qm):  # the batch's bucket of columns
        tokens = policy.fns[kind](
            policy.params, policy.frozen, put(qs[:, drop:]), put(qm[:, drop:]), jax.random.fold_in(key, i)
        )[0]
        return truncate_response(tokens, data["stops"], data["pad"])

    responses, seq_lens = batched(gen, (data["queries"], data["query_mask"]), batch_size, data["query_mask"])
    lengths, has_eos = response_lengths(responses, seq_lens, data["stops"])
    ids = [list(x[:n]) for x, n in zip(responses, lengths)]
    texts = data["tokenizer"].detokenize(ids) if len(lengths) else []
    texts = [t.decode() if isinstance(t, bytes) else str(t) for t in texts]
    return {
        "responses": responses,
        "sequence_lengths": seq_lens,
        "lengths": lengths,
        "has_eos": has_eos,
        "texts": texts,
        "ids": ids,
    }


def full_sequences(data, out):
    """queries ++ responses [N, Q+R] and their padding mask (response tokens up to and with the EOS)."""
    r = out["responses"].shape[1]
    response_mask = np.arange(r)[None] <= out["sequence_lengths"][:, None]
    return (
        np.concatenate([data["queries"], out["responses"]], 1),
        np.concatenate([data["query_mask"], response_mask], 1),
        response_mask,
    )


def score(scorers, data, out, batch_size, mesh):
    """Adds each scorer's scores per prompt (`score`: --reward-fn's, `rm_score`: --reward-model's) to a
    response dict, in the generation's fixed-size batches (the reward model compiles once)."""
    ids, mask, _ = full_sequences(data, out)
    put = partial(jax.device_put, device=NamedSharding(mesh, P("data")))
    for name, scorer in scorers.items():
        if scorer is not None:

            def scores(i, rows, drop, ids, m):  # the batch's bucket of columns
                return scorer(
                    [data["prompts"][j] for j in rows],
                    [out["texts"][j] for j in rows],
                    {"query_responses": put(ids[:, drop:]), "padding_mask": put(m[:, drop:])},
                    rows=[data["rows"][j] for j in rows],
                    completion_ids=[out["ids"][j] for j in rows],
                    end=common.turn_end(data["template"]),
                )[0]

            out[name] = batched(scores, (ids, mask), batch_size, data["query_mask"]).astype(np.float64)
    return out


def evaluate_policy(policy, data, scorer, args, mesh, baseline=None):
    """The protocol for one model: greedy and sampled responses, their scores, and (with a
    baseline) per-prompt KL(policy || baseline) on the policy's own sampled responses."""
    key = jax.random.key(args.seed)
    q = data["queries"].shape[1]
    bs = data["batch_size"]
    put = partial(jax.device_put, device=NamedSharding(mesh, P("data")))
    outs = {
        kind: score(scorer, data, respond(policy, data, kind, key, batch_size=bs, mesh=mesh), bs, mesh)
        for kind in ("greedy", "sampled")
    }
    if baseline is not None:
        ids, mask, response_mask = full_sequences(data, outs["sampled"])

        def kl_of(i, rows, drop, ids, m, rm):  # the prompt columns cut to the batch's bucket
            ids, m = put(ids[:, drop:]), put(m[:, drop:])
            logps = policy.fns["logps"](policy.params, policy.frozen, ids, m, q - drop)
            baseline_logps = baseline.fns["ref_logps"](baseline.params, baseline.frozen, ids, m, q - drop)
            return sequence_kl(logps, baseline_logps, put(rm))

        outs["kl"] = batched(kl_of, (ids, mask, response_mask), bs, data["query_mask"])
    return outs


def summarize(outs, baseline_outs=None):
    """Per-prompt arrays -> the numbers of eval.json (means over prompts)."""
    g, s = outs["greedy"], outs["sampled"]
    m = {
        "length": float(g["lengths"].mean()),
        "length_sampled": float(s["lengths"].mean()),
        "eos_rate": float(g["has_eos"].mean()),
    }
    for name in ("score", "rm_score"):
        if name in g:
            m[name], m[name + "_sampled"] = float(np.mean(g[name])), float(np.mean(s[name]))
            if baseline_outs is not None:
                m["baseline_" + name] = float(np.mean(baseline_outs["greedy"][name]))
                key = {"score": "win_rate", "rm_score": "win_rate_rm"}[name]
                m[key] = win_rate(g[name], baseline_outs["greedy"][name])
    if "kl" in outs:
        m["kl"] = float(np.mean(outs["kl"]))
        m["kl_stderr"] = float(np.std(outs["kl"]) / math.sqrt(len(outs["kl"])))
    return m


def per_prompt(outs, baseline_outs=None):
    """Per-prompt arrays [N] behind summarize's means (scores.npz; compare.py's paired intervals):
    score, rm_score (+ _sampled), length (+ _sampled), kl, and win (1 / ½ / 0 against the baseline)."""
    g, s = outs["greedy"], outs["sampled"]
    arrays = {"length": g["lengths"], "length_sampled": s["lengths"]}
    for name in ("score", "rm_score"):
        if name in g:
            arrays[name], arrays[name + "_sampled"] = g[name], s[name]
    if baseline_outs is not None and "score" in g:
        b = baseline_outs["greedy"]["score"]
        arrays["win"] = (g["score"] > b) + 0.5 * (g["score"] == b)
    if "kl" in outs:
        arrays["kl"] = outs["kl"]
    return {k: np.asarray(v, np.float64) for k, v in arrays.items()}


def examples(outs, data, n, baseline_outs=None):
    """The first n prompts with their greedy and sampled responses (and scores) for samples.jsonl."""
    rows = []
    for i in range(min(n, len(data["prompts"]))):
        row = {"prompt": data["prompts"][i]}
        for kind in ("greedy", "sampled"):
            row[kind] = outs[kind]["texts"][i]
            row.update(
                {f"{kind}_{k}": float(outs[kind][k][i]) for k in ("score", "rm_score") if k in outs[kind]}
            )
        if baseline_outs is not None:
            row["baseline_greedy"] = baseline_outs["greedy"]["texts"][i]
        rows.append(row)
    return rows


def check_args(args, mesh):
    """Every flag and file, before any model loads -> (prompt texts: the first --num-prompts,
    the Scorer of --reward-fn or None)."""
    if args.max_new_tokens < 1 or args.temperature <= 0 or args.num_prompts < 0 or args.batch_size < 1:
        raise common.UsageError(
            "--max-new-tokens and --batch-size must be >= 1, --temperature > 0, --num-prompts >= 0"
        )
    if not 0 < args.top_p <= 1 or args.top_k < 0 or not 0 <= (args.min_p or 0) <= 1:
        raise common.UsageError("--top-p must be in (0, 1], --top-k >= 0 (0: off), --min-p in [0, 1]")
    if args.batch_size % mesh.shape["data"]:
        raise common.UsageError(
            f"--batch-size {args.batch_size} must divide by the data axis ({mesh.shape['data']})"
        )
    if not args.reward_fn and not args.reward_model:
        raise common.UsageError("give --reward-fn and/or --reward-model: nothing to score with")
    common.check_sampler(args.model, "--model")
    if args.baseline:
        common.check_sampler(args.baseline, "--baseline")
    reward_fn = (
        common.load_scorer(mesh, reward_fns=args.reward_fn, weights=args.reward_weights)
        if args.reward_fn
        else None
    )
    if args.reward_model:
        common.check_reward_model(args.reward_model)
    template = common.chat_template(args.model, args.chat_template)
    prompts, rows = common.read_prompts(
        args.prompts, template, "--prompts", args.prompts_config, args.prompts_split
    )
    if reward_fn is not None:
        reward_fn.check_columns(rows, "--prompts")  # before any model loads
    n = min(args.num_prompts or len(prompts), len(prompts))
    scored_by = args.reward_fn + ((f"the reward model {args.reward_model}",) if args.reward_model else ())
    print(  # the first line: what is scored, and by what
        f"eval: the first {n} of {len(prompts)} prompts in --prompts {args.prompts}"
        + (f" (split {args.prompts_split})" if args.prompts_split else "")
        + f", scored by {' + '.join(scored_by)}; greedy and sampled (T={args.temperature}, seed {args.seed}), "
        f"{args.max_new_tokens} new tokens; baseline: {args.baseline}"
    )
    return prompts[:n], rows[:n], reward_fn


def prepare(args, mesh, prompts, rows, tokenizer):
    """Prompt texts -> left-padded queries and the fixed generation batch size; `rows`: the dataset rows
    (what reward functions read)."""
    queries, query_mask = tokenize_prompts(prompts, tokenizer, args.max_prompt_length)
    d = mesh.shape["data"]
    template = common.chat_template(args.model, args.chat_template)
    return {
        "prompts": prompts,
        "rows": rows,
        "queries": queries,
        "query_mask": query_mask,
        "tokenizer": tokenizer,
        "stops": common.stop_token_ids(tokenizer, template, args.stop_token),
        "pad": tokenizer.pad_token_id,
        "template": template,
        "batch_size": min(args.batch_size, d * math.ceil(len(prompts) / d)),
    }


def check_same_tokens(name, model, data, args, what):
    """Win rate, KL and reward-model scores compare token ids: the prompts, rendered with the
    chat template of `name`'s family and tokenized by `model`, must be --model's."""
    template = common.chat_template(name, args.chat_template)
    prompts = (
        data["prompts"]
        if template == data["template"]
        else common.read_dataset(
            args.prompts,
            "prompt",
            template,
            flag="--prompts",
            config=args.prompts_config,
            split=args.prompts_split,
        )
    )
    prompts = prompts[: len(data["prompts"])]
    queries, _ = tokenize_prompts(prompts, model.preprocessor.tokenizer, args.max_prompt_length)
    if queries.shape != data["queries"].shape or (queries != data["queries"]).any():
        raise common.UsageError(
            f"{what} {name}: its tokenizer differs from --model's; KL and scores need the same one"
        )


def make_scorer(args, mesh, data, reward_fn):
    """{"score": the Scorer of --reward-fn (check_args'), "rm_score": of --reward-model}, None where not given."""
    rm = None
    if args.reward_model:
        rm = common.load_scorer(
            mesh, args.dtype, frozen_dtype=compute_dtype(args), reward_model=args.reward_model
        )
    if rm is not None:
        check_same_tokens(args.reward_model, rm.model, data, args, "--reward-model")
    return {"score": reward_fn, "rm_score": rm}


def default_eval_dir(args):
    model = os.path.normpath(args.model)
    if os.path.isdir(model) and os.path.basename(model) == "model":
        return os.path.join(os.path.dirname(model), "eval")  # a run's model/ -> that run's eval/
    return plumbing.default_output_dir("eval", args.model, args.seed)


def write_outputs(output_dir, metrics, samples, arrays=None):
    """eval.json (the numbers), samples.jsonl (examples), scores.npz (per-prompt arrays, when given)."""
    os.makedirs(output_dir, exist_ok=True)
    if arrays is not None:
        np.savez(os.path.join(output_dir, "scores.npz"), **arrays)
    with open(os.path.join(output_dir, "eval.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    with open(os.path.join(output_dir, "samples.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in samples)


def main(args):
    t0 = time.perf_counter()
    # ---- set-up: every flag and file checked before any model loads ----
    mesh = common.make_mesh(args.mesh)
    output_dir = args.output_dir or default_eval_dir(args)
    if os.path.exists(os.path.join(output_dir, "eval.json")) and not args.overwrite:
        raise common.UsageError(
            f"--output-dir {output_dir} already holds an evaluation (eval.json); pass "
            "--overwrite to replace it, or choose another --output-dir"
        )
    prompts, rows, reward_fn = check_args(args, mesh)
    policy = load_policy(args.model, mesh, args)
    data = prepare(args, mesh, prompts, rows, policy.model.preprocessor.tokenizer)
    scorer = make_scorer(args, mesh, data, reward_fn)
    baseline = None
    if args.baseline:
        baseline = load_policy(args.baseline, mesh, args, like=policy, flag="--baseline")
        check_same_tokens(args.baseline, baseline.model, data, args, "--baseline")
    outs = evaluate_policy(policy, data, scorer, args, mesh, baseline=baseline)
    base_outs = evaluate_policy(baseline, data, scorer, args, mesh) if baseline is not None else None
    metrics = {
        "model": args.model,
        "baseline": args.baseline,
        "prompts": args.prompts,
        "prompts_config": args.prompts_config,
        "prompts_split": args.prompts_split,
        "num_prompts": len(data["prompts"]),
        "seed": args.seed,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "max_new_tokens": args.max_new_tokens,
        "reward_fn": list(args.reward_fn),
        "reward_model": args.reward_model,
        **summarize(outs, base_outs),
        "eval_seconds": time.perf_counter() - t0,
    }
    write_outputs(
        output_dir, metrics, examples(outs, data, args.num_examples, base_outs), per_prompt(outs, base_outs)
    )
    for k, v in metrics.items():
        if isinstance(v, float):
            print(f"{k:>20}: {v:.4f}")
    print(f"done: {output_dir}/eval.json, samples.jsonl, scores.npz")


if __name__ == "__main__":
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
