"""Long-tailed lengths: what per-batch length buckets buy over run-wide padding.

One process, one model, one dataset of long-tailed lengths, three ways of batching it,
run side by side (step i of every mode before step i+1 of any, so load drift hits all):
  run_wide  every batch padded to the bucket of the dataset's longest example (before buckets)
  buckets   each batch padded to the bucket of its own longest sequence (the scripts' default)
  grouped   buckets + --group-by-length (50-batch windows sorted by length)
  packed    sft.py --packing: the examples packed into rows of --max-length (blocks.pack, best fit), each
            batch --batch-size rows (more examples a step than the others: real tokens/s compares them)
Batches come from the script's own pad_examples / get_batch and go through its own train_step.
Each mode jits its own step, so its compilations (one per bucket it meets) are its own; the first
step of each shape is timed apart (compile + run) and each shape is run once more afterwards, so
steady state excludes compiles and end-to-end includes them. One JSON line per mode.
    python benchmarks/longtail.py --algo sft --lengths lognormal:128,1024 --max-length 1024
    python benchmarks/longtail.py --algo dpo --lengths data/prefs_train.jsonl --max-length 256
FLOPs per token as throughput.py (6N; DPO's online reference 8N), counted on REAL tokens.
"""

import dataclasses
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import plumbing  # noqa: E402  (instant: `--help` below answers before the heavy imports)

plumbing.answer_help(__name__, __file__)

import harness  # noqa: E402  (the set-up per --algo; imports common)
import common  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402


@dataclass
class Args:
    # what is timed, on which lengths
    algo: Literal["sft", "dpo"] = "sft"
    """whose get_batch / train_step is timed"""
    lengths: str = "lognormal:128,1024"
    """`lognormal:MEDIAN,P99` (token lengths, clipped to [--min-length, --max-length]) or a dataset file
    (.jsonl/.json/.parquet) tokenised with --model's tokenizer by the script's tokenize_dataset"""
    num_examples: int = 2000
    """synthetic examples drawn from a lognormal --lengths"""
    min_length: int = 8
    """shortest synthetic sequence (BOS + prompt + response + EOS)"""
    # model
    model: str = "tiny"
    """any common.load_model name; with --random-init one of tiny, gemma_2b, gemma_7b"""
    random_init: bool = False
    """build the backbone at published shapes with random weights (no download; no tokenizer)"""
    num_layers: int = 0
    """with --random-init: override the decoder-block count (0: as published)"""
    dtype: Literal["bfloat16", "float32"] | None = None
    """compute dtype; None: bfloat16 on accelerators, float32 on CPU"""
    mesh: str | None = None
    """device mesh, e.g. `data=4,model=2`; None: every device on `data`"""
    # the step
    batch_size: int = 8
    """examples per step (a preference pair is one example), global"""
    max_length: int = 1024
    """the scripts' --max-length: the largest bucket"""
    lora_rank: int = 0
    """0 = full fine-tuning; >0 = LoRA of this rank"""
    remat: Literal["auto", "off", "on", "full", "minimal", "save_dots", "minimal_offloaded"] = "off"
    """activation checkpointing per decoder block (the scripts' `--remat auto` turns it on only where
    the step does not fit the device)"""
    # timing
    steps: int = 20
    """steps timed in every mode (the same step indices: the data stream is the same)"""
    modes: tuple[str, ...] = ("run_wide", "buckets", "grouped")
    """which of run_wide, buckets, grouped, packed (sft) to run"""
    seed: int = 0
    """seeds the random weights, the lengths, the synthetic tokens and the data order"""


MODES = (*Args.modes, "packed")


# ---------------------------------------------------------------------------
# Lengths and synthetic examples in the script's own tokenised format
# ---------------------------------------------------------------------------
def lognormal_lengths(rng, n, median, p99, low, high):
    """n integer lengths, log-normal with the given median and 99th percentile, clipped to [low, high]:
    log L ~ N(log median, σ²), σ = log(p99 / median) / z₀.₉₉ (z₀.₉₉ = 2.3263)."""
    sigma = math.log(p99 / median) / 2.326348
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), low, high).astype(int)


def synthetic_sequence(rng, length, vocab, prompt_length):
    """(ids, mask) as the scripts tokenise: [BOS] + prompt + response + [EOS], mask on response + EOS."""
    ids = rng.integers(3, vocab, length).astype(np.int32)
    ids[0], ids[-1] = harness.BOS, harness.EOS
    mask = np.arange(length) >= prompt_length
    return ids, mask


