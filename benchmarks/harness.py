"""Shared by throughput.py, memory.py, longtail.py and step_ab.py: model shapes, synthetic
batches, and the per-algorithm set-up that calls each script's OWN train_step (never a copy of
it), with the optimizer every script builds (plumbing.make_optimizer).

ALGOS maps each --algo to what it needs: its set-up, its Args at the benchmark's sizes, the
models it trains. One `Bench` per algorithm: the script's Args, an un-jitted
`step(state, batch, extra)`, the initial `state` = (trainable, optimizer state) (donated),
`extra` (not donated: the frozen weights, DPO's reference), one synthetic `batch` [A, B/A, ...],
tokens per step and the FLOP factor k (k·N per token). Set-up works on concrete arrays
(throughput) or on `jax.ShapeDtypeStruct`s that carry their shardings (memory: nothing big
is ever allocated).
"""

import functools
import os
import sys
import time
from dataclasses import dataclass, fields
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import plumbing  # noqa: E402
import common  # noqa: E402  (sets KERAS_BACKEND=jax before keras loads)
import lora  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import tpu_kernels  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

# Published architecture numbers (KerasHub backbone arguments). KerasHub's Gemma `intermediate_dim`
# counts both FFN gates: Gemma-2B's 32768 = 2 × 16384 per gate; Gemma 3's and 4's count one, as
# Hugging Face's `intermediate_size` (keras_hub's convert_gemma3.py / convert_gemma4.py pass it as it is).
# Gemma 3: the text decoder of google/gemma-3-{4b,12b,27b}-it's config.json (text_config; keys it leaves
# out take transformers' Gemma3TextConfig defaults: 8 query / 4 key-value heads, head_dim 256, vocabulary
# 262208), as convert_gemma3.py maps them. 27B: query_pre_attn_scalar 168 ≠ head_dim 128, so queries
# scale by 168^-0.5 (query_head_dim_normalize=False).
GEMMA3 = dict(
    image_size=None,
    vision_encoder=None,
    use_post_ffw_norm=True,
    use_post_attention_norm=True,
    use_sliding_window_attention=True,
    sliding_window_size=1024,
    global_rope_scaling_factor=8.0,
)
# Gemma 4: the text_config of google/gemma-4-31B's and google/gemma-4-26B-A4B's config.json, through
# convert_gemma4.py: every 6th layer global (head_dim 512, num_global_key_value_heads key/value heads,
# values = keys), the rest sliding-window (1024) with head_dim 256; final logits soft-capped at 30.
GEMMA4 = dict(
    image_size=None,
    vision_encoder=None,
    vocabulary_size=262144,
    head_dim=256,
    global_head_dim=512,
    use_sliding_window_attention=True,
    sliding_window_size=1024,
    sliding_window_pattern=6,
    final_logit_soft_cap=30.0,
    global_rope_partial_rotary_factor=0.25,
    global_rope_wavelength=1e6,
    local_rope_wavelength=1e4,
)
ARCHS = {
    "tiny": dict(vocabulary_size=320, **common.TINY_CONFIG),
    "gemma_2b": dict(
        vocabulary_size=256000,
        num_layers=18,
        num_query_heads=8,
        num_key_value_heads=1,
        hidden_dim=2048,
        intermediate_dim=32768,
        head_dim=256,
    ),
    "gemma_7b": dict(
        vocabulary_size=256000,
        num_layers=28,
        num_query_heads=16,
        num_key_value_heads=16,
        hidden_dim=3072,
        intermediate_dim=49152,
        head_dim=256,
    ),
    # google/gemma-3-4b-it config.json: 3.880B weights (published 4.3B with its 0.42B SigLIP vision tower)
    "gemma3_4b": dict(
        vocabulary_size=262208,
        num_layers=34,
        num_query_heads=8,
        num_key_value_heads=4,
        hidden_dim=2560,
        intermediate_dim=10240,
        head_dim=256,
        **GEMMA3,
    ),
    # google/gemma-3-1b-it config.json: 0.999B weights; a 262144-token embedding (the 4B's has 262208 rows, the
    # same tokenizer), sliding windows of 512, no global RoPE scaling
    "gemma3_1b": dict(
        vocabulary_size=262144,
        num_layers=26,
        num_query_heads=4,
        num_key_value_heads=1,
        hidden_dim=1152,
        intermediate_dim=6912,
        head_dim=256,
        **{**GEMMA3, "sliding_window_size": 512, "global_rope_scaling_factor": 1.0},
    ),
    # google/gemma-3-12b-it config.json: 11.766B weights (published 12.2B with the vision tower)
    "gemma3_12b": dict(
        vocabulary_size=262208,
        num_layers=48,
        num_query_heads=16,
        num_key_value_heads=8,
        hidden_dim=3840,
        intermediate_dim=15360,
        head_dim=256,
        **GEMMA3,
    ),
    # google/gemma-3-27b-it config.json: 27.009B weights (published 27.4B with the vision tower)
    "gemma3_27b": dict(
        vocabulary_size=262208,
        num_layers=62,
        num_query_heads=32,
        num_key_value_heads=16,
        hidden_dim=5376,
        intermediate_dim=21504,
        head_dim=128,
        query_head_dim_normalize=False,
        **GEMMA3,
    ),
    # google/gemma-4-31B config.json (text_config): 30.697B weights (published 30.7B)
    "gemma4_31b": dict(
        num_layers=60,
        num_query_heads=32,
        num_key_value_heads=16,
        num_global_key_value_heads=4,
        hidden_dim=5376,
        intermediate_dim=21504,
        **GEMMA4,
    ),
    # google/gemma-4-26B-A4B config.json (text_config): a dense MLP (2112) and a mixture of 128 experts (704
    # each, 8 per token) in every layer; 25.233B weights, 3.823B active per token (published 25.2B / 3.8B)
    "gemma4_26b_a4b": dict(
        num_layers=30,
        num_query_heads=16,
        num_key_value_heads=8,
        num_global_key_value_heads=2,
        hidden_dim=2816,
        intermediate_dim=2112,
        enable_moe_block=True,
        num_experts=128,
        expert_intermediate_dim=704,
        num_experts_per_token=8,
        **GEMMA4,
    ),
    # meta-llama/Meta-Llama-3-8B config.json: 8.030B weights (an untied 128256-token embedding and output)
    "llama3_8b": dict(
        vocabulary_size=128256,
        num_layers=32,
        num_query_heads=32,
        num_key_value_heads=8,
        hidden_dim=4096,
        intermediate_dim=14336,
        rope_max_wavelength=500000,
        layer_norm_epsilon=1e-5,
    ),
}
BACKBONES = {
    "llama3_8b": "Llama3Backbone",
    "gemma3_1b": "Gemma3Backbone",
    "gemma3_4b": "Gemma3Backbone",
    "gemma3_12b": "Gemma3Backbone",
    "gemma3_27b": "Gemma3Backbone",
    "gemma4_31b": "Gemma4Backbone",
    "gemma4_26b_a4b": "Gemma4Backbone",
}  # the others: GemmaBackbone
BOS, EOS = 2, 1
MAX_STEPS = 1000  # the scripts' --max-steps here: only the length of their learning-rate schedules


