"""Shared by throughput.py and memory.py: model shapes, synthetic batches, and the
per-algorithm set-up that calls each script's OWN train_step (never a copy of it).

One `Bench` per algorithm: the script module, an un-jitted `step(state, batch, extra)`,
the initial `state` (donated), `extra` (not donated, e.g. DPO's reference weights),
one synthetic `batch` [A, B/A, ...], tokens per step and the FLOP factor k (k·N per token).
Set-up works on concrete arrays (throughput) or on `jax.ShapeDtypeStruct`s that carry
their shardings (memory: nothing big is ever allocated).
"""

import os
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402  (first: sets KERAS_BACKEND=jax)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

# Published architecture numbers (KerasHub GemmaBackbone arguments). KerasHub's
# `intermediate_dim` counts both FFN gates: Gemma-2B's 32768 = 2 × 16384 per gate.
ARCHS = {
    "tiny": dict(vocabulary_size=320, **common.TINY_CONFIG),
    "gemma_2b": dict(vocabulary_size=256000, num_layers=18, num_query_heads=8, num_key_value_heads=1,
                     hidden_dim=2048, intermediate_dim=32768, head_dim=256),
    "gemma_7b": dict(vocabulary_size=256000, num_layers=28, num_query_heads=16, num_key_value_heads=16,
                     hidden_dim=3072, intermediate_dim=49152, head_dim=256),
}
ALGOS = ("sft", "dpo", "simpo", "orpo", "reward", "ppo")
BOS, EOS = 2, 1


def import_algo(name):
    """The algorithm script as a module (`import dpo`); a clear error if it is not in the repo yet."""
    if name not in ALGOS:
        raise common.UsageError(f"--algo {name!r}: expected one of {', '.join(ALGOS)}")
    if not os.path.exists(os.path.join(ROOT, f"{name}.py")):
        raise common.UsageError(f"--algo {name}: {name}.py is not in {ROOT}")
    import importlib
    return importlib.import_module(name)


# ---------------------------------------------------------------------------
# Models: random init at published shapes, or abstract (shapes + shardings only)
# ---------------------------------------------------------------------------
def build_backbone(name, mesh, dtype, lora_rank=0, seed=0, abstract=False, overrides=None):
    """GemmaBackbone at `ARCHS[name]` shapes, created inside the distribution scope.

    abstract=True: variables are created under a StatelessScope that defers their
    initialisation (nothing is allocated); `abstract_variables` then gives their
    shapes, dtypes and the shardings the real layout rules would give.
    """
    if name not in ARCHS:
        raise common.UsageError(f"--model {name!r} with random/abstract init: one of {', '.join(ARCHS)}")
    keras.utils.set_random_seed(seed)
    cls = common.keras_hub.models.GemmaBackbone
    distribution = common.distribution_for(mesh, cls)
    scope = keras.StatelessScope(initialize_variables=False) if abstract else _nullcontext()
    with distribution.scope(), scope:
        backbone = cls(dtype=dtype, **{**ARCHS[name], **(overrides or {})})
        if lora_rank:
            backbone.enable_lora(lora_rank)
    if abstract:
        from keras.src.backend.common import global_state
        global_state.set_global_attribute("uninitialized_variables", [])  # never initialise them later
        backbone._bench_distribution = distribution
    return backbone


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def abstract_variables(backbone):
    """(params, frozen) as ShapeDtypeStructs with their layouts, in stateless_call order."""
    distribution = backbone._bench_distribution

    def spec(v):
        sharding = distribution.get_variable_layout(v).backend_layout
        return jax.ShapeDtypeStruct(tuple(v.shape), jnp.dtype(v.dtype), sharding=sharding)

    return ([spec(v) for v in backbone.trainable_variables], [spec(v) for v in backbone.non_trainable_variables])


def load_backbone(args, mesh, abstract=False):
    """--model through common.load_model, or at ARCHS shapes with --random-init / abstract."""
    if abstract or args.random_init:
        overrides = {"num_layers": args.num_layers} if getattr(args, "num_layers", 0) else None
        return build_backbone(args.model, mesh, args.dtype or common.default_dtype(), args.lora_rank,
                              args.seed, abstract, overrides)
    return common.load_model(args.model, mesh, args.dtype, args.seed, args.lora_rank).backbone


