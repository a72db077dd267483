r"""Before/after timing of one script's train_step in ONE process: the script as of a git
revision (`--before`) against the working tree's, on the same weights and synthetic batch,
their steps alternated so a shared, noisy machine loads both alike. Each round also times a
float32 matmul (common.peak_flops' measurement), so MFU is a ratio of neighbouring timings.
    python benchmarks/step_ab.py --algo dpo --before HEAD~1 --model tiny --random-init \
        --arch hidden_dim=512,vocabulary_size=8192,intermediate_dim=4096,head_dim=128 --max-length 256
Flags as throughput.py's (--steps: timed rounds); prints one JSON line last.
"""

import json
import statistics
import subprocess
import sys
import time
import types
from dataclasses import dataclass

import harness  # first: puts the repo root on sys.path and imports common
import throughput

import common
import jax


@dataclass
class Args(throughput.Args):
    before: str = "HEAD"
    """git revision whose <algo>.py is compared with the working tree's"""


def script_at(name, revision):
    """<name>.py as of `revision`, imported as a module of its own (common stays the current one)."""
    source = subprocess.run(["git", "show", f"{revision}:{name}.py"], cwd=harness.ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(name)
    exec(compile(source, f"{revision}:{name}.py", "exec"), module.__dict__)
    return module


def main(args):
    mesh = common.make_mesh(args.mesh)
    current = harness.import_algo(args.algo)
    sides = {}
    for side, module in (("before", script_at(args.algo, args.before)), ("after", current)):
        sys.modules[args.algo] = module  # harness.setup imports the script by name
        backbone = common.enable_remat(harness.load_backbone(args, mesh), args.remat == "on")
        bench = harness.setup(args, backbone, mesh)
        step = jax.jit(bench.step, donate_argnums=0,
                       out_shardings=(jax.tree.map(lambda x: x.sharding, bench.state), None))
        state = bench.state
        for _ in range(args.warmup):  # the first compiles
            state, metrics = jax.block_until_ready(step(state, bench.batch, bench.extra))
        sides[side] = dict(step=step, state=state, bench=bench, times=[], mfu=[], loss=[])
    sys.modules[args.algo] = current
    flops = bench.flops_factor * common.count_params(backbone) * bench.tokens_per_step
    for _ in range(args.steps):
        for s in sides.values():
            peak = common.matmul_flops_per_sec(repeats=3)  # timed just before this step: the load now
            t = time.perf_counter()
            s["state"], metrics = jax.block_until_ready(s["step"](s["state"], s["bench"].batch, s["bench"].extra))
            s["times"].append(time.perf_counter() - t)
            s["mfu"].append(flops / s["times"][-1] / peak)
            s["loss"].append(float(metrics["train/loss"]))
    out = {"algo": args.algo, "arch": args.arch, "batch_size": args.batch_size, "max_length": args.max_length,
           "remat": args.remat, "before": args.before, "flops_per_step": flops}
    for name, s in sides.items():
        out.update({f"{name}_step_s": statistics.median(s["times"]), f"{name}_mfu": statistics.median(s["mfu"]),
                    f"{name}_times": s["times"], f"{name}_losses": s["loss"]})
    out["speedup"] = out["before_step_s"] / out["after_step_s"]
    print(json.dumps(out))


if __name__ == "__main__":
    main(common.cli(Args))