@dataclass
class Config:
    """What `setup` and `script_args` read of a benchmark's flags (`Config.of(args)`)."""

    algo: str
    batch_size: int = 8
    max_length: int = 128
    grad_accum_steps: int = 1
    lora_rank: int = 0
    precompute_ref: bool = False
    """DPO: reference log-probs in the batch instead of a reference forward"""
    teacher_model: str = ""
    """distill: the teacher, an ARCHS name (random weights at its shapes) or a common.load_model name"""
    frozen_dtype: str | None = None
    """what the never-updated weights are held in (LoRA's base, a reference, a teacher); None: the compute dtype"""
    adam_mu_dtype: str = "float32"
    """AdamW's first moment (the scripts' --adam-mu-dtype)"""
    seed: int = 0
    """the synthetic tokens"""

    @classmethod
    def of(cls, args):
        """The fields of this class that the benchmark's Args `args` has (a Config passes as it is)."""
        return (
            args
            if isinstance(args, cls)
            else cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
        )


def import_algo(name):
    """The algorithm script as a module (`import dpo`); a clear error if it is not in the repo yet."""
    if name not in ALGOS:
        raise plumbing.UsageError(f"--algo {name!r}: expected one of {', '.join(ALGOS)}")
    if not os.path.exists(os.path.join(ROOT, f"{name}.py")):
        raise plumbing.UsageError(f"--algo {name}: {name}.py is not in {ROOT}")
    import importlib

    return importlib.import_module(name)


# ---------------------------------------------------------------------------
# Models: random init at published shapes, or abstract (shapes + shardings only)
# ---------------------------------------------------------------------------
def build_backbone(
    name,
    mesh,
    dtype,
    lora_rank=0,
    seed=0,
    abstract=False,
    overrides=None,
    lora_target_modules=None,
    quantize=None,
):
    """The backbone (BACKBONES, else GemmaBackbone) at `ARCHS[name]` shapes, created inside the distribution
    scope: float32 weights computing in `dtype`, as common.load_model builds them. quantize (--quantize): as
    common.load_model too, made on the host in `dtype`, quantized there, then laid out on the mesh.

    abstract=True: variables are created under a StatelessScope that defers their
    initialisation (nothing is allocated); `abstract_variables` then gives their
    shapes, dtypes and the shardings the real layout rules would give.
    """
    if name not in ARCHS:
        raise plumbing.UsageError(f"--model {name!r} with random/abstract init: one of {', '.join(ARCHS)}")
    keras.utils.set_random_seed(seed)
    cls = getattr(common.keras_hub.models, BACKBONES.get(name, "GemmaBackbone"))
    distribution = common.distribution_for(mesh, cls)
    scope = keras.StatelessScope(initialize_variables=False) if abstract else _nullcontext()
    config = {**ARCHS[name], **(overrides or {})}
    if quantize:
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            backbone = cls(dtype=dtype, **config)  # in the compute dtype: bfloat16 weights on the host
            lora.quantize_base(backbone, quantize, distribution)
    with distribution.scope(), scope:
        if not quantize:
            backbone = cls(dtype=common.dtype_policy(dtype), **config)
        if lora_rank:
            lora.enable_lora(backbone, lora_rank, target_modules=lora_target_modules)  # as the scripts
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


