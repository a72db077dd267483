r"""What a scanned stack of decoder blocks would buy the first step: the same LoRA training step over L
Gemma-2B-shaped blocks written twice in plain JAX, once unrolled (as KerasHub's backbones run their blocks:
a Python loop, L copies in the program) and once as one block under `jax.lax.scan` over stacked weights,
each timed for its trace and lowering, its compile (no persistent cache: in full), its executable's size and
load (serialize, then deserialize_and_load: what a persistent-cache hit pays) and its step. A proxy, not the
scripts' step: no embedding or logits, attention in plain jnp, every block rematerialised; it measures how
compile and load scale with the program's copies of the block, which is what the scripts' first step waits for.
    python benchmarks/scan_compile.py                       # Gemma-2B's block shape, 18 blocks, 4 x 1024
    python benchmarks/scan_compile.py --layers 2 --hidden 64 --ffn 128 --heads 2 --head-dim 16 --seq 32
Prints one JSON line: per variant trace_lower_s, compile_s, executable_mb, load_s, step_ms.
"""

import json
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import plumbing

plumbing.answer_help(__name__, __file__)


@dataclass
class Args:
    layers: int = 18
    """decoder blocks (Gemma-2B's 18)"""
    hidden: int = 2048
    """the model width D"""
    ffn: int = 16384
    """the MLP's inner width"""
    heads: int = 8
    """query heads (one key/value head: Gemma-2B's multi-query attention)"""
    head_dim: int = 256
    """each head's width"""
    rank: int = 16
    """LoRA rank on the query projection"""
    batch: int = 4
    """rows a step"""
    seq: int = 1024
    """tokens a row"""
    steps: int = 5
    """timed steps after the first (the median is reported)"""


def main(args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import serialize_executable

    d, f, h, k, r = args.hidden, args.ffn, args.heads, args.head_dim, args.rank
    shapes = {
        "q": (d, h * k),
        "kv": (d, 2 * k),
        "o": (h * k, d),
        "gate": (d, f),
        "up": (d, f),
        "down": (f, d),
    }
    keys = iter(jax.random.split(jax.random.key(0), 16))
    frozen = {  # [L, ...] bf16: the frozen base
        n: (jax.random.normal(next(keys), (args.layers, *s), jnp.float32) / np.sqrt(s[0])).astype(
            jnp.bfloat16
        )
        for n, s in shapes.items()
    }
    lora = {  # LoRA on q and v's projections, float32, trained
        "qa": jax.random.normal(next(keys), (args.layers, d, r)) / np.sqrt(d),
        "qb": jnp.zeros((args.layers, r, h * k)),
    }
    x = jax.random.normal(next(keys), (args.batch, args.seq, d), jnp.float32).astype(jnp.bfloat16)

    def norm(x):
        return x * jax.lax.rsqrt(
            jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6
        ).astype(x.dtype)

    def block(x, w, a):
        y = norm(x)
        q = y @ w["q"] + ((y @ a["qa"].astype(y.dtype)) @ a["qb"].astype(y.dtype))
        kv = y @ w["kv"]
        b, t = x.shape[:2]
        q = q.reshape(b, t, h, k)
        kk, vv = kv[..., :k], kv[..., k:]
        s = jnp.einsum("bthk,bsk->bhts", q, kk).astype(jnp.float32) / np.sqrt(k)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
        o = jnp.einsum("bhts,bsk->bthk", jax.nn.softmax(s, -1).astype(x.dtype), vv).reshape(b, t, h * k)
        x = x + o @ w["o"]
        y = norm(x)
        return x + (jax.nn.gelu(y @ w["gate"]) * (y @ w["up"])) @ w["down"]

    block = jax.checkpoint(block)

    def unrolled(lora, frozen, x):
        for i in range(args.layers):
            x = block(x, {n: v[i] for n, v in frozen.items()}, {n: v[i] for n, v in lora.items()})
        return jnp.mean(jnp.square(x.astype(jnp.float32)))

    def scanned(lora, frozen, x):
        x, _ = jax.lax.scan(lambda x, wa: (block(x, *wa), None), x, (frozen, lora))
        return jnp.mean(jnp.square(x.astype(jnp.float32)))

    row = {"device": jax.devices()[0].device_kind, "layers": args.layers, "shape": [args.batch, args.seq, d]}
    losses = {}
    for name, loss in (("unrolled", unrolled), ("scanned", scanned)):

        def step(lora, frozen, x, loss=loss):
            value, grads = jax.value_and_grad(loss)(lora, frozen, x)
            return jax.tree.map(lambda p, g: p - 1e-3 * g, lora, grads), value

        t0 = time.perf_counter()
        lowered = jax.jit(step).trace(lora, frozen, x).lower()
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        blob = serialize_executable.serialize(compiled)
        t3 = time.perf_counter()
        serialize_executable.deserialize_and_load(*blob)
        t4 = time.perf_counter()
        out = compiled(lora, frozen, x)
        jax.block_until_ready(out)
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            jax.block_until_ready(compiled(lora, frozen, x))
            times.append(time.perf_counter() - t)
        losses[name] = float(out[1])
        row[name] = {
            "trace_lower_s": t1 - t0,
            "compile_s": t2 - t1,
            "executable_mb": len(blob[0]) / 2**20,
            "load_s": t4 - t3,
            "step_ms": 1e3 * float(np.median(times)),
        }
        print(name, row[name], file=sys.stderr, flush=True)
    row["same_loss"] = bool(np.isclose(losses["unrolled"], losses["scanned"], rtol=1e-2))
    print(json.dumps(row))


if __name__ == "__main__":
    plumbing.launch(main, Args)
