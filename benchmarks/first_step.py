r"""Where the time before a first step goes: the model's making, then for each --remat policy asked the train
step's trace, its lowering and its compile, timed apart (one process, the policies one after another).
    python benchmarks/first_step.py --algo dpo --model gemma_2b --random-init --lora-rank 16 \
        --batch-size 4 --max-length 1024 --policies off/2 full
Prints one JSON line: make_s, and per policy trace_s, lower_s, compile_s and the compiled peak in GiB.
"""

import json
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import plumbing  # noqa: E402  (instant: `--help` below answers before the heavy imports)

plumbing.answer_help(__name__, __file__)

import harness  # noqa: E402  (the set-up per --algo; imports common)
import throughput  # noqa: E402  (its Args: the same flags)


@dataclass
class Args(throughput.Args):
    policies: tuple[str, ...] = ("off/2", "full")
    """the --remat policies whose trace, lowering and compile are timed (AUTO_ORDER's names)"""


def main(args):
    import blocks
    import jax

    started = time.perf_counter()
    mesh = harness.common.make_mesh(args.mesh)
    harness.import_algo(args.algo)
    backbone = harness.load_backbone(args, mesh)
    remat = plumbing.Remat("auto", backbone)
    bench = harness.setup(args, backbone, mesh)
    spec = harness.shape_of((bench.state, bench.batch, bench.extra))
    split = 1 if harness.ALGOS[args.algo].halves else None
    remat.shards = split is not None and blocks.batch_shards(spec[split])
    row = {"make_s": time.perf_counter() - started}
    for mode in args.policies:
        t0 = time.perf_counter()
        traced = remat._resolve(mode, bench.step, {"donate_argnums": 0}, split).trace(*spec)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        try:
            peak = blocks.peak_bytes(lowered.compile()) / 2**30
        except Exception as e:  # XLA's out of memory: the time to find out is the figure
            peak = str(e).splitlines()[0][:120]
        row[mode] = {
            "trace_s": t1 - t0,
            "lower_s": t2 - t1,
            "compile_s": time.perf_counter() - t2,
            "peak": peak,
        }
        print(mode, row[mode], file=sys.stderr, flush=True)
    print(json.dumps({**row, "algo": args.algo, "model": args.model, "device": jax.devices()[0].device_kind}))


if __name__ == "__main__":
    plumbing.launch(main, Args)
