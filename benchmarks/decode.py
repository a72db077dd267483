r"""Decode speed of one script's KV-cached sampler (`generate`), against its roofline, and before / after a
change: the script and common.py as of a git revision (`--before`) against the working tree's, in ONE process,
on the same random-init Gemma, prompts and keys, alternated each round so a shared, noisy machine loads both
alike (`--before ''`: the working tree's alone).
    python benchmarks/decode.py --before HEAD~1    # hidden 512, 4 layers, V = 8192; B = 16, Q = 64, R = 128
    python benchmarks/decode.py --model gemma_2b --before '' --batch-size 64    # Gemma-2B shape, on a chip
Each round times: the samplers (the tokens must be identical, checked every round; `--num-generations G`
beside group 1, and `--plain-draw`'s XLA draw beside the fused kernel's (tpu_kernels.py): their share is
reported, as the prefill over B/G rows or the kernel's matmul may round apart), each prefill alone, and
the probes: memory bandwidth (reading 256 MiB once) and a float32 matmul's FLOP/s. Roofline step = max(bytes
a step reads / bandwidth, 2 N B / peak FLOP/s): every weight, as it is held (--dtype: the compute dtype, as a
frozen base or a sampled-only model is held), and the whole KV cache read once, every multiply-add done once.
Bandwidth and FLOP/s are the chip's datasheet's (plumbing.PEAK_BANDWIDTH, PEAK_FLOPS) where it has a row,
the probes' otherwise (both are printed). A step faster than its roofline means the meter is wrong: it says
so. Prints one JSON line last.
"""

import functools
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import plumbing  # noqa: E402  (instant: `--help` below answers before the heavy imports)

plumbing.answer_help(__name__, __file__)

import harness  # noqa: E402  (build_backbone; imports common)
import common  # noqa: E402
import tpu_kernels  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


@dataclass
class Args:
    script: str = "grpo"
    """whose `generate` is timed: grpo, ppo or evaluate"""
    before: str = "HEAD"
    """git revision whose <script>.py and common.py are compared with the working tree's; '': none"""
    model: str = "tiny"
    """architecture (benchmarks/harness.py ARCHS, e.g. gemma_2b), random weights; --arch overrides it"""
    arch: str = "hidden_dim=512,vocabulary_size=8192,intermediate_dim=4096,head_dim=128"
    """GemmaBackbone arguments over --model's (tiny: 4 layers, 4 query heads, 1 KV head); '' for none"""
    num_layers: int = 0
    """override --model's decoder-block count (0: as it is)"""
    dtype: Literal["bfloat16", "float32"] | None = None
    """compute dtype, which the weights are held in too (a sampler only reads them); None: bfloat16 on an
    accelerator, float32 on CPU"""
    batch_size: int = 16
    """B sequences"""
    num_generations: int = 1
    """G: the B rows are B/G prompts, each G times in a row, as a GRPO rollout; the working tree's sampler
    prefills each prompt once (generate's `group`). With --before '' and G > 1, the working tree's own sampler
    without the sharing (group 1) runs beside it as `before`: the share of equal tokens is reported"""
    plain_draw: bool = False
    """with --before '': beside the working tree's sampler, the same with XLA's draw (tpu_kernels.FUSED_DRAW off:
    the output layer's logits written, then the noise and arg-max) as `before`; the share of equal tokens
    is reported"""
    prompt_length: int = 64
    """Q prompt tokens (random ids, no padding)"""
    response_length: int = 128
    """R new tokens (random weights rarely sample EOS, so nearly every row runs all R steps)"""
    temperature: float = 1.0
    """0: greedy"""
    rounds: int = 7
    """timed rounds (after one compiling round)"""
    profile: str = ""
    """a folder: a jax.profiler trace of the last round's working-tree sampler is written there"""
    seed: int = 0


def modules_at(revision, names):
    """{name: module} of `names`.py as of `revision`, each importing the others at that revision."""
    saved = {n: sys.modules.get(n) for n in names}
    out = {}
    try:
        for name in names:  # in order: common first, so the script's `import common` finds the old one
            source = subprocess.run(
                ["git", "show", f"{revision}:{name}.py"],
                cwd=harness.ROOT,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            module = types.ModuleType(name)
            module.__file__ = os.path.join(harness.ROOT, f"{name}.py")
            sys.modules[name] = module
            out[name] = module
            exec(compile(source, f"{revision}:{name}.py", "exec"), module.__dict__)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name)
            else:
                sys.modules[name] = module
    return out


def bandwidth(n=64 * 2**20):
    """Bytes/s reading n float32 (256 MiB) once, as a decode step reads its weights: a sum, best of 3."""
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    return 4 * n / min(_timed(f, x) for _ in range(3))