def abstract_variables(backbone, frozen_dtype=None, all_frozen=False):
    """(params, frozen) as ShapeDtypeStructs with their layouts, in the order of common.weights, the frozen
    ones (all_frozen: every one) in `frozen_dtype` as common.split_variables holds them."""
    distribution = backbone._bench_distribution
    held = jnp.dtype(frozen_dtype or "float32")

    def spec(v, frozen):
        sharding = distribution.get_variable_layout(v).backend_layout
        dtype = held if frozen and v.dtype == "float32" else jnp.dtype(v.dtype)
        return jax.ShapeDtypeStruct(tuple(v.shape), dtype, sharding=sharding)

    return (
        [spec(v, all_frozen) for v in backbone.trainable_variables],
        [spec(v, True) for v in backbone.non_trainable_variables],
    )


def frozen_dtype(cfg, backbone):
    """The dtype the scripts hold never-updated weights in: --frozen-dtype, else the compute dtype."""
    return cfg.frozen_dtype or backbone.dtype_policy.compute_dtype


def frozen_copy(params, dtype):
    """common.frozen_copy as a function to run (abstract or not): the reference a script keeps."""
    return jax.tree.map(lambda x: x.astype(dtype) if dtype != "float32" else jnp.copy(x), params)


def load_backbone(args, mesh, abstract=False):
    """--model through common.load_model, or at ARCHS shapes with --random-init / abstract; its log-probs
    computed --logits-chunk positions at a time, as the scripts' (common.per_token), its attention Splash's
    on a TPU mesh (tpu_kernels.flash_attention)."""
    backbone = _backbone(args, mesh, abstract)
    backbone.logits_chunk = getattr(args, "logits_chunk", None)
    if getattr(args, "attention", "splash") == "splash":
        tpu_kernels.flash_attention(backbone, mesh)
    return backbone


def _backbone(args, mesh, abstract):
    if abstract or args.random_init:
        overrides = {"num_layers": args.num_layers} if getattr(args, "num_layers", 0) else {}
        for item in filter(None, getattr(args, "arch", "").split(",")):  # --arch hidden_dim=512,...
            key, _, value = item.partition("=")
            if key not in ARCHS["tiny"] or not value.isdigit():
                raise plumbing.UsageError(
                    f"--arch {item!r}: expected NAME=INT, NAME one of {', '.join(ARCHS['tiny'])}"
                )
            overrides[key] = int(value)
        return build_backbone(
            args.model,
            mesh,
            args.dtype or common.default_dtype(),
            args.lora_rank,
            getattr(args, "seed", 0),
            abstract,
            overrides,
            getattr(args, "lora_target_modules", None),
            getattr(args, "quantize", None),
        )
    return common.load_model(
        args.model, mesh, args.dtype, args.seed, args.lora_rank, quantize=getattr(args, "quantize", None)
    ).backbone


# ---------------------------------------------------------------------------
# Concrete or abstract evaluation of set-up functions
# ---------------------------------------------------------------------------
def shape_of(tree):
    """Concrete arrays -> ShapeDtypeStructs with their shardings (leaves already abstract pass)."""
    return jax.tree.map(
        lambda x: (
            x
            if isinstance(x, jax.ShapeDtypeStruct)
            else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
        ),
        tree,
    )


def run(fn, *args, abstract=False, like=None):
    """fn(*args) under jit; abstract: compile only and return the outputs' shapes and shardings. like: a
    tree whose layout the outputs take (DPO's LoRA-off reference: the scripts' eager lora_off keeps each
    array's layout, where under jit its zeros, made from no input, would come back whole on every device)."""
    if (
        abstract and like is not None
    ):  # the layout is given: nothing to compile (a whole-model copy may not fit)
        return jax.tree.map(
            lambda o, x: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=x.sharding),
            jax.eval_shape(fn, *args),
            like,
        )
    layout = {} if like is None else {"out_shardings": jax.tree.map(lambda x: x.sharding, like)}
    jitted = jax.jit(fn, **layout)
    if not abstract:
        return jitted(*args)
    compiled = jitted.lower(*args).compile()
    out = jax.eval_shape(fn, *args)
    mesh = next(x.sharding.mesh for x in jax.tree.leaves(args) if isinstance(x.sharding, NamedSharding))
    # Outputs made from no input (optax's step count) come back on one device: replicate them.
    fix = lambda s: s if isinstance(s, NamedSharding) else NamedSharding(mesh, P())
    return jax.tree.map(
        lambda o, s: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=fix(s)), out, compiled.output_shardings
    )


