"""Training throughput of one algorithm script: tokens/s, MFU and peak memory.

Runs the script's own `train_step` (imported, never re-implemented) on synthetic
full-length batches in its batch format; compiles and warms up first, then times
`--steps` steps, each fenced with block_until_ready. Prints one JSON line last.
    python benchmarks/throughput.py --algo dpo --model tiny
    python benchmarks/throughput.py --algo sft --model gemma_2b --random-init --batch-size 8 --max-length 1024
FLOPs per token: 6N for forward + backward, +2N per extra forward (DPO's online
reference: 8N); N = every weight used in a matmul, tied embedding included. LoRA:
the frozen base needs no weight gradients, -2N per trained model.
"""

import json
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


@dataclass
class Args:
    # what is timed
    algo: Literal["sft", "dpo", "simpo", "orpo", "kto", "reward", "ppo", "grpo", "rloo", "distill"] = "sft"
    """whose train_step is timed"""
    # model
    model: str = "tiny"
    """any common.load_model name; with --random-init one of tiny, gemma_2b, gemma_7b"""
    random_init: bool = False
    """build the backbone at published shapes with random weights (no download)"""
    num_layers: int = 0
    """with --random-init: override the decoder-block count (0: as published); for smoke tests"""
    arch: str = ""
    """with --random-init: override GemmaBackbone arguments, e.g. `hidden_dim=512,vocabulary_size=8192`"""
    dtype: Literal["bfloat16", "float32"] | None = None
    """compute dtype; weights and optimizer state stay float32. None: bfloat16 on accelerators, float32 on CPU"""
    mesh: str | None = None
    """device mesh, e.g. `data=4,model=2`; None: every device on `data`"""
    # the step
    batch_size: int = 8
    """examples per step (a preference pair is one example), global"""
    max_length: int = 128
    """tokens per sequence (every synthetic sequence is full length)"""
    grad_accum_steps: int = 1
    """micro-batches per step"""
    lora_rank: int = 0
    """0 = full fine-tuning; >0 = LoRA of this rank"""
    quantize: Literal["int8", "int4"] | None = None
    """LoRA's frozen base quantized, as the scripts' --quantize (N, the FLOPs' count, is int8's exact: its
    kernels keep their shapes)"""
    logits_chunk: int | None = None
    """sequence positions whose [B, chunk, V] logits exist at a time, as the scripts' flag; 0: the whole;
    None: 64, or whole where they take at most 1 GiB"""
    attention: Literal["splash", "xla"] = "splash"
    """splash: Gemma's attention through the Splash kernel on a TPU, as the scripts' (tpu_kernels.flash_attention);
    xla: KerasHub's own (the comparison)"""
    frozen_dtype: Literal["bfloat16", "float32"] | None = None
    """dtype of the weights never updated (LoRA's base, a reference, a teacher), as the scripts' flag; None: the
    compute dtype"""
    adam_mu_dtype: Literal["float32", "bfloat16"] = "float32"
    """AdamW's first moment, as the scripts' flag"""
    precompute_ref: bool = False
    """DPO, KTO: reference log-probs in the batch instead of a reference forward (DPO: 6N, not 8N)"""
    teacher_model: str = ""
    """distill: the frozen teacher (an ARCHS name: random weights at its shapes; throughput: any model name)"""
    remat: Literal["auto", "off", "on", "full", "minimal", "save_dots", "minimal_offloaded"] = "auto"
    """what each decoder block keeps for the backward pass, as the scripts' `--remat` (auto: the first policy
    whose compiled step fits the device: plumbing.choose_remat)"""
    # timing
    steps: int = 5
    """timed steps (after the warm-up)"""
    warmup: int = 2
    """untimed steps first (the first one compiles)"""
    seed: int = 0
    """seeds the random weights and the synthetic tokens"""
    profile: str = ""
    """a folder: a jax.profiler trace of the timed steps is written there (Perfetto, TensorBoard's profile)"""