def synthetic_examples(algo, rng, lengths, vocab):
    """sft: one (ids, mask) per length (prompt = first half). dpo: a pair per length: chosen of that
    length, rejected of a second draw (a shuffle of the same lengths), sharing the shorter half as prompt."""
    if algo == "sft":
        return [synthetic_sequence(rng, n, vocab, n // 2) for n in lengths]
    examples = []
    for n, m in zip(lengths, rng.permutation(lengths)):
        prompt = min(n, m) // 2
        chosen, rejected = (
            synthetic_sequence(rng, n, vocab, prompt),
            synthetic_sequence(rng, m, vocab, prompt),
        )
        rejected[0][:prompt] = chosen[0][:prompt]  # one prompt, two responses
        examples.append((chosen, rejected))
    return examples


def dataset_examples(module, algo, path, tokenizer, model, max_length):
    """A dataset file through the script's own tokenize_dataset (its truncation and drops included)."""
    if tokenizer is None:
        raise plumbing.UsageError("--lengths FILE needs a tokenizer: leave out --random-init")
    rows = common.read_dataset(
        path, "sft" if algo == "sft" else "preference", common.chat_template(model, None), "--lengths"
    )
    if algo == "sft":
        return module.tokenize_dataset(rows, tokenizer, max_length, True, path)[0]
    return module.tokenize_dataset(rows, tokenizer, max_length, path)[0]


def make_data(args, module, vocab, tokenizer):
    """-> (data padded as the script's main pads it, its lengths as main computes them, description)."""
    rng = np.random.default_rng(args.seed)
    if args.lengths.startswith("lognormal:"):
        median, p99 = (float(x) for x in args.lengths.split(":", 1)[1].split(","))
        if not 0 < median <= p99:
            raise plumbing.UsageError(f"--lengths {args.lengths}: need 0 < MEDIAN <= P99")
        lengths = lognormal_lengths(rng, args.num_examples, median, p99, args.min_length, args.max_length)
        examples = synthetic_examples(args.algo, rng, lengths, vocab)
    else:
        examples = dataset_examples(module, args.algo, args.lengths, tokenizer, args.model, args.max_length)
    seqs = examples if args.algo == "sft" else [seq for pair in examples for seq in pair]
    longest = max(len(ids) for ids, _ in seqs)
    data = module.pad_examples(examples, common.bucket_length(longest, args.max_length))
    lengths = data["padding_mask"].sum(-1) if args.algo == "sft" else module.pair_lengths(data)
    seq_lengths = np.array([len(ids) for ids, _ in seqs])
    described = {
        "examples": len(examples),
        "median_length": float(np.median(seq_lengths)),
        "p99_length": float(np.percentile(seq_lengths, 99)),
        "longest": int(longest),
        "mean_length": float(seq_lengths.mean()),
    }
    if args.algo == "sft":  # --packing's rows, and their lengths as sft.py's main counts them
        data["packed"] = module.pad_examples(plumbing.pack(examples, args.max_length), args.max_length)
        data["packed_lengths"] = (data["packed"]["padding_mask"] > 0).sum(-1)
    return data, lengths, described


def pad_to(batch, length):
    """Run-wide padding: the [A, B, T] arrays of a batch padded on the right to `length` (masks False)."""
    return {
        k: np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, length - v.shape[-1])]) if v.ndim == 3 else v
        for k, v in batch.items()
    }


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------
def mode_batch(module, data, lengths, step, script_args, mode, run_length):
    """(host batch, real tokens, padded tokens) of `step` under `mode`, from the script's get_batch."""
    cfg = dataclasses.replace(script_args, group_by_length=(mode == "grouped"))
    if mode == "packed":
        data, lengths = data["packed"], data["packed_lengths"]
    batch, (real, padded) = module.get_batch(
        {k: v for k, v in data.items() if "packed" not in k}, lengths, step, cfg
    )
    if mode == "run_wide":
        length = next(v.shape[-1] for v in batch.values() if v.ndim == 3)
        batch, padded = pad_to(batch, run_length), padded * run_length // length
    return batch, real, padded


def summarise(mode, rows, again, compilations, flops_per_token, peak):
    """One mode's numbers from its steps [(shape, seconds, real, padded, first)] and a second run of
    each shape (again: shape -> seconds). A shape's steady time is the median of that second run and
    its later steps; steady state replaces each first step by it, compile time is the first step's excess."""
    of = {
        s: statistics.median([t for s2, t, *_, first in rows if s2 == s and not first] + [again[s]])
        for s in again
    }
    steady = [of[s] if first else t for s, t, _, _, first in rows]
    compile_s = sum(t - of[s] for s, t, _, _, first in rows if first)
    real, padded = sum(r[2] for r in rows), sum(r[3] for r in rows)
    steady_s, end_to_end_s = sum(steady), sum(r[1] for r in rows)
    return {
        "mode": mode,
        "steps": len(rows),
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_fraction": 1 - real / padded,
        "compilations": compilations,
        "shapes": sorted({r[0] for r in rows}),
        "compile_s": compile_s,
        "steady_s": steady_s,
        "step_time_median_s": statistics.median(steady),
        "end_to_end_s": end_to_end_s,
        "real_tokens_per_sec": real / steady_s,
        "padded_tokens_per_sec": padded / steady_s,
        "real_tokens_per_sec_end_to_end": real / end_to_end_s,
        "mfu": real / steady_s * flops_per_token / peak,
    }