def init_opt_state(optimizer, params, mesh, abstract=False):
    """Optimizer state laid out like the params it belongs to (scalars such as the step count
    replicated), as common.init_optimizer does: a plain jax.jit(optimizer.init) would create
    the zeros, which depend on no input, whole on device 0."""
    structure = jax.tree.structure(params)
    like_params = lambda x: jax.tree.structure(x) == structure  # mu, nu, ...: one leaf per param
    shapes = jax.eval_shape(optimizer.init, params)
    shardings = jax.tree.map(
        lambda sub: (
            jax.tree.map(lambda p: p.sharding, params) if like_params(sub) else NamedSharding(mesh, P())
        ),
        shapes,
        is_leaf=like_params,
    )
    if not abstract:
        return jax.jit(optimizer.init, out_shardings=shardings)(params)
    return jax.tree.map(lambda o, s: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s), shapes, shardings)


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
    loss_mask[..., length // 2 :] = True
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
    args: object  # the script's Args at the benchmark's sizes
    step: object  # (state, batch, extra) -> (state, metrics), un-jitted; calls the script's train_step
    state: object  # (trainable, optimizer state): donated
    extra: dict  # inputs not donated, by train_step's parameter names: frozen weights, DPO's ref_params
    batch: dict
    tokens_per_step: int
    flops_factor: int  # FLOPs per token = flops_factor × N
    note: str = ""
    rollout: object = (
        None  # ppo, grpo: (state, extra, step_fn, key) -> (state, (generate_s, score_s, update_s))
    )


@dataclass(frozen=True)
class Algo:
    """What the harness needs of one --algo (the table ALGOS, at the end of this file)."""

    setup: Callable  # (module, args, backbone, optimizer, params, frozen, rng, (A, B, T, V), mesh, abstract) -> Bench
    args: Callable  # (module, Config) -> the script's Args at the benchmark's sizes
    trained_models: float = 1  # LoRA: -2N per trained model (kto: 0.5, a backward on half its tokens)
    halves: bool = False  # the script's accumulation is exact: --remat auto may halve micro-batches (split=)


def script_args(module, cfg):
    """The script's own Args for cfg.algo at the benchmark's sizes (every other field at its default)."""
    cfg = Config.of(cfg)
    return ALGOS[cfg.algo].args(module, cfg)


def plain_args(module, cfg):
    """sft, dpo, simpo, orpo, kto, reward: --batch-size, --max-length, --lora-rank, --grad-accum-steps and
    --precompute-ref as asked; a size the script has no flag for (e.g. sft --precompute-ref) is refused."""
    known = module.Args.__dataclass_fields__
    wanted = dict(
        batch_size=cfg.batch_size,
        max_length=cfg.max_length,
        lora_rank=cfg.lora_rank,
        grad_accum_steps=cfg.grad_accum_steps,
        precompute_ref=cfg.precompute_ref,
    )
    unknown = [k for k, v in wanted.items() if k not in known and v != getattr(Config(cfg.algo), k)]
    if unknown:
        raise plumbing.UsageError(f"{module.__name__}.py has no --{unknown[0].replace('_', '-')} option")
    return module.Args(max_steps=MAX_STEPS, **{k: v for k, v in wanted.items() if k in known})


def ppo_args(module, cfg):
    """ppo.py's Args: --max-length T = prompt T/2 + response T/2; --batch-size = rollout batch."""
    if cfg.grad_accum_steps != 1 or cfg.max_length < 4:
        raise plumbing.UsageError(
            "ppo: --grad-accum-steps must be 1 (it splits into mini-batches) and --max-length >= 4"
        )
    # as measured in RESULTS.md (ppo.py's default is now TRL's 1)
    return module.Args(
        batch_size=cfg.batch_size,
        lora_rank=cfg.lora_rank,
        max_steps=MAX_STEPS,
        max_prompt_length=cfg.max_length // 2,
        response_length=cfg.max_length - cfg.max_length // 2,
        num_mini_batches=2,
    )


def grpo_args(module, cfg):
    """grpo.py's Args at its defaults (TRL's: β = 0, one update per generation batch, so neither a
    reference nor a π_old forward) with --max-length T = prompt T/2 + response T/2 and G = 8
    completions a prompt (the whole batch when it is not a multiple of 8)."""
    if cfg.grad_accum_steps != 1 or cfg.max_length < 4:
        raise plumbing.UsageError("grpo: --grad-accum-steps must be 1 and --max-length >= 4")
    g = 8 if cfg.batch_size % 8 == 0 else cfg.batch_size
    return module.Args(
        batch_size=cfg.batch_size,
        lora_rank=cfg.lora_rank,
        max_steps=MAX_STEPS,
        max_prompt_length=cfg.max_length // 2,
        response_length=cfg.max_length - cfg.max_length // 2,
        num_generations=g,
    )


def distill_args(module, cfg):
    """distill.py's Args at its defaults (TRL's: β = 1, reverse KL) with --max-length T = prompt T/2 +
    response T/2 and the teacher --teacher-model."""
    if cfg.grad_accum_steps != 1 or cfg.max_length < 4 or not cfg.teacher_model:
        raise plumbing.UsageError(
            "distill: needs --teacher-model, --grad-accum-steps 1 and --max-length >= 4"
        )
    return module.Args(
        batch_size=cfg.batch_size,
        lora_rank=cfg.lora_rank,
        max_steps=MAX_STEPS,
        teacher_model=cfg.teacher_model,
        max_prompt_length=cfg.max_length // 2,
        response_length=cfg.max_length - cfg.max_length // 2,
    )


def setup(cfg, backbone, mesh, abstract=False):
    """Bench for cfg.algo (a Config, or a benchmark's Args: Config.of): the script's own optimizer
    (plumbing.make_optimizer), state and train_step on a synthetic batch."""
    cfg = Config.of(cfg)
    module = import_algo(cfg.algo)
    algo = ALGOS[cfg.algo]
    args = algo.args(module, cfg)
    args.frozen_dtype = frozen_dtype(cfg, backbone)  # as the scripts' run.frozen_dtype
    args.adam_mu_dtype = cfg.adam_mu_dtype
    if abstract:
        params, frozen = abstract_variables(backbone, args.frozen_dtype)
    else:
        params, frozen = common.split_variables(backbone, frozen_dtype=args.frozen_dtype)
        # Through one jit, so the values carry the mesh in their types as the updated ones
        # will: the second step then finds the first step's compilation (ppo.py does the same).
        on_mesh = lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else NamedSharding(mesh, P())
        params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=jax.tree.map(on_mesh, params))(
            params
        )
    optimizer = plumbing.make_optimizer(args, args.max_steps)[0]
    a, b, t = cfg.grad_accum_steps, cfg.batch_size // cfg.grad_accum_steps, cfg.max_length
    rng = np.random.default_rng(cfg.seed)
    bench = algo.setup(
        module,
        args,
        backbone,
        optimizer,
        params,
        frozen,
        rng,
        (a, b, t, backbone.vocabulary_size),
        mesh,
        abstract,
    )
    if cfg.lora_rank:  # the frozen base needs no weight gradients: 4N, not 6N, per trained model
        bench.flops_factor -= 2 * algo.trained_models
        bench.note = (bench.note + "; " if bench.note else "") + "LoRA: -2N per trained model"
    return bench


