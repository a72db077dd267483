"""Rollout speed: grpo.py's sampler, which stops once every completion has sampled its EOS, against the
fixed-length sampler it replaced (grpo.py at the git revision --before), on the same weights, prompts
and keys.

    python benchmarks/rollout.py --model runs/sft…/model --response-length 256

Each round draws B/G prompts × G completions and runs grpo.py's own `rollout` (sampler, then the cut after
EOS) once per sampler, both on the same key, in alternating order, so both see the same machine load; the
first rollout of each (compilation) is timed apart. The two must return the same responses (checked every
round). Prints one JSON line per sampler: median generate seconds, the per-round time ratio (median), tokens
sampled up to and with each EOS per second ("completion tokens"), and decode slots B × steps per second.
"""

import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import plumbing  # noqa: E402  (instant: `--help` below answers before the heavy imports)

plumbing.answer_help(__name__, __file__)

import common  # noqa: E402
import grpo  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


@dataclass
class Args:
    model: str = "tiny"
    """any --model form; a trained model (an SFT run's model/) ends completions early, random `tiny` rarely"""
    dataset: str = os.path.join(ROOT, "data", "prompts_train.jsonl")
    """prompts, as grpo.py's --dataset"""
    batch_size: int = 64
    """B completions per rollout (B/G prompts)"""
    num_generations: int = 8
    """G completions per prompt"""
    response_length: int = 256
    """R: the fixed-length sampler always samples R tokens; the other stops at the batch's last EOS"""
    max_prompt_length: int = 64
    """prompt tokens, as grpo.py's flag"""
    temperature: float = 1.0
    """sampling temperature"""
    rounds: int = 7
    """timed rollouts per sampler (after one compiling rollout each)"""
    before: str = "fcada26"
    """git revision whose grpo.py has the fixed-length sampler (a `lax.scan` over all R steps)"""
    dtype: str | None = None
    """compute dtype; None: bfloat16 on accelerators, float32 on CPU"""
    seed: int = 0
    """the prompts drawn and the sampling keys"""


def module_at(revision, name):
    """`name`.py as it was at a git revision, imported as the module `<name>_at_<revision>`."""
    source = subprocess.run(
        ["git", "show", f"{revision}:{name}.py"], cwd=ROOT, capture_output=True, text=True
    )
    if source.returncode:
        raise plumbing.UsageError(f"--before {revision}: {source.stderr.strip()}")
    path = os.path.join(tempfile.mkdtemp(), f"{name}_at_{revision}.py")
    with open(path, "w") as f:
        f.write(source.stdout)
    spec = importlib.util.spec_from_file_location(f"{name}_at_{revision}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(args):
    if args.batch_size % args.num_generations or args.rounds < 1:
        raise plumbing.UsageError("--batch-size must be a multiple of --num-generations; --rounds >= 1")
    old = module_at(args.before, "grpo")
    mesh = common.make_mesh(None)
    model = common.load_model(args.model, mesh, args.dtype, args.seed)
    backbone, tokenizer = model.backbone, model.preprocessor.tokenizer
    prompts, _ = common.read_prompts(args.dataset, common.chat_template(args.model, None))
    queries, query_mask = grpo.tokenize_prompts(prompts, tokenizer, args.max_prompt_length)
    params, frozen = common.split_variables(backbone)
    # through one jit, as grpo.py's main: the values carry the mesh in their types
    params = jax.jit(lambda p: jax.tree.map(lambda x: x.copy(), p), out_shardings=common.shardings(params))(
        params
    )
    b = args.batch_size
    g = args.num_generations
    r = args.response_length
    t = args.temperature
    eos, pad = tokenizer.end_token_id, tokenizer.pad_token_id

    def fixed_length(params, frozen, queries, query_mask, key):  # -> (responses [B, R], R decode steps, 0)
        responses = old.generate(
            backbone, params, frozen, queries, query_mask, key=key, response_length=r, temperature=t
        )
        return responses, r, jnp.zeros(responses.shape)  # rollout's third: the sampler's log q, unused here

    samplers = {  # each -> (responses [B, R], decode steps, the sampler's log q [B, R])
        "fixed_length": jax.jit(fixed_length),
        "early_stop": jax.jit(
            functools.partial(
                grpo.generate, backbone, response_length=r, temperature=t, stop_ids=eos, pad_id=pad
            )
        ),
    }
    on_data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    rng, key = np.random.default_rng(args.seed), jax.random.key(args.seed)
    rows = {name: [] for name in samplers}
    for round_ in range(args.rounds + 1):  # round 0 compiles
        idx = np.repeat(rng.choice(len(prompts), b // g, replace=False), g)
        k = jax.random.fold_in(key, round_)
        names = list(samplers) if round_ % 2 == 0 else list(samplers)[::-1]
        out = {}
        for name in names:
            t0 = time.perf_counter()
            batch, lengths = grpo.rollout(
                samplers[name],
                params,
                frozen,
                queries[idx],
                query_mask[idx],
                key=k,
                stop_ids=eos,
                pad_id=pad,
                on_data=on_data,
            )
            seconds = plumbing.synced(batch) - t0
            out[name] = common.to_host(batch["query_responses"])
            real = common.to_host(lengths) + 1  # sampled tokens up to and with the EOS (R without one)
            rows[name].append({"seconds": seconds, "tokens": int(real.sum()), "steps": int(real.max())})
        if not (out["fixed_length"] == out["early_stop"]).all():
            raise RuntimeError(f"round {round_}: the two samplers returned different responses")
        print(
            f"round {round_}: "
            + ", ".join(f"{n} {rows[n][-1]['seconds']:.3f} s" for n in names)
            + f"; longest completion {rows['early_stop'][-1]['steps']} tokens",
            file=sys.stderr,
            flush=True,
        )
    return report(args, rows, queries.shape[1])


def report(args, rows, q):
    """One JSON line per sampler from its rounds (round 0, the compiling one, apart)."""
    b, r = args.batch_size, args.response_length
    ratios = [f["seconds"] / e["seconds"] for f, e in zip(rows["fixed_length"][1:], rows["early_stop"][1:])]
    results = []
    for name, runs in rows.items():
        timed, steps = runs[1:], [r if name == "fixed_length" else x["steps"] for x in runs[1:]]
        results.append(
            {
                "sampler": name,
                "generate_s_median": statistics.median(x["seconds"] for x in timed),
                "generate_s": [round(x["seconds"], 4) for x in timed],
                "first_rollout_s": runs[0]["seconds"],
                "completion_tokens_per_sec": statistics.median(x["tokens"] / x["seconds"] for x in timed),
                "decode_slots_per_sec": statistics.median(b * s / x["seconds"] for x, s in zip(timed, steps)),
                "decode_steps_median": statistics.median(steps),
                "completion_length_mean": statistics.mean(x["tokens"] for x in timed) / b,
                "fixed_over_early_time_ratio_median": statistics.median(ratios),
                "model": args.model,
                "batch_size": b,
                "num_generations": args.num_generations,
                "prompt_length": q,
                "response_length": r,
                "temperature": args.temperature,
                "rounds": args.rounds,
                "before": args.before,
                "device": jax.devices()[0].device_kind,
                "num_devices": jax.device_count(),
            }
        )
        print(json.dumps(results[-1]))
    return results


if __name__ == "__main__":
    plumbing.launch(main, Args)
