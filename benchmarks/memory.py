r"""Per-device memory of one algorithm's real train step at real model sizes, on CPU.

Builds the backbone at published shapes with ABSTRACT weights (shapes, dtypes and the
shardings common.distribution_for gives; nothing allocated), lowers and compiles the
script's own `train_step` for the mesh, and reads XLA's memory_analysis():
    peak_bytes_per_device = argument + output + temp - alias
(alias = donated inputs whose buffers the outputs reuse: params and optimizer state).
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/memory.py \
        --algo dpo --model gemma_2b --mesh data=8 --batch-size 8 --max-length 1024
"""

import glob
import json
import os
import re
import shutil
import sys
import tempfile
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

GIB = 2**30


@dataclass
class Args:
    # what is compiled
    algo: Literal["sft", "dpo", "simpo", "orpo", "kto", "reward", "ppo", "distill"] = "sft"
    """whose train_step is compiled"""
    # model
    model: str = "gemma_2b"
    """architecture at published shapes (benchmarks/harness.py ARCHS): tiny, gemma_2b, gemma_7b, gemma3_4b,
    gemma3_12b, gemma3_27b, gemma4_31b or gemma4_26b_a4b (Gemma 3 and 4: the text decoder alone)"""
    num_layers: int = 0
    """override the architecture's decoder-block count (0: as published); for quick scaling checks"""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """compute dtype; weights and optimizer state stay float32"""
    mesh: str | None = None
    """device mesh, e.g. `data=8` or `data=4,model=2`; None: every device on `data`"""
    # the step
    batch_size: int = 8
    """examples per step (a preference pair is one example), global"""
    max_length: int = 1024
    """tokens per sequence"""
    grad_accum_steps: int = 1
    """micro-batches per step (activations ÷ this)"""
    lora_rank: int = 0
    """0 = full fine-tuning; >0 = LoRA of this rank"""
    lora_target_modules: tuple[str, ...] | None = None
    """the layers LoRA adapts, as the scripts' flag: `all-linear`, or layer names; None: query and value"""
    precompute_ref: bool = False
    """DPO, KTO: reference log-probs precomputed (no reference weights, no reference forward)"""
    teacher_model: str = ""
    """distill: the frozen teacher (an ARCHS name: random weights at its shapes; throughput: any model name)"""
    state_only: bool = False
    """report the state per chip alone (weights, Adam moments, frozen weights, reference: the shards of the
    abstract arrays, exact at any depth) and the float32 gradients beside it, without compiling the step"""
    remat: Literal["auto", "off", "on", "full", "minimal", "save_dots", "minimal_offloaded"] = "on"
    """what each decoder block keeps for the backward pass, as the scripts' `--remat`; auto resolves as they do
    (plumbing.choose_remat: the first of off, save_dots, minimal, full that fits), against the target's memory"""
    logits_chunk: int | None = None
    """sequence positions whose [B, chunk, V] logits exist at a time, as the scripts' flag; 0: the whole;
    None: 1024 // B positions, or whole where they take at most 1 GiB"""
    attention: Literal["splash", "xla"] = "splash"
    """splash: Gemma's attention through the Splash kernel on a TPU, as the scripts' (tpu_kernels.flash_attention);
    xla: KerasHub's own (the comparison)"""
    frozen_dtype: Literal["bfloat16", "float32"] | None = None
    """dtype of the weights never updated (LoRA's base, a reference, a teacher), as the scripts' flag; None: the
    compute dtype"""
    adam_mu_dtype: Literal["float32", "bfloat16"] = "float32"
    """AdamW's first moment, as the scripts' flag"""
    # the target
    target: Literal["tpu_v5e", "tpu_v6e", "tpu_v5p", "cpu"] = "tpu_v5e"
    """compile for: tpu_v5e (16 GiB chips), tpu_v6e (32 GiB) or tpu_v5p (95 GiB) with libtpu's
    ahead-of-time compiler (no TPU needed), or cpu (simulated host devices; the CPU compiler upcasts
    bf16 matmuls to float32, so bf16 numbers run high)"""
    device_memory_gib: float = 0.0
    """chip memory the result is judged against; 0: the target's (v5e 16, v6e 32, v5p 95; cpu 16 GiB)"""
    run: bool = False
    """with --target cpu (the host's own devices: on a TPU host, its chips): run the compiled step once on zero
    weights and report the device's measured peak beside the compiled numbers (nothing else is allocated
    first, so the process's peak is the step's)"""


