r"""Before/after timing of one script's train_step in ONE process: the script as of a git
revision (`--before`) against the working tree's, on the same weights and synthetic batch,
their steps alternated so a shared, noisy machine loads both alike. Each round also times a
float32 matmul (plumbing.peak_flops' measurement), so MFU is a ratio of neighbouring timings.
    python benchmarks/step_ab.py --algo dpo --before HEAD~1 --model tiny --random-init \
        --arch hidden_dim=512,vocabulary_size=8192,intermediate_dim=4096,head_dim=128 --max-length 256
Every flag of throughput.py (`python benchmarks/throughput.py --help`; --steps: timed rounds),
plus --before; prints one JSON line last. The revision's script must take the working tree's
harness calls (train_step): compare across an API change in two steps.
"""

import json
import os
import statistics
import subprocess
import sys
import time
import types
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import plumbing  # noqa: E402  (instant: `--help` below answers before the heavy imports)

plumbing.answer_help(__name__, __file__)

import harness  # noqa: E402  (the set-up per --algo; imports common)
import throughput  # noqa: E402
import common  # noqa: E402
import jax  # noqa: E402


@dataclass
class Args(throughput.Args):
    # the revision (and every flag of throughput.py)
    before: str = "HEAD"
    """git revision whose <algo>.py is compared with the working tree's"""


def script_at(name, revision):
    """<name>.py as of `revision`, imported as a module of its own (common stays the current one)."""
    source = subprocess.run(
        ["git", "show", f"{revision}:{name}.py"], cwd=harness.ROOT, check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType(name)
    # what `plumbing.answer_help(__name__, __file__)` reads
    module.__file__ = os.path.join(harness.ROOT, f"{name}.py")
    exec(compile(source, f"{revision}:{name}.py", "exec"), module.__dict__)
    return module


def main(args):
    mesh = common.make_mesh(args.mesh)
    current = harness.import_algo(args.algo)
    sides = {}
    for side, module in (("before", script_at(args.algo, args.before)), ("after", current)):
        sys.modules[args.algo] = module  # harness.setup imports the script by name
        backbone = harness.load_backbone(args, mesh)
        remat = plumbing.Remat(args.remat, backbone)
        bench = harness.setup(args, backbone, mesh)
        step = remat.jit(
            bench.step,
            donate_argnums=0,
            out_shardings=(jax.tree.map(lambda x: x.sharding, bench.state), None),
        )
        state = bench.state
        for _ in range(args.warmup):  # the first compiles
            state, metrics = jax.block_until_ready(step(state, bench.batch, bench.extra))
        sides[side] = dict(step=step, state=state, bench=bench, times=[], mfu=[], loss=[], remat=str(remat))
    sys.modules[args.algo] = current
    flops = bench.flops_factor * plumbing.count_params(backbone) * bench.tokens_per_step
    for _ in range(args.steps):
        for s in sides.values():
            peak = plumbing.matmul_flops_per_sec(repeats=3)  # timed just before this step: the load now
            t = time.perf_counter()
            s["state"], metrics = jax.block_until_ready(
                s["step"](s["state"], s["bench"].batch, s["bench"].extra)
            )
            s["times"].append(time.perf_counter() - t)
            s["mfu"].append(flops / s["times"][-1] / peak)
            s["loss"].append(float(metrics["train/loss"]))
    out = {
        "algo": args.algo,
        "arch": args.arch,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "remat": sides["after"]["remat"],
        "before": args.before,
        "flops_per_step": flops,
    }
    for name, s in sides.items():
        out.update(
            {
                f"{name}_step_s": statistics.median(s["times"]),
                f"{name}_mfu": statistics.median(s["mfu"]),
                f"{name}_times": s["times"],
                f"{name}_losses": s["loss"],
            }
        )
    out["speedup"] = out["before_step_s"] / out["after_step_s"]
    print(json.dumps(out))


if __name__ == "__main__":
    plumbing.launch(main, Args)