def _timed(f, *a):
    t = time.perf_counter()
    jax.block_until_ready(f(*a))
    return time.perf_counter() - t


def main(args):
    mesh = common.make_mesh(None)
    overrides = {k: int(v) for k, _, v in (item.partition("=") for item in args.arch.split(",") if item)}
    if args.num_layers:
        overrides["num_layers"] = args.num_layers
    dtype = args.dtype or common.default_dtype()
    backbone = harness.build_backbone(args.model, mesh, dtype, seed=args.seed, overrides=overrides)
    params, frozen = common.split_variables(backbone, frozen_dtype=dtype, all_frozen=True)
    b = args.batch_size
    q = args.prompt_length
    r = args.response_length
    t = args.temperature
    rng = np.random.default_rng(args.seed)
    g = args.num_generations
    if b % g:
        raise plumbing.UsageError(f"--batch-size {b} must be a multiple of --num-generations {g}")
    queries = np.repeat(rng.integers(3, backbone.vocabulary_size, (b // g, q), dtype=np.int32), g, 0)
    query_mask = np.ones((b, q), bool)
    scripts = {"after": __import__(args.script)}
    groups = {"after": g, "before": g}  # the rows a prompt's prefill serves, per side
    if args.before:
        scripts["before"] = modules_at(args.before, ["common", args.script])[args.script]
        if "group" not in inspect.signature(scripts["before"].generate).parameters:
            groups["before"] = 1  # a revision before `group`: it prefills every row
    elif args.plain_draw:  # the working tree's own sampler, XLA's draw
        scripts["before"] = scripts["after"]
    elif g > 1:  # the working tree's own sampler, every row prefilled
        scripts["before"], groups["before"] = scripts["after"], 1
    fused = {"after": True, "before": not (args.plain_draw and not args.before)}

    def sampler(module, group, fused):  # its generate, jitted; the stop ids were `eos_id` before `stop_ids`
        known = inspect.signature(module.generate).parameters
        settings = {"response_length": r, "temperature": t, "pad_id": 0}
        settings["stop_ids" if "stop_ids" in known else "eos_id"] = harness.EOS
        if "group" in known:
            settings["group"] = group
        generate = functools.partial(module.generate, backbone, **settings)

        def traced(*a):  # tpu_kernels.FUSED_DRAW as this side has it, while jit traces it
            tpu_kernels.FUSED_DRAW = fused
            try:
                return generate(*a)
            finally:
                tpu_kernels.FUSED_DRAW = True

        return jax.jit(traced)

    gens = {side: sampler(m, groups[side], fused[side]) for side, m in scripts.items()}

    def prefill(p, f, qs, qm, group):  # the working tree's prefill alone: what generate spends before step 1
        with common.weights(backbone, p, f):  # (each prompt once, the cache copied to its rows, as `group`)
            mask = jnp.concatenate([qm, jnp.ones((b, r), bool)], 1)[::group]
            cache = common.empty_cache(backbone, b // group, q + r)
            out = common.cached_forward(backbone, qs[::group], mask, cache, 0, last=True)
            return jax.tree.map(lambda x: jnp.repeat(x, group, 0), out)

    prefill = jax.jit(prefill, static_argnames="group")
    prefills = {f"prefill_{side}": functools.partial(prefill, group=groups[side]) for side in gens}
    times = {
        side: [] for side in (*gens, *prefills, "bandwidth", "matmul", "same_tokens", "same_first_tokens")
    }
    for round_ in range(args.rounds + 1):  # round 0 compiles
        key = jax.random.key(args.seed + round_)
        out = {}
        for side in sorted(gens, reverse=bool(round_ % 2)):
            traced = args.profile and side == "after" and round_ == args.rounds
            if traced:
                jax.profiler.start_trace(args.profile)
            start = time.perf_counter()
            out[side] = jax.device_get(gens[side](params, frozen, queries, query_mask, key))
            times[side].append(time.perf_counter() - start)
            if traced:
                jax.profiler.stop_trace()
        if "before" in out:  # the same tokens; G > 1 against group 1: their share (the prefill rounds apart)
            same = out["before"][0] == out["after"][0]  # [B, R]
            times["same_tokens"].append(float(same.mean()))
            times["same_first_tokens"].append(float(same[:, 0].mean()))
            strict = groups["before"] == g and fused["before"]  # a revision's sampler: to the bit
            if (not same.all() or out["before"][1] != out["after"][1]) and strict:
                raise RuntimeError(f"round {round_}: the two samplers returned different tokens")
        for name, fn in prefills.items():
            times[name].append(_timed(fn, params, frozen, queries, query_mask))
        times["bandwidth"].append(bandwidth())
        times["matmul"].append(plumbing.matmul_flops_per_sec(repeats=3))
        timed = ", ".join(f"{side} {times[side][-1]:.3f} s" for side in gens)
        print(f"round {round_}: {timed}, {int(out['after'][1])} steps", file=sys.stderr, flush=True)
    cache = common.empty_cache(backbone, b, q + r)  # what a decode step reads besides the weights
    logits = [np.asarray(fn(params, frozen, queries, query_mask)[0]) for fn in prefills.values()]  # [B, 1, V]
    delta = {"prefill_logits_max_abs": float(np.abs(logits[0]).max())}
    delta["fused_draw"] = tpu_kernels.fits(backbone, b, t)  # the working tree's (common.categorical asks it)
    if len(logits) == 2:  # the two sides' prefill logits (float32): the rounding apart, if any
        delta["prefill_logits_max_abs_diff"] = float(np.abs(logits[0] - logits[1]).max())
    return report(args, times, int(out["after"][1]), params + frozen, jax.tree.leaves(cache), delta)


def report(args, times, steps, weights, cache, delta):
    """One JSON line: per side tokens/s (B × steps / generate s, prefill included, as the sampler's user
    sees it) and ms per decode step (prefill taken out), beside the roofline (medians of rounds 1…)."""
    b = args.batch_size
    med = {k: statistics.median(v[1:]) for k, v in times.items() if v[1:]}
    weight_bytes = sum(w.size * w.dtype.itemsize for w in weights)  # as held: what a step reads
    cache_bytes = sum(c.size * c.dtype.itemsize for c in cache)  # every layer's K and V, all S positions
    matmul_params = sum(w.size for w in weights if w.ndim >= 2)  # N: every weight used in a matmul
    kind = jax.devices()[0].device_kind
    bandwidth = plumbing.datasheet(plumbing.PEAK_BANDWIDTH, kind) or med["bandwidth"]
    flops = plumbing.datasheet(plumbing.PEAK_FLOPS, kind) or med["matmul"]
    roofline_s = max((weight_bytes + cache_bytes) / bandwidth, 2 * matmul_params * b / flops)
    out = {
        "script": args.script,
        "before": args.before,
        "model": args.model,
        "arch": args.arch,
        "num_layers": args.num_layers,
        "dtype": args.dtype or common.default_dtype(),
        "device": kind,
        "batch_size": b,
        "prompt_length": args.prompt_length,
        "response_length": args.response_length,
        "temperature": args.temperature,
        "decode_steps": steps,
        "rounds": args.rounds,
        "weight_mb": weight_bytes / 1e6,
        "kv_cache_mb": cache_bytes / 1e6,
        "bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_source": "datasheet" if bandwidth != med["bandwidth"] else "probe",
        "bandwidth_probe_gb_s": med["bandwidth"] / 1e9,
        "matmul_gflop_s": med["matmul"] / 1e9,
        "num_generations": args.num_generations,
        "plain_draw": args.plain_draw,
        "prefill_s": med["prefill_after"],
        **delta,
        "roofline_ms_per_step": 1e3 * roofline_s,
        "roofline_tokens_per_sec": b / roofline_s,
    }
    for side in ("before", "after"):
        if side in med:
            out[f"{side}_generate_s"] = med[side]
            out[f"{side}_tokens_per_sec"] = b * steps / med[side]
            out[f"{side}_prefill_s"] = med[f"prefill_{side}"]
            out[f"{side}_ms_per_step"] = 1e3 * (med[side] - med[f"prefill_{side}"]) / max(steps - 1, 1)
    out["ms_per_step"] = out["after_ms_per_step"]  # the working tree's, under the name RESULTS.md uses
    out["tokens_per_sec"] = out["after_tokens_per_sec"]
    out["of_roofline"] = out["roofline_ms_per_step"] / out["ms_per_step"]  # 1: at the floor
    if out["of_roofline"] > 1.02:  # 2%: the timing's own noise
        out["meter_error"] = "the step ran faster than its roofline: a byte or FLOP count here is wrong"
        print(f"warning: {out['meter_error']}", file=sys.stderr)
    if "before" in med:  # each round's pair: one load
        ratios = [x / y for x, y in zip(times["before"][1:], times["after"][1:])]
        out["speedup_median_of_rounds"] = statistics.median(ratios)
        out["same_tokens"] = min(times["same_tokens"])  # the share of equal tokens, its lowest round
        out["same_first_tokens"] = min(times["same_first_tokens"])
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    plumbing.launch(main, Args)