TPU_TOPOLOGIES = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
V5P_TOPOLOGIES = {1: "1x1x1", 4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"}


V6E_TOPOLOGIES = {n: t for n, t in TPU_TOPOLOGIES.items() if n >= 4}  # libtpu: no v6e 1x1 (2x2 chips a host)


TARGETS = {
    "tpu_v5e": ("v5e", TPU_TOPOLOGIES),
    "tpu_v6e": ("v6e", V6E_TOPOLOGIES),
    "tpu_v5p": ("v5p", V5P_TOPOLOGIES),
}
CHIP_GIB = {"tpu_v5e": 16.0, "tpu_v6e": 32.0, "tpu_v5p": 95.0, "cpu": 16.0}


def tpu_mesh(kind, shape):
    """A ("data", "model") mesh over the chips of a TPU slice described by libtpu's topology
    (for ahead-of-time compilation: no TPU needed)."""
    name, topologies_by_chips = TARGETS[kind]
    chips = int(np.prod(shape))
    if chips not in topologies_by_chips:
        raise plumbing.UsageError(f"{chips} chips is no {kind} slice here ({sorted(topologies_by_chips)})")
    from jax.experimental import topologies

    try:
        devices = topologies.get_topology_desc(f"{name}:{topologies_by_chips[chips]}", "tpu").devices
    except Exception as e:  # any failure to load libtpu: say so and name the way out
        raise plumbing.UsageError(
            f"--target {kind} needs libtpu (pip install libtpu), or use --target cpu: {e}"
        )
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), ("data", "model"))


def make_target_mesh(spec, target):
    """The mesh of the target the step is compiled for: a TPU slice, or the host's
    (simulated) CPU devices as common.make_mesh gives them."""
    if target == "cpu":
        return common.make_mesh(spec)
    if target not in TARGETS:
        raise plumbing.UsageError(f"--target {target!r}: expected tpu_v5e, tpu_v6e, tpu_v5p or cpu")
    sizes = {"data": 1, "model": 1}
    for part in (spec or "data=8").split(","):
        name, _, size = part.partition("=")
        if name.strip() not in sizes or not size.strip().isdigit():
            raise plumbing.UsageError(f"--mesh {spec!r}: expected e.g. 'data=4,model=2' (axes: data, model)")
        sizes[name.strip()] = int(size)
    return tpu_mesh(target, (sizes["data"], sizes["model"]))


def weight_bytes(tree):
    """Bytes of one device's shards of every array in `tree`."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize
    return total


def hbm_bytes(dump):
    """The compiler's own total of the program's buffers in the chip's HBM: the default memory space (color 0:
    arguments, outputs, temporaries) of the memory-usage report in `dump` (the compile's XLA dump folder).
    temp_size_in_bytes also counts the on-chip VMEM (color 1: 112 MiB on a v5e), which is not HBM. None where
    no report was written."""
    for path in glob.glob(os.path.join(dump, "*memory-usage-report.txt")):
        with open(path) as f:
            found = re.search(r"Memory Space: default \(color=0\)\nTotal bytes: (\d+)", f.read())
        if found:
            return int(found.group(1))
    return None


def compile_step(args, mesh, limit, dump=None):
    """(compiled train step, Bench, backbone, seconds, the remat mode and why) for abstract weights laid out
    on `mesh`; --remat auto: chosen as the scripts choose it, against `limit` bytes a device. dump: a folder
    for XLA's dump of the compile (not under auto, which compiles each mode it tries)."""
    backbone = harness.load_backbone(args, mesh, abstract=True)
    remat = plumbing.Remat(args.remat, backbone)
    t = time.perf_counter()
    bench = harness.setup(args, backbone, mesh, abstract=True)
    spec = (bench.state, bench.batch, bench.extra)
    if args.remat == "auto":  # state donated, as in the scripts
        split = 1 if harness.ALGOS[args.algo].halves else None  # the batch, as the scripts'
        mode, why, compiled = remat.choose(bench.step, spec, limit, split=split, donate_argnums=0)
    else:  # the compiler's memory-usage report, for the HBM total (hbm_bytes)
        lowered = remat.jit(bench.step, donate_argnums=0).lower(*spec)
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump} if dump else None)
        mode, why = args.remat, "as asked"
    return compiled, bench, backbone, time.perf_counter() - t, (mode, why)


def run_once(compiled, bench):
    """The compiled step run once on zeros in the state's layout (--run) -> the largest peak_bytes_in_use of
    the local devices (None where the backend reports none, e.g. CPU)."""
    zeros = jax.tree.map(
        lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding),
        (bench.state, bench.batch, bench.extra),
    )
    jax.block_until_ready(compiled(*zeros))
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    return max(peaks) if None not in peaks else None


