"""The sampler's draw alone, at Gemma-2B's output layer (D 2048, V 256k, random bf16 weights): tpu_kernels.py's
fused kernel (the output layer's matmul, the Gumbel noise, the arg-max and the log-sum-exp in one pass) at
each --blocks size, beside XLA's draw as common.categorical runs it off the chip (the matmul writing bf16 logits, then the
noise and first_max, then filtered_logps' log-sum-exp). Each timed call runs --steps draws in a fori_loop,
the hidden states scaled a little each step (so the matmul cannot be hoisted out of it), each with its own
key; the share of tokens equal to XLA's is reported.
    python benchmarks/draw.py --batch-size 256    # on a chip; on CPU the kernel runs in Pallas' interpreter
Prints one JSON line a variant.
"""

import json
import os
import statistics
import sys
import time
import types
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import plumbing  # noqa: E402  (instant: `--help` below answers before the heavy imports)

plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (KERAS_BACKEND=jax; first_max: XLA's one-pass arg-max)
import grpo  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import tpu_kernels  # noqa: E402
import numpy as np  # noqa: E402


@dataclass
class Args:
    batch_size: int = 256
    """B rows drawn for at once"""
    hidden_dim: int = 2048
    """D (Gemma-2B's)"""
    vocabulary_size: int = 256000
    """V (Gemma's)"""
    blocks: tuple[int, ...] = (512, 1024, 2048, 4096)
    """the kernel's vocabulary rows a grid step, one variant each"""
    steps: int = 20
    """draws a timed call"""
    repeats: int = 5
    """timed calls a variant (after one compiling call); the median is reported"""


def xla_draw(hidden, w, key):
    """common.categorical's draw without the kernel (XLA's), for a tied output layer w [V, D] at T = 1."""
    raw = hidden @ w.T
    z = jax.random.gumbel(key, raw.shape) + raw.astype(jnp.float32)
    token = common.first_max(z)
    return token, grpo.filtered_logps(raw, token, 1.0)[0]


def main(args):
    w = jax.random.normal(jax.random.key(1), (args.vocabulary_size, args.hidden_dim)) * 0.03
    w = w.astype(jnp.bfloat16)
    hidden = jax.random.normal(jax.random.key(2), (args.batch_size, args.hidden_dim), jnp.bfloat16)
    layer = types.SimpleNamespace(tie_weights=True, embeddings=types.SimpleNamespace(value=w))
    model = types.SimpleNamespace(token_embedding=layer)
    variants = {"xla": xla_draw}
    for block in args.blocks:
        variants[f"kernel_{block}"] = lambda h, w, k, block=block: tpu_kernels.categorical(
            model, h, k, 1.0, block=block
        )
    out = {}
    for name, draw in variants.items():

        @jax.jit
        def run(h, w, key, draw=draw):
            def step(i, tokens):
                scaled = h * (1 + i.astype(h.dtype) / 64)  # another input each step
                return tokens.at[i].set(draw(scaled, w, jax.random.fold_in(key, i))[0])

            return jax.lax.fori_loop(0, args.steps, step, jnp.zeros((args.steps, h.shape[0]), jnp.int32))

        out[name] = np.asarray(run(hidden, w, jax.random.key(7)))  # compiles
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(run(hidden, w, jax.random.key(7)))
            times.append(time.perf_counter() - start)
        row = {"variant": name, "batch_size": args.batch_size, "device": jax.devices()[0].device_kind}
        row["ms_per_draw"] = 1e3 * statistics.median(times) / args.steps
        row["same_tokens_as_xla"] = float((out[name] == out["xla"]).mean())
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    plumbing.launch(main, Args)