def main(args):
    if args.algo not in ("sft", "dpo") or ("packed" in args.modes and args.algo != "sft"):
        raise plumbing.UsageError(f"--algo {args.algo}: sft or dpo (--modes packed: sft)")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or args.steps < 1:
        raise plumbing.UsageError(f"--modes: some of {', '.join(MODES)}; --steps >= 1")
    mesh = common.make_mesh(args.mesh)
    if args.batch_size % mesh.shape["data"]:
        raise plumbing.UsageError(
            f"--batch-size {args.batch_size} must divide by the data axis ({mesh.shape['data']})"
        )
    module = harness.import_algo(args.algo)
    tokenizer = None
    if args.random_init:
        backbone = harness.load_backbone(args, mesh)
    else:
        model = common.load_model(args.model, mesh, args.dtype, args.seed, args.lora_rank)
        backbone, tokenizer = model.backbone, model.preprocessor.tokenizer
    remat = plumbing.Remat(args.remat, backbone)  # --remat: a checkpoint switch on each decoder block
    data, lengths, described = make_data(args, module, backbone.vocabulary_size, tokenizer)
    run_length = data["padding_mask" if args.algo == "sft" else "chosen_padding_mask"].shape[1]

    # its synthetic batch is not used: the batches here are the script's
    bench = harness.setup(args, backbone, mesh)
    script_args = bench.args
    flops_per_token = bench.flops_factor * plumbing.count_params(backbone)
    peak = plumbing.peak_flops()
    state = bench.state
    out_shardings = (jax.tree.map(lambda x: x.sharding, state), None)
    # One jit per mode (a distinct function each: nothing compiled for one mode is reused by another).
    steps = {m: remat.jit(bench.step, donate_argnums=0, out_shardings=out_shardings) for m in args.modes}
    rows, batches = {m: [] for m in args.modes}, {m: {} for m in args.modes}

    def timed(mode, batch):
        nonlocal state
        t = time.perf_counter()
        state, metrics = steps[mode](state, common.shard_batch(mesh, batch), bench.extra)
        jax.block_until_ready((state, metrics))
        return time.perf_counter() - t

    for step in range(args.steps):
        for mode in args.modes:
            batch, real, padded = mode_batch(module, data, lengths, step, script_args, mode, run_length)
            shape = next(v.shape[-1] for v in batch.values() if v.ndim == 3)
            first = shape not in batches[mode]
            batches[mode].setdefault(shape, batch)
            rows[mode].append((shape, timed(mode, batch), real, padded, first))
        print(
            f"step {step + 1}/{args.steps}: "
            + ", ".join(f"{m} {rows[m][-1][0]} tokens {rows[m][-1][1]:.2f}s" for m in args.modes),
            file=sys.stderr,
            flush=True,
        )
    again = {m: {s: timed(m, b) for s, b in batches[m].items()} for m in args.modes}  # compiled: steady

    results = [
        summarise(m, rows[m], again[m], steps[m]._cache_size(), flops_per_token, peak) for m in args.modes
    ]
    base = next((r for r in results if r["mode"] == "run_wide"), None)
    for r in results:
        if base is not None:
            r["speedup_vs_run_wide"] = r["real_tokens_per_sec"] / base["real_tokens_per_sec"]
            r["speedup_vs_run_wide_end_to_end"] = (
                r["real_tokens_per_sec_end_to_end"] / base["real_tokens_per_sec_end_to_end"]
            )
        print(
            json.dumps(
                {
                    **r,
                    "algo": args.algo,
                    "model": args.model,
                    "random_init": args.random_init,
                    "num_layers": args.num_layers or None,
                    "dtype": args.dtype or common.default_dtype(),
                    "remat": str(remat),
                    "batch_size": args.batch_size,
                    "max_length": args.max_length,
                    "lengths": args.lengths,
                    "run_wide_length": run_length,
                    **described,
                    "flops_per_token": flops_per_token,
                    "flops_convention": f"{bench.flops_factor}N on real tokens, N={flops_per_token // bench.flops_factor} "
                    f"({bench.note or 'forward + backward'})",
                    "peak_flops": peak,
                    "device": jax.devices()[0].device_kind,
                    "num_devices": jax.device_count(),
                }
            )
        )
    return results


if __name__ == "__main__":
    plumbing.launch(main, Args)