def remat_decoder_blocks(backbone, policy=None):
    """Activation checkpointing per decoder block: each block's forward is recomputed in the
    backward pass, so only the block inputs [B, T, D] stay alive between forward and backward.
    (The change proposed for the scripts' `--remat`; applied here only to measure it.)"""
    policy = policy or jax.checkpoint_policies.nothing_saveable
    for layer in backbone.transformer_layers:
        call = layer.call

        def remat_call(x, padding_mask=None, cache=None, cache_update_index=0, _call=call):
            if cache is not None:  # generation with a KV cache: no backward pass, nothing to save
                return _call(x, padding_mask=padding_mask, cache=cache, cache_update_index=cache_update_index)
            return jax.checkpoint(lambda h, m: _call(h, padding_mask=m), policy=policy)(x, padding_mask)

        layer.call = remat_call


# ---------------------------------------------------------------------------
# Concrete or abstract evaluation of set-up functions
# ---------------------------------------------------------------------------
def shape_of(tree):
    """Concrete arrays -> ShapeDtypeStructs with their shardings (leaves already abstract pass)."""
    return jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else
                        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def run(fn, *args, abstract=False):
    """fn(*args) under jit; abstract: compile only and return the outputs' shapes and shardings."""
    if not abstract:
        return jax.jit(fn)(*args)
    compiled = jax.jit(fn).lower(*args).compile()
    out = jax.eval_shape(fn, *args)
    mesh = next(x.sharding.mesh for x in jax.tree.leaves(args) if isinstance(x.sharding, NamedSharding))
    # Outputs made from no input (optax's step count) come back on one device: replicate them.
    fix = lambda s: s if isinstance(s, NamedSharding) else NamedSharding(mesh, P())
    return jax.tree.map(lambda o, s: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=fix(s)),
                        out, compiled.output_shardings)


def init_opt_state(optimizer, params, abstract=False):
    """Optimizer state laid out like the params it belongs to (scalars replicated).

    Eagerly, optax's zeros_like keeps each param's sharding. (Under jax.jit, as the
    scripts do now, the zeros depend on no input and land whole on device 0.)
    """
    if not abstract:
        return optimizer.init(params)
    shapes = jax.eval_shape(optimizer.init, params)
    structure = jax.tree.structure(params)
    mesh = next(x.sharding.mesh for x in jax.tree.leaves(params) if isinstance(x.sharding, NamedSharding))

    def place(sub):
        if jax.tree.structure(sub) == structure:  # mu, nu, ...: one leaf per param
            return jax.tree.map(lambda o, p: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=p.sharding), sub, params)
        return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=NamedSharding(mesh, P())), sub)

    return jax.tree.map(place, shapes, is_leaf=lambda x: jax.tree.structure(x) == structure)


def put_batch(mesh, batch, abstract=False):
    """Host batch [A, B, ...] -> sharded over `data` on axis 1 (or its abstract twin)."""
    if not abstract:
        return common.shard_batch(mesh, batch)
    sharding = NamedSharding(mesh, P(None, "data"))
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in batch.items()}