def script_step(module, **fixed):
    """The script's train_step as step(state, batch, extra): `fixed` (its model, optimizer, args, …)
    bound, `extra` (the inputs not donated: frozen weights, a reference) passed, both by parameter name."""

    def step(state, batch, extra):
        return module.train_step(**fixed, state=state, batch=batch, **extra)

    return step


def rollout_batch(host, mesh, abstract):
    """ppo.py's / grpo.py's rollout arrays [B, ...], batch over `data` (abstract: shapes only)."""
    sharding = NamedSharding(mesh, P("data"))
    return (
        {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in host.items()}
        if abstract
        else {k: jax.device_put(v, sharding) for k, v in host.items()}
    )


def _sft(module, args, backbone, optimizer, params, frozen, rng, shape, mesh, abstract):
    a, b, t, vocab = shape
    ids, pad, mask = sequences(rng, a, b, t, vocab)
    state = (params, init_opt_state(optimizer, params, mesh, abstract))
    batch = put_batch(mesh, {"token_ids": ids, "padding_mask": pad, "loss_mask": mask}, abstract)
    return Bench(
        args,
        script_step(module, backbone=backbone, optimizer=optimizer, args=args),
        state,
        {"frozen": frozen},
        batch,
        a * b * t,
        6,
    )


def _preference(
    module, args, backbone, optimizer, params, frozen, rng, shape, mesh, abstract, reference=False
):
    """dpo.py (reference=True: its train_step takes ref_params), simpo.py, orpo.py: chosen/rejected batches."""
    a, b, t, vocab = shape
    host = pair_batch(rng, a, b, t, vocab, "ids")
    extra, factor, note = {"frozen": frozen}, 6, "reference-free"
    if reference and args.precompute_ref:
        host["ref_chosen_logps"] = rng.normal(-50, 5, (a, b)).astype(np.float32)
        host["ref_rejected_logps"] = rng.normal(-50, 5, (a, b)).astype(np.float32)
        extra["ref_params"], note = None, "precomputed reference log-probs (no reference forward)"
    elif reference:
        copy = (
            (lambda p: module.lora_off(backbone, p))
            if args.lora_rank
            else functools.partial(frozen_copy, dtype=args.frozen_dtype)
        )
        extra["ref_params"] = run(copy, params, abstract=abstract, like=params)
        factor, note = 8, "online reference forward (+2N)"
    state = (params, init_opt_state(optimizer, params, mesh, abstract))
    return Bench(
        args,
        script_step(module, backbone=backbone, optimizer=optimizer, args=args),
        state,
        extra,
        put_batch(mesh, host, abstract),
        2 * a * b * t,
        factor,
        note,
    )