def state_of(bench):
    """Bytes per device of the step's state: what it holds before any activation (distill: the teacher too)."""
    (params, opt_state), frozen = bench.state, bench.extra["frozen"]
    out = {
        "trainable_bytes": weight_bytes(params),
        "optimizer_bytes": weight_bytes(opt_state),
        "frozen_bytes": weight_bytes(frozen),
        "reference_bytes": weight_bytes(bench.extra.get("ref_params")),
        "teacher_bytes": weight_bytes(bench.extra.get("teacher_weights")),
    }  # distill's frozen teacher
    state = sum(out.values())
    # float32 gradients of the trainable weights, whole before global-norm clipping
    return {
        **out,
        "state_gib_per_device": state / GIB,
        "state_and_gradients_gib_per_device": (state + out["trainable_bytes"]) / GIB,
    }


def main(args):
    if args.run and args.target != "cpu":  # before the compile: a target's chips are described, not here
        raise plumbing.UsageError("--run needs --target cpu: the host's own devices (a TPU host's chips)")
    mesh = make_target_mesh(args.mesh, args.target)
    if args.batch_size % (mesh.shape["data"] * args.grad_accum_steps):
        raise plumbing.UsageError(
            f"--batch-size {args.batch_size} must divide by data axis "
            f"({mesh.shape['data']}) × --grad-accum-steps ({args.grad_accum_steps})"
        )
    harness.script_args(harness.import_algo(args.algo), args)  # unknown algorithms and options fail here
    run = {
        "algo": args.algo,
        "model": args.model,
        "dtype": args.dtype,
        "mesh": dict(mesh.shape),
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "grad_accum_steps": args.grad_accum_steps,
        "lora_rank": args.lora_rank,
        "lora_target_modules": args.lora_target_modules,
        "precompute_ref": args.precompute_ref,
        "teacher_model": args.teacher_model,
        "remat": args.remat,
    }
    if args.state_only:
        backbone = harness.load_backbone(args, mesh, abstract=True)
        bench = harness.setup(args, backbone, mesh, abstract=True)
        print(
            json.dumps(
                {**run, "reference": bench.note, "params": plumbing.count_params(backbone), **state_of(bench)}
            )
        )
        return
    over = None
    chip_gib = args.device_memory_gib or CHIP_GIB[args.target]
    dump = tempfile.mkdtemp()
    try:
        compiled, bench, backbone, compile_s, remat = compile_step(args, mesh, chip_gib * GIB, dump)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e) or args.target not in ("tpu_v5e", "tpu_v6e"):
            raise
        # The v5e / v6e compiler refuses programs over the chip's HBM. Its message is the verdict;
        # the same program compiled for as many TPU v5p chips (95 GiB each) gives the breakdown.
        over = str(e).split("RESOURCE_EXHAUSTED:")[-1].strip().splitlines()[0]
        print(f"{args.target}: {over}; breakdown from a TPU v5p compile of the same step", flush=True)
        mesh = tpu_mesh("tpu_v5p", mesh.devices.shape)
        shutil.rmtree(dump)  # the refused compile's report: the v5p one replaces it
        os.mkdir(dump)
        compiled, bench, backbone, compile_s, remat = compile_step(
            args, mesh, CHIP_GIB["tpu_v5p"] * GIB, dump
        )
    m = compiled.memory_analysis()
    hbm = hbm_bytes(dump)
    shutil.rmtree(dump, ignore_errors=True)
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    measured = run_once(compiled, bench) if args.run else None
    result = {
        **run,
        "reference": bench.note,
        "params": plumbing.count_params(backbone),
        "peak_bytes_per_device": int(peak),
        "peak_gib_per_device": peak / GIB,
        "formula": "argument + output + temp - alias",
        "argument_bytes": m.argument_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes,
        "generated_code_bytes": m.generated_code_size_in_bytes,
        # the compiler's own peak: arguments and every buffer live at once, no fragmentation; on a TPU the
        # formula's temp also counts on-chip VMEM scratch (memory space 1), so the truth lies between the two
        "xla_peak_bytes": m.peak_memory_in_bytes,
        # the compiler's own HBM total (arguments, outputs, temporaries; no VMEM): the figure a chip's HBM
        # holds; None under --remat auto, or for a program read from JAX's persistent cache (main() called
        # in a process that has one)
        "hbm_bytes_per_device": hbm,
        "hbm_gib_per_device": hbm and hbm / GIB,
        "measured_peak_bytes": measured,
        **state_of(bench),
        "batch_bytes": weight_bytes(bench.batch),
        "fits": over is None and peak <= chip_gib * GIB,
        "target": args.target,
        "target_error": over,
        "device_memory_gib": chip_gib,
        "compile_s": compile_s,
        "remat_resolved": remat[0],
        "remat_why": remat[1],
        "compiled_for": str(mesh.devices.flat[0].device_kind),
    }
    print(json.dumps(result))


if __name__ == "__main__":  # every step compiled here, none read from JAX's persistent cache: a program found
    # there is not compiled again (compile_s would time the lookup, and no memory-usage report is written)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = "off"
    plumbing.launch(main, Args)