# ---------------------------------------------------------------------------
# Synthetic batches in each script's format: full-length sequences (the worst case),
# BOS first, prompt = first half, response (loss tokens) = second half.
# ---------------------------------------------------------------------------
def sequences(rng, accum, batch, length, vocab):
    ids = rng.integers(3, vocab, (accum, batch, length), dtype=np.int32)
    ids[..., 0] = BOS
    padding_mask = np.ones((accum, batch, length), bool)
    loss_mask = np.zeros((accum, batch, length), bool)
    loss_mask[..., length // 2:] = True
    return ids, padding_mask, loss_mask


def pair_batch(rng, accum, batch, length, vocab, ids_key, with_loss_mask=True):
    out = {}
    for side in ("chosen", "rejected"):
        ids, pad, mask = sequences(rng, accum, batch, length, vocab)
        out.update({f"{side}_{ids_key}": ids, f"{side}_padding_mask": pad})
        if with_loss_mask:
            out[f"{side}_loss_mask"] = mask
    return out


@dataclass
class Bench:
    module: object
    step: object  # (state, batch, extra) -> (state, metrics), un-jitted
    state: object
    extra: object
    batch: dict
    tokens_per_step: int
    flops_factor: int  # FLOPs per token = flops_factor × N
    note: str = ""


def script_args(module, cfg):
    """The script's own Args with the benchmark's sizes (every other field at its default)."""
    fields = module.Args.__dataclass_fields__
    wanted = dict(batch_size=cfg.batch_size, max_length=cfg.max_length, lora_rank=cfg.lora_rank,
                  grad_accum_steps=cfg.grad_accum_steps, max_steps=max(cfg.steps, 100),
                  precompute_ref=getattr(cfg, "precompute_ref", False))
    unknown = [k for k, v in wanted.items() if k not in fields and v]
    if unknown:
        raise common.UsageError(f"{module.__name__}.py has no --{unknown[0].replace('_', '-')} option")
    return module.Args(**{k: v for k, v in wanted.items() if k in fields})


def setup(cfg, backbone, mesh, abstract=False):
    """Bench for cfg.algo: the script's optimizer, state and train_step on a synthetic batch."""
    module = import_algo(cfg.algo)
    args = script_args(module, cfg)
    if abstract:
        params, frozen = abstract_variables(backbone)
    else:
        params, frozen = common.split_variables(backbone)
    optimizer = module.make_optimizer(args)[0]
    a, b, t = cfg.grad_accum_steps, cfg.batch_size // cfg.grad_accum_steps, cfg.max_length
    rng = np.random.default_rng(cfg.seed)
    vocab = backbone.vocabulary_size
    build = SETUPS.get(cfg.algo)
    if build is None:
        raise common.UsageError(f"--algo {cfg.algo}: no benchmark set-up for it yet")
    return build(module, args, backbone, optimizer, params, frozen, rng, (a, b, t, vocab), mesh, abstract)


def _sft(module, args, backbone, optimizer, params, frozen, rng, shape, mesh, abstract):
    a, b, t, vocab = shape
    ids, pad, mask = sequences(rng, a, b, t, vocab)
    state = (params, init_opt_state(optimizer, params, abstract), frozen)
    step = lambda s, batch, extra: module.train_step(backbone, optimizer, s, batch)
    batch = put_batch(mesh, {"token_ids": ids, "padding_mask": pad, "loss_mask": mask}, abstract)
    return Bench(module, step, state, None, batch, a * b * t, 6)


def _preference(module, args, backbone, optimizer, params, frozen, rng, shape, mesh, abstract):
    """dpo.py (and scripts with its signature: train_step(backbone, optimizer, args, state, batch, ref))."""
    a, b, t, vocab = shape
    host = pair_batch(rng, a, b, t, vocab, "ids")
    state = (params, init_opt_state(optimizer, params, abstract), frozen)
    needs_ref = hasattr(module, "lora_off")  # DPO: a reference model
    ref, factor, note = None, 6, "reference-free"
    if needs_ref and getattr(args, "precompute_ref", False):
        host["ref_chosen_logps"] = rng.normal(-50, 5, (a, b)).astype(np.float32)
        host["ref_rejected_logps"] = rng.normal(-50, 5, (a, b)).astype(np.float32)
        note = "precomputed reference log-probs (no reference forward)"
    elif needs_ref:
        copy = ((lambda p: module.lora_off(backbone, p)) if args.lora_rank
                else (lambda p: jax.tree.map(jnp.copy, p)))
        ref = run(copy, params, abstract=abstract)
        factor, note = 8, "online reference forward (+2N)"
    step = lambda s, batch, extra: module.train_step(backbone, optimizer, args, s, batch, extra)
    return Bench(module, step, state, ref, put_batch(mesh, host, abstract), 2 * a * b * t, factor, note)


def _reward(module, args, backbone, optimizer, params, frozen, rng, shape, mesh, abstract):
    a, b, t, vocab = shape
    head = common.replicate(mesh, module.init_head(backbone, 0))  # [D, 1] + bias: tiny, concrete
    params = (params, shape_of(head) if abstract else head)
    state = (params, init_opt_state(optimizer, params, abstract), frozen)
    host = pair_batch(rng, a, b, t, vocab, "token_ids", with_loss_mask=False)
    step = lambda s, batch, extra: module.train_step(backbone, optimizer, s, batch)
    return Bench(module, step, state, None, put_batch(mesh, host, abstract), 2 * a * b * t, 6,
                 "6N per token, N incl. the (unused) unembedding")


SETUPS = {"sft": _sft, "dpo": _preference, "simpo": _preference, "orpo": _preference, "reward": _reward}