def _kto(module, args, backbone, optimizer, params, frozen, rng, shape, mesh, abstract):
    """kto.py: each example and its mismatched pair, half the examples desirable; the reference as dpo's.
    Tokens: both sequences of every example; per token 6N on average (the example's 6N + 2N reference,
    the pair's 2N + 2N forwards), 4N with precomputed reference log-probs."""
    a, b, t, vocab = shape
    host = {"label": np.arange(a * b).reshape(a, b) % 2 == 0}
    for name in ("completion", "KL"):
        ids, pad, mask = sequences(rng, a, b, t, vocab)
        host.update({f"{name}_ids": ids, f"{name}_padding_mask": pad, f"{name}_loss_mask": mask})
    extra, factor, note = {"frozen": frozen}, 6, "online reference; mismatched pairs: two forwards"
    if args.precompute_ref:
        for name in ("completion", "KL"):
            host[f"ref_{name}_logps"] = rng.normal(-50, 5, (a, b)).astype(np.float32)
        extra["ref_params"], factor, note = None, 4, "precomputed reference; mismatched pairs: one forward"
    else:
        copy = (
            (lambda p: module.lora_off(backbone, p))
            if args.lora_rank
            else functools.partial(frozen_copy, dtype=args.frozen_dtype)
        )
        extra["ref_params"] = run(copy, params, abstract=abstract, like=params)
    state = (params, init_opt_state(optimizer, params, mesh, abstract))
    return Bench(
        args,
        script_step(module, backbone=backbone, optimizer=optimizer, args=args),
        state,
        extra,
        put_batch(mesh, host, abstract),
        2 * a * b * t,
        factor,
        note,
    )


def _reward(module, args, backbone, optimizer, params, frozen, rng, shape, mesh, abstract):
    a, b, t, vocab = shape
    head = jax.device_put(module.init_head(backbone, 0), NamedSharding(mesh, P()))  # [D, 1] + bias: tiny
    params = (params, shape_of(head) if abstract else head)
    state = (params, init_opt_state(optimizer, params, mesh, abstract))
    host = pair_batch(rng, a, b, t, vocab, "token_ids", with_loss_mask=False)
    return Bench(
        args,
        script_step(module, backbone=backbone, optimizer=optimizer, args=args),
        state,
        {"frozen": frozen},
        put_batch(mesh, host, abstract),
        2 * a * b * t,
        6,
        "6N per token, N incl. the (unused) unembedding",
    )


def _ppo(module, args, backbone, optimizer, params, frozen, rng, shape, mesh, abstract):
    """ppo.py's update step on one mini-batch of a synthetic rollout. The value model is a copy
    of the policy (ppo.py without --reward-model); `rollout` times generate / score / update."""
    b, vocab = shape[1], shape[3]
    q, r = args.max_prompt_length, args.response_length
    mini = b // args.num_mini_batches
    if b % args.num_mini_batches or mini % mesh.shape["data"]:
        raise plumbing.UsageError(
            f"ppo: --batch-size {b} must split into {args.num_mini_batches} mini-batches "
            f"each divisible by the data axis ({mesh.shape['data']})"
        )
    head = {"weight": np.zeros((backbone.hidden_dim, 1), np.float32), "bias": np.zeros((), np.float32)}
    head = jax.device_put(head, NamedSharding(mesh, P()))
    head = shape_of(head) if abstract else head
    copy = lambda p: jax.tree.map(jnp.copy, p)
    trainable = module.PPOParams(
        run(copy, params, abstract=abstract), run(copy, params, abstract=abstract), head
    )
    models = module.Pair(backbone, backbone)
    state = (trainable, init_opt_state(optimizer, trainable, mesh, abstract))
    step = script_step(module, models=models, optimizer=optimizer, args=args, context_length=q)
    ids, pad, mask = sequences(rng, 1, mini, q + r, vocab)
    host = {"query_responses": ids[0], "padding_mask": pad[0], "response_mask": mask[0, :, q:]}
    for k in ("logprobs", "values", "advantages", "returns"):
        host[k] = rng.normal(-1.0 if k == "logprobs" else 0.0, 0.5, (mini, r)).astype(np.float32)
    bench = Bench(
        args,
        step,
        state,
        {"frozen": module.Pair(frozen, frozen)},
        rollout_batch(host, mesh, abstract),
        mini * (q + r),
        12,
        "update step: policy + value forward+backward, 6N each",
    )
    if not abstract:
        reference = run(functools.partial(frozen_copy, dtype=args.frozen_dtype), params)
        bench.rollout = ppo_rollout(module, args, models, mesh, rng, vocab, reference)
    return bench