def peak_bytes():
    """Largest per-device peak allocation the backend reports (None where it reports none, e.g. CPU)."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    peaks = [s.get("peak_bytes_in_use") for s in stats if s]
    return max(peaks) if peaks and None not in peaks else None


def ppo_split(bench, state, step, args):
    """PPO, GRPO: whole iterations (generate → score → update epochs), median seconds of each part."""
    key = jax.random.key(args.seed)
    parts = []
    for i in range(1 + args.steps):  # the first iteration compiles the sampler and the scorers
        key, sub = jax.random.split(key)
        state, times = bench.rollout(state, bench.extra, step, sub)
        if i:
            parts.append(times)
    generate, score, update = (statistics.median(p) for p in zip(*parts))
    return {
        "generate_tokens_per_sec": args.batch_size * bench.args.response_length / generate,
        "generate_s": generate,
        "score_s": score,
        "update_s": update,
        "iteration_s": generate + score + update,
        "iteration_tokens_per_sec": args.batch_size * args.max_length / (generate + score + update),
    }


def main(args):
    started = time.perf_counter()
    mesh = common.make_mesh(args.mesh)
    if args.batch_size % (mesh.shape["data"] * args.grad_accum_steps):
        raise plumbing.UsageError(
            f"--batch-size {args.batch_size} must divide by data axis "
            f"({mesh.shape['data']}) × --grad-accum-steps ({args.grad_accum_steps})"
        )
    if args.steps < 1 or args.warmup < 1:
        raise plumbing.UsageError("need --steps >= 1 and --warmup >= 1 (the first step compiles)")
    harness.import_algo(args.algo)
    backbone = harness.load_backbone(args, mesh)
    remat = plumbing.Remat(args.remat, backbone)  # --remat: a checkpoint switch on each decoder block
    bench = harness.setup(args, backbone, mesh)
    n_params = plumbing.count_params(backbone)
    state = bench.state
    traces = []  # one entry per trace of the step; a timed step that retraces also recompiles

    def traced_step(*a):
        traces.append(1)
        return bench.step(*a)

    # The state keeps its layout from step to step (as in the scripts): one compilation.
    step = remat.jit(
        traced_step,
        split=1 if harness.ALGOS[args.algo].halves else None,  # the batch, as the scripts'
        donate_argnums=0,
        out_shardings=(jax.tree.map(lambda x: x.sharding, state), None),
    )

    t = time.perf_counter()
    for i in range(args.warmup):
        state, metrics = step(state, bench.batch, bench.extra)
        jax.block_until_ready((state, metrics))
        if i == 0:  # from the start: the model, --remat's choice, the compile and the step
            first_step_s = time.perf_counter() - started
    warmup_s, warm_traces = time.perf_counter() - t, len(traces)
    times = []
    if args.profile:
        jax.profiler.start_trace(args.profile)
    for _ in range(args.steps):
        t = time.perf_counter()
        state, metrics = step(state, bench.batch, bench.extra)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    if args.profile:
        jax.profiler.stop_trace()
    loss = float(jax.device_get(metrics["train/loss"]))
    retraces = len(traces) - warm_traces  # 0 when the timed steps reuse the warm-up's program
    rollout = ppo_split(bench, state, step, args) if bench.rollout else {}

    step_time = statistics.median(times)
    tokens_per_sec = bench.tokens_per_step / step_time
    flops_per_token = bench.flops_factor * n_params
    peak = plumbing.peak_flops()
    print(
        json.dumps(
            {
                "algo": args.algo,
                "model": args.model,
                "random_init": args.random_init,
                "arch": args.arch,
                "dtype": args.dtype or common.default_dtype(),
                "mesh": dict(mesh.shape),
                "batch_size": args.batch_size,
                "max_length": args.max_length,
                "lora_rank": args.lora_rank,
                "quantize": args.quantize,
                "remat": str(remat),
                "tokens_per_step": bench.tokens_per_step,
                "steps": args.steps,
                "tokens_per_sec": tokens_per_sec,
                "step_time_s": step_time,
                "step_time_min_s": min(times),
                "step_time_max_s": max(times),
                "warmup_s": warmup_s,
                "first_step_s": first_step_s,
                "timed_retraces": retraces,
                "mfu": tokens_per_sec * flops_per_token / peak,
                "flops_per_token": flops_per_token,
                "flops_convention": f"{bench.flops_factor}N, N={n_params} ({bench.note or 'forward + backward'})",
                "peak_flops": peak,
                "device": jax.devices()[0].device_kind,
                "num_devices": jax.device_count(),
                "peak_bytes": peak_bytes(),
                "final_loss": loss,
                **rollout,
            }
        )
    )


if __name__ == "__main__":
    plumbing.launch(main, Args)
