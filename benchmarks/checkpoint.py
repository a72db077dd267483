"""What a periodic checkpoint costs: plumbing.Run.checkpoint, the call every script makes each step, saving a
float32 state of --gib GiB (orbax, synchronous, as the scripts save) --repeats times; then the same bytes
per second applied to full fine-tuning's state at real sizes (float32 weights + AdamW's two moments: 12
bytes a parameter) and to one save every 500 steps (--save-every's default).
    python benchmarks/checkpoint.py --gib 2 --repeats 3
Prints one JSON line last.
"""

import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import plumbing  # noqa: E402  (instant: `--help` below answers before the heavy imports)

plumbing.answer_help(__name__, __file__)

import common  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

# Parameters of the real models (KerasHub's presets), for the full fine-tuning state: 12 bytes each
PARAMS = {"gemma_2b": 2.506e9, "gemma_7b": 8.538e9}


@dataclass
class Args:
    gib: float = 2.0
    """size of the state saved (float32 arrays of 64 MiB), GiB"""
    repeats: int = 3
    """saves timed (one per step); the median is reported"""
    output_dir: str = "/tmp/checkpoint_bench"
    """where the checkpoints go (replaced); put it on the disk the runs will use"""
    step_seconds: float = 1.0
    """seconds a training step takes, for the overhead of one save every 500 steps"""


def main(args):
    chunk = 2**24  # float32 values in 64 MiB
    n = max(1, round(args.gib * 2**30 / 4 / chunk))
    rng = np.random.default_rng(0)  # random bits: orbax compresses, and constant arrays would cost nothing
    state = [jax.device_put(rng.random(chunk, np.float32)) for _ in range(n)]
    shutil.rmtree(args.output_dir, ignore_errors=True)
    run = plumbing.Run(
        "checkpoint", plumbing.SharedArgs(output_dir=args.output_dir, save_every=1, max_steps=args.repeats)
    )
    times = []
    for _ in run.steps():
        t = time.perf_counter()
        run.checkpoint(state)  # every step: --save-every 1
        times.append(time.perf_counter() - t)
    run.close()
    seconds, size = statistics.median(times), n * chunk * 4
    row = {
        "gib": size / 2**30,
        "seconds": seconds,
        "gb_per_s": size / seconds / 1e9,
        "times": times,
        "device": jax.devices()[0].device_kind,
    }
    for name, params in PARAMS.items():
        save = 12 * params / (size / seconds)
        row[f"{name}_save_seconds"] = save
        row[f"{name}_overhead_per_500_steps"] = save / (500 * args.step_seconds)
    shutil.rmtree(args.output_dir, ignore_errors=True)
    print(json.dumps(row))


if __name__ == "__main__":
    plumbing.launch(main, Args)