def ppo_rollout(module, args, models, mesh, rng, vocab, ref_params):
    """fn(state, extra, step_fn, key) -> (state, seconds of (generate, score, update)) for one PPO
    iteration, as ppo.py's loop runs it: its own rollout (KV-cached sampler), rollout_stats,
    advantages_of, mini_batches and train_step; random scores stand in for the reward."""
    q, r, b = args.max_prompt_length, args.response_length, args.batch_size
    on_data = NamedSharding(mesh, P("data"))
    queries = rng.integers(3, vocab, (b, q), dtype=np.int32)
    queries[:, 0] = BOS
    query_mask = np.ones((b, q), bool)
    scores = common.put_global(rng.normal(0, 1, b).astype(np.float32), on_data)
    gen_fn = jax.jit(
        functools.partial(
            module.generate,
            models.policy,
            response_length=r,
            temperature=args.temperature,
            stop_ids=EOS,
            pad_id=0,
        )
    )
    stats_fn = jax.jit(
        functools.partial(module.rollout_stats, models, context_length=q, temperature=args.temperature)
    )
    adv_fn = jax.jit(functools.partial(module.advantages_of, args=args))
    order = np.random.default_rng(0)

    def iteration(state, extra, step_fn, key):
        t0, frozen = time.perf_counter(), extra["frozen"]
        batch, lengths = module.rollout(
            gen_fn,
            state[0].policy,
            frozen.policy,
            queries,
            query_mask,
            key=key,
            stop_ids=EOS,
            pad_id=0,
            on_data=on_data,
        )
        t1 = plumbing.synced(batch)
        logprobs, ref_logprobs, values = stats_fn(state[0], ref_params, frozen, batch)
        advantages, returns, _ = adv_fn(scores, logprobs, ref_logprobs, values, lengths)
        batch.update(logprobs=logprobs, values=values, advantages=advantages, returns=returns)
        t2 = plumbing.synced(batch)
        for idx in common.mini_batches(order, b, args.num_mini_batches, args.num_ppo_epochs, on_data):
            state, metrics = step_fn(state, jax.tree.map(lambda x: x[idx], batch), extra)
        return state, (t1 - t0, t2 - t1, plumbing.synced((state, metrics)) - t2)

    return iteration


def _grpo(module, args, backbone, optimizer, params, frozen, rng, shape, mesh, abstract, advantages=None):
    """grpo.py's (or rloo.py's: the same train_step arguments) train_step on one synthetic generation batch;
    `rollout` times generate / score / update, the advantages from `advantages` (module, rewards, args)."""
    b, vocab = shape[1], shape[3]
    q, r = args.max_prompt_length, args.response_length
    if b % args.num_generations or b % mesh.shape["data"]:
        raise plumbing.UsageError(
            f"grpo: --batch-size {b} must divide by G ({args.num_generations}) and by the "
            f"data axis ({mesh.shape['data']})"
        )
    state = (params, init_opt_state(optimizer, params, mesh, abstract))
    step = script_step(module, backbone=backbone, optimizer=optimizer, args=args, context_length=q)
    ids, pad, mask = sequences(rng, 1, b, q + r, vocab)
    host = {
        "query_responses": ids[0],
        "padding_mask": pad[0],
        "response_mask": mask[0, :, q:],
        "advantages": rng.normal(0, 1, b).astype(np.float32),
    }
    bench = Bench(
        args,
        step,
        state,
        {"frozen": frozen},
        rollout_batch(host, mesh, abstract),
        b * (q + r),
        6,
        "update step: one forward + backward (beta 0: no reference forward)",
    )
    if not abstract:
        bench.rollout = grpo_rollout(module, args, backbone, mesh, rng, vocab, advantages)
    return bench


def _distill(module, args, backbone, optimizer, params, frozen, rng, shape, mesh, abstract):
    """distill.py's train_step on one synthetic batch of completions: the student's forward + backward and the
    frozen teacher's forward (an ARCHS teacher: random weights at its shapes, abstract with the student)."""
    b, vocab = shape[1], shape[3]
    q, r = args.max_prompt_length, args.response_length
    dtype = backbone.dtype_policy.compute_dtype
    if args.teacher_model in ARCHS:
        teacher = build_backbone(args.teacher_model, mesh, dtype, seed=1, abstract=abstract)
    else:
        teacher = common.load_model(args.teacher_model, mesh, dtype, 1).backbone
    held = args.teacher_dtype or args.frozen_dtype
    if abstract:
        weights = abstract_variables(teacher, held, all_frozen=True)
    else:
        weights = common.split_variables(teacher, frozen_dtype=held, all_frozen=True)
    state = (params, init_opt_state(optimizer, params, mesh, abstract))
    step = script_step(
        module, backbone=backbone, optimizer=optimizer, args=args, context_length=q, teacher=teacher
    )
    ids, pad, mask = sequences(rng, 1, b, q + r, min(vocab, teacher.vocabulary_size))
    host = {"query_responses": ids[0], "padding_mask": pad[0], "response_mask": mask[0, :, q:]}
    ratio = plumbing.count_params(teacher) / plumbing.count_params(backbone)
    return Bench(
        args,
        step,
        state,
        {"frozen": frozen, "teacher_weights": weights},
        rollout_batch(host, mesh, abstract),
        b * (q + r),
        round(6 + 2 * ratio, 3),
        f"update step: the student's forward + backward (6N) and the teacher's forward (2N_T = "
        f"{2 * ratio:.3f}N)",
    )


def group_advantages(module, rewards, args):
    """grpo.py's group-relative advantages of rewards [B]."""
    return module.group_advantages(rewards, args.num_generations, args.scale_rewards)[0]


def leave_one_out(module, rewards, args):
    """rloo.py's leave-one-out advantages of rewards [B], with no KL term (the benchmark's β = 0: one update
    per rollout and no reference forward, like grpo's TRL defaults)."""
    return module.rloo_advantages(
        rewards,
        jnp.zeros_like(rewards),
        args.num_generations,
        beta=0.0,
        normalize_advantages=args.normalize_advantages,
    )[0]


GRPO_REWARD_FN = os.path.join(ROOT, "data", "toy.py") + ":batch_score"  # grpo.py's default --reward-fn


class IdsText:
    """Stand-in tokenizer for shapes with no tokenizer (random-init Gemma-2B): ids as space-separated text."""

    end_token_id = EOS

    def detokenize(self, ids):
        return [" ".join(map(str, x)) for x in ids]


def grpo_rollout(module, args, backbone, mesh, rng, vocab, advantages=group_advantages):
    """fn(state, extra, step_fn, key) -> (state, seconds of (generate, score, update)) for one GRPO (or RLOO)
    iteration with the script's own rollout (its KV-cached sampler), decode, scorer (common.load_scorer of
    the reward function GRPO_REWARD_FN), advantages and mini_batches. Random prompt ids, G copies each."""
    q, r, b, g = args.max_prompt_length, args.response_length, args.batch_size, args.num_generations
    on_data = NamedSharding(mesh, P("data"))
    queries = np.repeat(rng.integers(3, vocab, (b // g, q), dtype=np.int32), g, 0)  # [B, Q], a group = G rows
    queries[:, 0] = BOS
    query_mask = np.ones((b, q), bool)
    prompts = [f"Sort: {' '.join(map(str, rng.integers(0, 10, 6)))}" for _ in range(b // g) for _ in range(g)]
    tiny = common.keras_hub.models.GemmaTokenizer(proto=common.TINY_TOKENIZER)
    tokenizer = tiny if tiny.vocabulary_size() == vocab else IdsText()
    scorer = common.load_scorer(mesh, reward_fns=[GRPO_REWARD_FN])
    settings = dict(response_length=r, temperature=args.temperature, stop_ids=EOS, pad_id=0, group=g)
    gen_fn = jax.jit(functools.partial(module.generate, backbone, **settings))  # as the script's
    order = np.random.default_rng(0)

    def iteration(state, extra, step_fn, key):
        t0 = time.perf_counter()
        batch, lengths = module.rollout(
            gen_fn,
            state[0],
            extra["frozen"],
            queries,
            query_mask,
            key=key,
            stop_ids=EOS,
            pad_id=0,
            on_data=on_data,
        )
        t1 = plumbing.synced(batch)
        texts, ids = common.decode_completions(tokenizer, batch, lengths, q, (EOS,))[:2]
        rewards = common.to_host(scorer(prompts, texts, batch, [{"prompt": p} for p in prompts], ids)[0])
        batch["advantages"] = common.put_global(
            jax.device_get(advantages(module, jnp.asarray(rewards), args)), on_data
        )
        t2 = plumbing.synced(batch)
        for idx in common.mini_batches(order, b, args.num_mini_batches, args.num_iterations, on_data):
            state, metrics = step_fn(state, jax.tree.map(lambda x: x[idx], batch), extra)
        return state, (t1 - t0, t2 - t1, plumbing.synced((state, metrics)) - t2)

    return iteration


# --algo -> its set-up, its Args at the benchmark's sizes, and how many models it trains
ALGOS = {
    "sft": Algo(_sft, plain_args, halves=True),
    "dpo": Algo(functools.partial(_preference, reference=True), plain_args, halves=True),  # + a reference
    "simpo": Algo(_preference, plain_args, halves=True),
    "orpo": Algo(_preference, plain_args, halves=True),
    "kto": Algo(_kto, plain_args, trained_models=0.5),  # LoRA: no backward on half its tokens (the pairs')
    "reward": Algo(_reward, plain_args, halves=True),
    "ppo": Algo(_ppo, ppo_args, trained_models=2),  # policy and value
    "grpo": Algo(functools.partial(_grpo, advantages=group_advantages), grpo_args),
    "rloo": Algo(functools.partial(_grpo, advantages=leave_one_out), grpo_args),  # grpo's step and rollout
    "distill": Algo(_distill, distill_args),  # + a frozen teacher's forward
}
