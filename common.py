"""What an algorithm file calls, and the model machinery behind it.
  1. Mesh        init_distributed, make_mesh, ShardedParallel (layouts), shard_batch, put_global, to_host,
                 init_optimizer (optimizer state laid out like the params), lr_schedule (transformers')
  2. Models      FAMILIES (MODEL_ALIASES: interop's), resolve_model, load_model (created sharded;
                 text_causal_lm: text only, multimodal checkpoints too; enable_lora: PEFT's LoRA),
                 check_sampler, vocabulary (a tokenizer's, no weights); forward (stateless, with the losses
                 its layers add: a mixture of experts' router loss; Gemma's attention through tpu_kernels.py's
                 Splash on a TPU); per family: logits, categorical (a sampler's draw: jax.random.categorical's,
                 on one TPU chip the fused kernel), empty_cache, cached_forward (KV-cached or recurrent
                 states, left padding); split_variables, save_model, host_model (what --export-hf converts);
                 reward models; reward scoring: reward functions (TRL's contract: call_reward_fn) and
                 load_scorer (Scorer: a reward model or weighted reward functions, one call) of a rollout's
                 decode_completions; reward_metrics
  3. Files       read_rows (.jsonl/.json/.parquet, saved folders, Hub ids), TRL's row formats -> text and chat
                 rendering: CHAT_TEMPLATES / chat_template / render, sft_segments, preference_triple,
                 unpaired_example, prompt_text; read_dataset, eval_source (--eval-split), read_prompts
  4. Data order  the batch order: length_batch (padded to a length bucket, optionally grouped by length; a
                 pure function of the step: resume is exact), bucket_length, per_example (every example
                 once: its values, or a loss summed exactly); an RL step's: query_length, mini_batches
The middle of the chain interop <- common <- plumbing, the algorithm-facing layer: the outside world (model
hubs, Hub datasets, keras-hub's BPE fix) comes through interop.py; the run shell plumbing.py (flags, Run, exits,
remat, FLOPs) is built on it. Mesh axes are ("data", "model"): batch over `data`, parameters over both
(docs/design.md). Importing it sets KERAS_BACKEND=jax (JAX_PLATFORMS=cpu without an accelerator) before keras
loads, keeps TensorFlow out and fixes keras-hub's byte-level BPE word splits; it prints nothing."""

import collections
import contextlib
import functools
import json
import os
import sys

import interop  # the outside world: model hubs, Hub datasets, --export-hf, upstream fixes (no JAX)
from interop import HERE, MODEL_ALIASES, TINY_TOKENIZER, UsageError  # noqa: F401  (bad input: exit 2)

interop.before_keras()  # KERAS_BACKEND=jax, JAX_PLATFORMS=cpu without an accelerator, no TensorFlow
import jax  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from keras_hub.src.utils.preset_utils import find_subclass, get_preset_loader  # noqa: E402
import tpu_kernels  # noqa: E402  (Pallas on a TPU: Gemma's attention through Splash, the sampler's fused draw)
import lora  # noqa: E402  (the layers LoRA adapts; QLoRA's quantized base)
import blocks  # noqa: E402  (packed rows: each example's attention and positions its own)

interop.fix_bpe_splits()  # keras-hub's byte-level BPE splits words as its models' tokenizers do
interop.fix_rope_rotation()  # RoPE's rotate_half concatenated: the same values, fewer ops a decode step


# Backbone class -> its chat template: the families cached_forward samples (Gemma 2 is a GemmaBackbone).
# Another family trains (KerasHub's own output layer) but needs --chat-template and has no sampler.
FAMILIES = {
    "GemmaBackbone": "gemma",
    "Gemma3Backbone": "gemma",
    "Llama3Backbone": "llama3",
    "MistralBackbone": "mistral",
    "QwenBackbone": "chatml",
    "Qwen3Backbone": "chatml",
    "Qwen3_5Backbone": "qwen3.5",
    "Gemma4Backbone": "gemma4",  # 26B-A4B and 31B: gemma4_large
    "Qwen3MoeBackbone": "chatml",
}  # Qwen3-MoE: Qwen 3's decoder call, a mixture of experts as its MLP
# Mixtures of experts whose layers add their router's load-balancing loss (add_loss) in training mode, already
# × the model's coefficient (Qwen3-MoE: the checkpoint's router_aux_loss_coef). `forward` calls only these in
# training mode (which also switches dropout on). Gemma 4 26B-A4B's add none (keras-hub 0.32): unbalanced here.
ROUTER_AUX_LOSS = ("Qwen3MoeBackbone",)
# The `tiny` model: a 4-layer Gemma (about 1.5M parameters) with the bundled tokenizer.
TINY_CONFIG = dict(
    num_layers=4, num_query_heads=4, num_key_value_heads=1, hidden_dim=192, intermediate_dim=1024, head_dim=48
)


# Tokens of the batch whose logits a chunk computes (per_token) when --logits-chunk is None (the default) and
# the whole batch's float32 logits would take more than WHOLE_LOGITS bytes (under 1 GiB, small vocabularies and
# short batches, they stay whole): CHUNK_TOKENS // B positions of every row, so a chunk's [B, C, V] logits
# are one size whatever the batch (bf16 at Gemma's 256k vocabulary: 500 MiB, and a chip's share of it where
# the vocabulary is sharded), and the output layer's weights are read once per 1,024 tokens
CHUNK_TOKENS = 1024
WHOLE_LOGITS = 2**30


def default_dtype():
    """The compute dtype: bfloat16 on accelerators, float32 on CPU (bf16 matmuls are slow on CPU)."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def dtype_policy(dtype):
    """Compute dtype -> Keras policy. Variables stay float32 (master weights: a bf16 weight near 0.01 has a
    step of 6e-5, so lr 1e-6 updates would round away); mixed_bfloat16 casts each weight as a layer reads it."""
    return "mixed_bfloat16" if (dtype or default_dtype()) == "bfloat16" else "float32"


# --- 1. Multi-host start-up and the mesh ---
# Variables by which a cluster launcher says how many processes it started: a TPU VM's host list (one host
# per process; a lone TPU VM lists `localhost`), SLURM's task count, Open MPI's world size
CLUSTER_VARIABLES = ("TPU_WORKER_HOSTNAMES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def cluster_size():
    """(processes a launcher's variables name, that variable) for the first that names more than one, else
    (1, None): a TPU host list counts its comma-separated hosts, SLURM and Open MPI give a number."""
    for name in CLUSTER_VARIABLES:
        value = os.environ.get(name, "").strip()
        if name == "TPU_WORKER_HOSTNAMES":  # its hosts, counted
            value = str(len([host for host in value.split(",") if host.strip()]))
        if value.isdigit() and int(value) > 1:
            return int(value), name
    return 1, None


def init_distributed(coordinator_address=None, num_processes=None, process_id=None):
    """Start `jax.distributed` when more than one process takes part: the flags say so, or a launcher's
    variables name several (cluster_size; JAX then finds the rest itself). A single host starts alone, whatever
    its variables. A start that fails is a UsageError (exit 2) naming what was tried and the flags to set."""
    by_flags = coordinator_address is not None or (num_processes or 1) > 1
    size, variable = cluster_size()
    if not by_flags and size == 1:
        return
    if os.environ.get("JAX_PLATFORMS") == "cpu":  # CPU collectives across processes need gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    tried = (
        f"--coordinator-address {coordinator_address} --num-processes {num_processes} "
        f"--process-id {process_id}"
        if by_flags
        else f"{variable}={os.environ[variable]!r} ({size} processes; the rest found by JAX)"
    )
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    except Exception as e:  # one line: the first of the error's, and what to do
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UsageError(
            f"multi-process start-up failed: jax.distributed.initialize with {tried}: {type(e).__name__}: "
            f"{first}; on a single host unset {variable or 'those flags'}, else pass --coordinator-address "
            "HOST:PORT --num-processes N --process-id I to every process"
        ) from None


def make_mesh(spec=None):
    """A `jax.sharding.Mesh` with axes ("data", "model") over all devices (all hosts), sized by --mesh
    ('data=4,model=2'; an axis not named: 1; None: every device on `data`)."""
    n = jax.device_count()
    sizes = {"data": 1, "model": 1}
    for part in (spec or f"data={n}").split(","):
        name, _, size = part.partition("=")
        if name.strip() not in sizes or not size.strip().isdigit():
            raise UsageError(f"--mesh {spec!r}: expected e.g. 'data=4,model=2' (axes: data, model)")
        sizes[name.strip()] = int(size)
    if sizes["data"] * sizes["model"] != n:
        raise UsageError(f"--mesh {spec!r} has {sizes['data'] * sizes['model']} devices, but {n} are present")
    return jax.sharding.Mesh(
        np.asarray(jax.devices()).reshape(sizes["data"], sizes["model"]), ("data", "model")
    )


class ShardedParallel(keras.distribution.ModelParallel):
    """Keras ModelParallel with docs/design.md's rules ("Mesh"): with a `model` axis, the backbone's layout map
    where it names a variable; else a variable of rank >= 2 shards its largest divisible dim over `data` (FSDP).
    An axis that does not divide its dim is dropped (replicated): e.g. Gemma-2B's one KV head on `model=2`."""

    def get_variable_layout(self, variable):
        axes = list(super().get_variable_layout(variable).axes)  # the map's, else replicated: [None] * rank
        axes = (
            axes if len(axes) == len(variable.shape) else [None] * len(variable.shape)
        )  # an int4 kernel: 2-D
        mesh = dict(zip(self.device_mesh.axis_names, self.device_mesh.shape))
        divisible = [i for i in np.argsort(variable.shape)[::-1] if variable.shape[i] % mesh["data"] == 0]
        if all(a is None for a in axes) and len(variable.shape) >= 2 and mesh["data"] > 1 and divisible:
            axes[divisible[0]] = "data"  # the largest
        axes = [a if a is None or variable.shape[i] % mesh[a] == 0 else None for i, a in enumerate(axes)]
        return keras.distribution.TensorLayout(axes, self.device_mesh)


# Backbones without a layout map in keras-hub 0.32 whose weights are named as another's: Gemma 3's and 4's
# attention and MLP kernels are Gemma's (query/key/value/attention_output, ffw_gating/_2, ffw_linear)
LAYOUT_OF = {"Gemma3Backbone": "GemmaBackbone", "Gemma4Backbone": "GemmaBackbone"}


def distribution_for(mesh, backbone_cls):
    """The Keras distribution that creates each weight directly in its shards. The backbone's KerasHub layout
    map (FSDP over `data`, tensor parallelism over `model`) only with a `model` axis: on `data` alone the
    generic rule compiles to about half the peak (v5e, DPO, 2 blocks: Gemma-2B 2.65 GiB a chip against 4.35,
    Llama 3 8B LoRA 1.85 against 3.68; benchmarks/RESULTS.md, "Layout maps on `data` alone")."""
    device_mesh = keras.distribution.DeviceMesh(
        tuple(mesh.devices.shape), mesh.axis_names, devices=mesh.devices.flatten()
    )
    layout_map = keras.distribution.LayoutMap(device_mesh)  # empty: the generic rule for every weight
    if mesh.shape["model"] > 1:
        with contextlib.suppress(AttributeError, NotImplementedError, TypeError):  # no map: the generic rule
            layout_map = getattr(  # its own, or LAYOUT_OF's
                keras_hub.models, LAYOUT_OF.get(backbone_cls.__name__, ""), backbone_cls
            ).get_layout_map(device_mesh, "model", "data")
    return ShardedParallel(layout_map=layout_map, batch_dim_name="data")


def shard_batch(mesh, batch):
    """Place a dict of host arrays [A, B, ...] (A = accumulation steps) with B split over `data`.
    Multi-host: each process passes its own slice [A, B / processes, ...] of the global batch."""
    sharding = NamedSharding(mesh, P(None, "data"))  # one process: jax.device_put's
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def replicated(mesh):
    return NamedSharding(mesh, P())


def put_global(x, sharding):
    """A host array every process holds whole (e.g. a rollout's prompts) -> a global array (unlike
    jax.device_put, also where the sharding spans other processes' devices: each fills its own shards)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def to_host(x):
    """A global array -> the whole NumPy array on every process (allgather across processes; one process:
    np.asarray's)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def init_optimizer(optimizer, params, mesh):
    """(optimizer.init(params), its shardings): moments follow their parameter, scalars are replicated.
    Pinned as the train step's out_shardings, the state's layout is fixed: the step compiles once."""
    like_params = lambda x: jax.tree.structure(x) == jax.tree.structure(params)
    out = jax.tree.map(
        lambda sub: shardings(params) if like_params(sub) else replicated(mesh),
        jax.eval_shape(optimizer.init, params),
        is_leaf=like_params,
    )
    return jax.jit(optimizer.init, out_shardings=out)(params), out


def lr_schedule(kind, peak, total_steps, warmup_steps=0, warmup_ratio=0.0, min_lr_rate=0.1):
    """--lr-scheduler-type as transformers' get_scheduler builds it for TRL -> (schedule, warmup):
    schedule(count) is the rate of optimizer update `count` (0: the first, transformers' lr_lambda(0));
    warmup = --warmup-steps, or ceil(--warmup-ratio × total_steps) when that is 0 (get_warmup_steps);
    `constant` has none. Past the last update (a run extended by --resume, plumbing.Run.schedule_steps):
    the last update's rate, held."""
    warmup = 0 if kind == "constant" else warmup_steps or int(np.ceil(warmup_ratio * total_steps))
    decay_steps = max(1, total_steps - warmup)

    def schedule(count):
        step = jnp.minimum(jnp.asarray(count, jnp.float32), max(0, total_steps - 1))
        cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * (step - warmup) / decay_steps))  # num_cycles 0.5: a half wave
        factor = {
            "linear": jnp.maximum(0.0, (total_steps - step) / decay_steps),
            "cosine": jnp.maximum(0.0, cosine),
            "constant_with_warmup": 1.0,
            "constant": 1.0,
            "cosine_with_min_lr": jnp.maximum(0.0, cosine * (1 - min_lr_rate) + min_lr_rate),
        }[kind]
        return peak * jnp.where(step < warmup, step / max(1, warmup), factor)  # linear warmup from 0

    return schedule, warmup


# --- 2. Models ---
def resolve_model(name):
    """--model -> what `CausalLM.from_preset` takes (or 'tiny'); unknown names raise."""
    if name in MODEL_ALIASES or name == "tiny" or "://" in name:  # kaggle://, hf://, modelscope:// handles
        return MODEL_ALIASES.get(name, name)
    if os.path.isdir(name) and not any(
        os.path.exists(os.path.join(name, f)) for f in ("config.json", "metadata.json")
    ):
        raise UsageError(f"--model {name}: directory has neither config.json (KerasHub/HF) nor metadata.json")
    if os.path.isdir(name) or name in keras_hub.models.CausalLM.presets:
        return name
    if "/" in name or name.startswith((".", "~")):  # a folder's path that is not there (or TRL's `org/name`)
        parent = os.path.abspath(os.path.expanduser(name))
        while not os.path.isdir(parent):
            parent = os.path.dirname(parent)
        raise UsageError(
            f"--model {name}: no such folder (the nearest that exists: {parent})"
            + (f"; as a Hugging Face Hub repo id it is --model hf://{name}" if name.count("/") == 1 else "")
        )
    import difflib

    names = ["tiny", *sorted(MODEL_ALIASES)]
    known = dict.fromkeys(names + sorted(keras_hub.models.CausalLM.presets))  # an alias may name a preset too
    close = difflib.get_close_matches(name, list(known), n=3)
    known = f"did you mean {', '.join(close)}?" if close else f"the aliases: {', '.join(names)}."
    raise UsageError(
        f"unknown --model {name!r}: {known} --model also takes any KerasHub preset, a kaggle:// or hf:// "
        "handle, or a local preset / Hugging Face directory"
    )


def tiny_causal_lm(seed, policy):
    """The offline `tiny` Gemma: random init from `seed`, the bundled SentencePiece vocab."""
    keras.utils.set_random_seed(seed)
    tokenizer = keras_hub.models.GemmaTokenizer(proto=TINY_TOKENIZER)
    return keras_hub.models.GemmaCausalLM(
        backbone=keras_hub.models.GemmaBackbone(
            vocabulary_size=tokenizer.vocabulary_size(), dtype=policy, **TINY_CONFIG
        ),
        preprocessor=keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=128),
    )


@functools.cache  # asked by the chat template, load_model, the sampler and --export-hf checks
def backbone_class(preset):
    """The preset's backbone class, from its config.json (the first hub contact), once per process."""
    if preset == "tiny":
        return keras_hub.models.GemmaBackbone
    interop.model_config(preset)  # a hub failure stops here, in one line; it is not a fallback
    try:
        return get_preset_loader(preset).check_backbone_class()
    except Exception:  # an unknown architecture falls back to the generic sharding rule
        return keras_hub.models.Backbone


def check_sampler(name, flag="--model"):
    """The KV-cached sampler (cached_forward) knows the FAMILIES' decoder layers: refuse others early."""
    cls = backbone_class(resolve_model(name))
    if cls.__name__ not in FAMILIES:
        raise UsageError(
            f"{flag} {name}: the KV-cached sampler supports Gemma, Gemma 2, Gemma 3, Gemma 4, "
            "Llama 3, Mistral, Qwen 2.5, Qwen 3, Qwen 3.5 and Qwen3-MoE backbones, not "
            f"{cls.__name__}"
        )


def vocabulary(name):
    """The tokenizer's vocabulary of a --model form, from its tokenizer files alone (no weights)."""
    preset = resolve_model(name)
    if preset == "tiny":
        return keras_hub.models.GemmaTokenizer(proto=TINY_TOKENIZER).get_vocabulary()
    with interop.hub_errors(preset):
        return keras_hub.models.Tokenizer.from_preset(preset).get_vocabulary()


def load_model(
    name,
    mesh,
    dtype=None,
    seed=0,
    lora_rank=0,
    lora_alpha=None,
    lora_target_modules=None,
    quantize=None,
    lora_adapter=None,
    logits_chunk=None,
):
    """--model -> its KerasHub CausalLM (backbone + preprocessor), every weight created sharded and float32
    whatever the checkpoint holds (`dtype`: the compute dtype); lora_rank > 0: only LoRA weights train;
    quantize: --quantize, LoRA's frozen base in int8 / int4 (lora.quantize_base); lora_adapter: --lora-adapter,
    PEFT's adapter files LoRA starts from (lora.read_adapter); logits_chunk: --logits-chunk, the positions whose
    logits per_token computes at a time."""
    preset, policy = resolve_model(name), dtype_policy(dtype)
    distribution = distribution_for(mesh, backbone_class(preset))
    if (quantize or lora_adapter) and not lora_rank:  # LoRA's own flags
        raise UsageError(
            f"--quantize {quantize} quantizes the frozen base of a LoRA run: add --lora-rank"
            if quantize
            else f"--lora-adapter {lora_adapter} continues a LoRA run: add --lora-rank (its ranks are the adapter's)"
        )
    # quantized: made on the host, a checkpoint in the compute dtype (an 8B's bfloat16 weights alone fill a
    # 16 GiB chip); `tiny` in float32, its random init the same as unquantized
    place = jax.default_device(jax.local_devices(backend="cpu")[0]) if quantize else distribution.scope()
    with interop.hub_errors(preset), place, interop.loaded_not_drawn(preset != "tiny"):
        policy = policy.removeprefix("mixed_") if quantize and preset != "tiny" else policy
        model = tiny_causal_lm(seed, policy) if preset == "tiny" else text_causal_lm(preset, policy)
        if quantize:
            lora.quantize_base(model.backbone, quantize, distribution)  # then laid out on the mesh
    with distribution.scope():
        if lora_rank:
            lora.enable_lora(model.backbone, lora_rank, lora_alpha, lora_target_modules, lora_adapter)
    # what save_model merges the adapters into: the base unquantized (on the host: a mesh of one CPU device)
    model.unquantized = quantize and functools.partial(
        load_model,
        name,
        dtype=dtype,
        seed=seed,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_target_modules=lora_target_modules,
        lora_adapter=lora_adapter,
    )
    ensure_start_token(getattr(model.preprocessor, "tokenizer", None), name)
    model.backbone.logits_chunk = logits_chunk
    tpu_kernels.flash_attention(model.backbone, mesh)  # Gemma's attention through Splash on a TPU
    return model


def text_causal_lm(preset, dtype=None):
    """CausalLM.from_preset, text only and without TensorFlow. A vision(-and-audio)-and-text checkpoint (a
    KerasHub preset's backbone config, an HF config.json's vision_config / audio_config) loads its decoder
    alone (the encoders' weights stay in the file): the model/ saved from it is text-only. Gemma 3's and 4's
    preprocessors need TensorFlow (tf.data, text too): each becomes KerasHub's generic one, same ids."""
    config, cls = interop.model_config(preset), backbone_class(preset)
    encoders = {
        k: None
        for k in ("vision_encoder", "audio_encoder")
        if config.get("config", {}).get(k) or k.replace("encoder", "config") in config
    }
    needs_tf = cls.__name__ in ("Gemma3Backbone", "Gemma4Backbone")
    if not encoders and not needs_tf:
        return keras_hub.models.CausalLM.from_preset(preset, dtype=dtype)
    # Gemma 4's draft-model task, Gemma4AssistantCausalLM, has it too
    task = getattr(keras_hub.models, cls.__name__.replace("Backbone", "CausalLM"), None) or find_subclass(
        preset, keras_hub.models.CausalLM, cls
    )
    preprocessor = keras_hub.models.CausalLMPreprocessor if needs_tf else task.preprocessor_cls
    return task(
        backbone=keras_hub.models.Backbone.from_preset(preset, dtype=dtype, **encoders),
        preprocessor=preprocessor(keras_hub.models.Tokenizer.from_preset(preset)),
    )


def ensure_start_token(tokenizer, name):
    """Every script writes [BOS] + text + [EOS]; Qwen's tokenizers have none: theirs becomes <|endoftext|>,
    which separates the packed documents of Qwen's pretraining."""
    if tokenizer is not None and tokenizer.start_token_id is None:
        if "<|endoftext|>" not in tokenizer.get_vocabulary():
            raise UsageError(f"--model {name}: its tokenizer has no start token (BOS) and no <|endoftext|>")
        tokenizer.start_token_id = tokenizer.token_to_id("<|endoftext|>")


def inputs(backbone, token_ids, padding_mask):
    """The backbone's inputs; Gemma 4's also take RoPE positions 0…T-1, as the others count them (packed rows:
    padding_mask holds segment ids, blocks.packed; the positions then restart at each example)."""
    padding_mask = jnp.asarray(padding_mask)
    x = {"token_ids": jnp.asarray(token_ids), "padding_mask": padding_mask > 0}
    return (
        {**x, "position_ids": blocks.example_positions(padding_mask)}
        if "position_ids" in backbone.input
        else x
    )


def weights(backbone, params, frozen, collect_losses=False):
    """The scope inside which `backbone`'s layers read `params` (its trainable values) and `frozen` (the rest,
    split_variables' order) as their weights, each in its own dtype (a layer casts to its compute dtype): a
    keras.StatelessScope whose mapping is set once it is made, since passed to StatelessScope(...) every value
    would be converted to its variable's dtype (float32 under the mixed policy), which would turn the frozen
    weights held in bfloat16 (split_variables) back into a float32 copy of the model at every forward."""
    scope = keras.StatelessScope(collect_losses=collect_losses)
    scope.state_mapping = {
        id(v): value
        for v, value in zip(
            backbone.trainable_variables + backbone.non_trainable_variables, params + frozen, strict=True
        )
    }
    return scope


def forward(backbone, params, frozen, token_ids, padding_mask):
    """The backbone's stateless forward (weights passed as values) -> (final-norm hidden states [B, T, D],
    aux_loss: the sum of the losses its layers add, which a stateless call drops unless its scope collects
    them: a mixture of experts' router loss per MoE layer, × its coefficient (ROUTER_AUX_LOSS); dense: 0.0).
    padding_mask: [B, T] bool, or segment ids for rows that pack several examples (blocks.packed)."""
    with (
        weights(backbone, params, frozen, collect_losses=True) as scope,
        blocks.packed(backbone, padding_mask),
    ):
        hidden = backbone(
            inputs(backbone, token_ids, padding_mask), training=type(backbone).__name__ in ROUTER_AUX_LOSS
        )
    return hidden, sum((jnp.asarray(x, jnp.float32) for x in scope.losses), jnp.float32(0.0))  # f32 upcast


def logits(backbone, hidden, raw=False):
    """Final hidden states [..., D] -> float32 logits [..., V] through every family's output layer (tied or
    not; Gemma 2's final_logit_soft_cap c·tanh(z/c) is applied inside it). Inside `weights(...)`. raw: as the
    layer computes them, in the compute dtype (their float32 is exactly their cast: a sampler casts where it
    reads them, and a float32 [B, V] copy beside them is never written)."""
    out = backbone.token_embedding(hidden, reverse=True)
    return out if raw else out.astype(jnp.float32)  # f32 upcast


def categorical(backbone, hidden, key, temperature, keep=None):
    """A token from q = softmax(keep(logits / T)) for final hidden states [B, D] (inside `weights(...)`) ->
    (token [B] int32, log q(token) [B] float32): jax.random.categorical(key, keep(logits / T))'s draw, the
    first index of argmax(gumbel + logits / T), so the same tokens for a key. keep: a sampler's filter,
    [B, V] -> [B, V] with the dropped tokens -inf (top-k, top-p, min-p), or None. Below the samplers, how: on
    one TPU chip without a filter, the output layer and the draw as one Pallas kernel (tpu_kernels.categorical
    where tpu_kernels.fits), the logits never written; else XLA's, the noised logits reduced in one pass
    (first_max), never written."""
    if keep is None and tpu_kernels.fits(backbone, hidden.shape[0], temperature):
        return tpu_kernels.categorical(backbone, hidden, key, temperature)
    raw = logits(backbone, hidden, raw=True)  # [B, V] in the compute dtype; float32 where read
    scaled = raw.astype(jnp.float32) / temperature
    kept = scaled if keep is None else keep(scaled)  # the same [B, V] computed once by XLA for both reads
    token = first_max(jax.random.gumbel(key, raw.shape) + kept)
    # log q: the token's scaled logit, gathered from `raw` (no [B, V] float32 written for one value a row)
    token_logit = jnp.take_along_axis(raw, token[:, None], -1)[:, 0].astype(jnp.float32) / temperature
    return token, token_logit - jax.nn.logsumexp(kept, -1)


def first_max(z):
    """The first index of each row's max, z [B, V] -> [B] int32 (jnp.argmax's), in ONE pass over z: a (value,
    index) reduce, where the max and then the first index at it read z twice (and z, the noised logits, was
    written in between). Ties: the smallest index; a row with a NaN gives V."""
    v = z.shape[-1]
    index = jnp.where(jnp.isnan(z), v, jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1))

    def better(a, b):  # of two (value, index): the larger value; at a tie the smaller index; a NaN first
        take = (b[0] > a[0]) | ((b[0] == a[0]) & (b[1] < a[1])) | (jnp.isnan(b[0]) & ~jnp.isnan(a[0]))
        return jnp.where(take, b[0], a[0]), jnp.where(take, b[1], a[1])

    init = (jnp.asarray(-jnp.inf, z.dtype), jnp.int32(v))
    return jax.lax.reduce((z, index), init, better, (z.ndim - 1,))[1]


def per_token(backbone, fn, arrays):
    """fn(*chunks) -> a tuple of [B, C] arrays, mapped over C positions of the [B, T, ...] `arrays` at a time,
    C the model's --logits-chunk (load_model; None: CHUNK_TOKENS // B where the whole would exceed WHOLE_LOGITS;
    T padded to whole chunks), each chunk under jax.checkpoint: what fn makes inside (a chunk's [B, C, V]
    logits) lives only there, forward and backward (recomputed), and [B, T, V] never does. -> fn's outputs
    [B, T] each. A chunk of 0 (or ≥ T): one call on the whole."""
    b, t = arrays[0].shape[:2]
    chunk = getattr(backbone, "logits_chunk", None)
    if chunk is None:  # the default: whole where the batch's float32 logits are small
        chunk = 0 if 4 * b * t * backbone.vocabulary_size <= WHOLE_LOGITS else max(1, CHUNK_TOKENS // b)
    if not chunk or chunk >= t:
        return fn(*arrays)
    n = -(-t // chunk)  # chunks; the last is padded

    def split(x):  # [B, T, ...] -> [n, B, C, ...]
        x = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(b, n, chunk, *x.shape[2:]).swapaxes(0, 1)

    return tuple(  # [n, B, C] -> [B, T]
        y.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
        for y in jax.lax.map(lambda xs: jax.checkpoint(fn)(*xs), tuple(split(x) for x in arrays))
    )


def token_logps(backbone, hidden, labels):
    """log p(label) in float32 [B, T] from final hidden states [B, T, D] and labels [B, T] (the token each
    position predicts: the caller shifts), the logits a chunk of positions at a time (per_token). Inside
    `weights(...)`: the output layer reads its weights from there."""

    def chunk_logps(h, y):  # [B, C, D], [B, C] -> ([B, C],)
        return (label_logp(logits(backbone, h, raw=True), y),)  # [B, C, V] in the compute dtype

    return per_token(backbone, chunk_logps, (hidden, labels))[0]


@jax.custom_vjp
def label_logp(z, y):
    """log softmax(z)[y] in float32 [...] from logits z [..., V] as the output layer computes them (bf16) and
    labels y [...]: z's float32 is made inside each reduction, and the backward (label_logp_bwd) writes
    dz = g·(onehot(y) − softmax(z)) straight in z's dtype: no float32 [..., V] array is written, forward or
    backward (autodiff's gather, scatter and saved exp each write one). The same values as
    take_along_axis(z32, y) − logsumexp(z32)."""
    return label_logp_fwd(z, y)[0]


def label_logp_fwd(z, y):
    z32 = z.astype(jnp.float32)
    lse = jax.nn.logsumexp(z32, -1)
    picked = jnp.sum(jnp.where(jnp.arange(z.shape[-1]) == y[..., None], z32, 0.0), -1)  # exact: one term
    return picked - lse, (z, y, lse)


def label_logp_bwd(res, g):
    z, y, lse = res
    onehot = jnp.arange(z.shape[-1]) == y[..., None]
    return (g[..., None] * (onehot - jnp.exp(z.astype(jnp.float32) - lse[..., None]))).astype(z.dtype), None


label_logp.defvjp(label_logp_fwd, label_logp_bwd)


def empty_cache(backbone, batch, length):
    """A zero cache, one entry per layer: a (K, V) pair [B, S, K, H] each (call_with_cache's [B, L, 2, S, K, H]
    is their stack: apart, a decode step updates each in place; stacked, as one array a layer, its attention
    split it into K and V copies and wrote them whole, every layer every step); Qwen 3.5's gated delta net
    layers: fixed-size states (the causal conv's last k-1 inputs [B, C, k-1], the recurrent state
    [B, Hv, Dk, Dv] f32); Gemma 4: a KV array [B, 2, S, K, H], each layer's own heads and head size, None for a
    layer reading an earlier one's (KV sharing)."""
    b, dtype = backbone, backbone.compute_dtype
    shape = (
        batch,
        length,
        b.num_key_value_heads,
        getattr(b, "head_dim", None) or b.hidden_dim // b.num_query_heads,
    )
    if isinstance(b, keras_hub.models.Gemma4Backbone):
        return tuple(
            None
            if layer.is_kv_shared_layer
            else jnp.zeros(
                (batch, 2, length, layer.attention.effective_num_kv_heads, layer.attention.head_dim), dtype
            )
            for layer in b.transformer_layers
        )
    if isinstance(b, keras_hub.models.Qwen3_5Backbone):
        conv = (
            batch,
            b.linear_num_key_heads * b.linear_key_head_dim * 2
            + b.linear_num_value_heads * b.linear_value_head_dim,
            b.linear_conv_kernel_dim - 1,
        )
        state = (batch, b.linear_num_value_heads, b.linear_key_head_dim, b.linear_value_head_dim)
        return tuple(
            (jnp.zeros(conv, dtype), jnp.zeros(state, jnp.float32))
            if kind == "linear_attention"
            else (jnp.zeros(shape, dtype),) * 2
            for kind in b.layer_types
        )
    return tuple((jnp.zeros(shape, dtype),) * 2 for _ in range(b.num_layers))


def cached_forward(backbone, token_ids, padding_mask, cache, index, last=False, hidden=False):
    """The family's CausalLM.call_with_cache plus a key padding mask, for left-padded prompts: token_ids
    [B, t] go to cache positions index…index+t-1; padding_mask [B, S] masks the padding as keys (the layers
    AND it with their causal / sliding-window mask). RoPE positions count the padding, which changes
    nothing: scores depend only on query-key distance (Gemma 3's sliding window too). Qwen 3.5's gated delta
    net layers see zeros at the padding, which leave their states at zero (as KerasHub's layer masks inputs).
    -> (logits [B, t, V] float32 (last: [B, 1, V]; hidden: the final norm's output [B, t, D] instead, for a
    sampler that computes its own), cache: one entry per layer, as empty_cache)."""
    gemma4 = isinstance(backbone, keras_hub.models.Gemma4Backbone)
    gemma = gemma4 or isinstance(backbone, (keras_hub.models.GemmaBackbone, keras_hub.models.Gemma3Backbone))
    x = backbone.token_embedding(token_ids)
    if gemma:
        x = x * jnp.sqrt(jnp.asarray(backbone.hidden_dim, x.dtype))  # Gemma's embedding scale
    per_layer = gemma4 and per_layer_inputs(backbone, token_ids, x)
    caches = []
    for i, (layer, c) in enumerate(zip(backbone.transformer_layers, cache)):
        if gemma4:  # its layer as Gemma 3's, plus a per-layer input (E2B, E4B); a KV-shared layer (E2B, E4B)
            # attends over an earlier layer's keys and values and writes none: its entry stays None
            shared = caches[layer.kv_shared_layer_index] if layer.is_kv_shared_layer else None
            x, new = layer(
                x,
                padding_mask=padding_mask,
                cache=c if shared is None else shared,
                cache_update_index=index,
                shared_kv=shared,
                per_layer_input=per_layer and per_layer[i],
            )
            # another layer's [B, 2, S, K, H]: only the t new positions [B, 2, t, K, H] go back into c, in
            # place (the layer's returned cache, a jnp.stack of its K and V copies, rewrote it all)
            new = (
                None
                if shared is not None
                else jax.lax.dynamic_update_slice(
                    c, jax.lax.dynamic_slice_in_dim(new, index, token_ids.shape[1], 2), (0, 0, index, 0, 0)
                )
            )
        elif gemma:  # Gemma 3's layer takes and returns (K, V) (and applies its query-key norms and local /
            # global RoPE and window); Gemma 1 / 2's takes them stacked, apart again below
            x, new = layer(
                x,
                padding_mask=padding_mask,
                cache=c if isinstance(backbone, keras_hub.models.Gemma3Backbone) else jnp.stack(c, 1),
                cache_update_index=index,
            )
        elif c[0].ndim == 3:  # Qwen 3.5's gated delta net (conv, state); the t new inputs zeroed at the
            # padding (its RMS norm keeps a zero row zero); given the mask instead, the layer would take its
            # conv state from the first real tokens' end, as if the padding were on the right
            here = jax.lax.dynamic_slice_in_dim(padding_mask, index, token_ids.shape[1], 1)  # [B, t]
            x, *new = layer(
                jnp.where(here[..., None], x, 0),
                self_attention_cache=c,
                self_attention_cache_update_index=index,
            )
            new = tuple(new)  # (conv state, recurrent state): small, replaced whole
        else:  # Llama 3, Mistral, Qwen 2.5 / 3 decoders, Qwen 3.5's attention layers
            x, new = layer(
                x,
                decoder_padding_mask=padding_mask,
                self_attention_cache=jnp.stack(c, 1),
                self_attention_cache_update_index=index,
            )
        if not gemma4 and not isinstance(new, tuple):  # (K, V) apart again: the layer split the stack
            # into K and V (XLA takes them as c's own arrays: a slice of a concatenation) and updated each
            # at the t new positions, so XLA writes those in place: no copy of the cache a step
            new = (new[:, 0], new[:, 1])
        caches.append(new)
    # last: the last position's logits alone [B, 1, V]: a prefill needs no more (B 256 × Q 64: 17 GB)
    x = backbone.layer_norm(x[:, -1:] if last else x)
    return (x if hidden else logits(backbone, x)), tuple(caches)


def per_layer_inputs(backbone, token_ids, x):
    """Gemma 4 E2B / E4B: each decoder layer's own input [B, t, P] from its slice of a per-layer token embedding
    and of a projection of the scaled embeddings `x`, as Gemma4Backbone computes them; None for other sizes."""
    b, p = backbone, backbone.hidden_size_per_layer_input
    if not p:
        return None
    emb = b.per_layer_token_embedding(token_ids).astype(x.dtype) * p**0.5  # [B, t, L·P]
    proj = b.per_layer_model_projection(x) * b.hidden_dim**-0.5
    return [
        (b.per_layer_projection_norm(proj[..., i * p : (i + 1) * p]) + emb[..., i * p : (i + 1) * p])
        * 2**-0.5
        for i in range(b.num_layers)
    ]


def split_variables(backbone, frozen_dtype=None, all_frozen=False):
    """(trainable values, frozen values) in the order `weights(...)` expects. frozen_dtype (the compute dtype,
    bfloat16): the frozen ones (LoRA's base; with all_frozen every weight: a reference, a reward model, a
    teacher, a model evaluated) are held in it from now on, their variables' float32 buffers replaced, so
    the model takes half the memory: a weight that is never updated needs no float32 master copy, and the
    bfloat16 policy casts every weight as a layer reads it anyway. None or float32: as loaded."""
    if frozen_dtype not in (None, "float32"):
        for variable in backbone.weights if all_frozen else backbone.non_trainable_variables:
            # keras 3.15 internals, as save_model's: the value, recast; a quantized kernel's scales stay
            if variable.dtype == "float32" and not variable.path.endswith(("kernel_scale", "g_idx")):
                variable._value = jax.jit(lambda x: x.astype(frozen_dtype))(variable.value)
    return (
        [v.value for v in backbone.trainable_variables],
        [v.value for v in backbone.non_trainable_variables],
    )


def frozen_copy(params, dtype):
    """A copy of `params` (e.g. the reference policy: the initial weights) laid out as they are, in `dtype`
    (the compute dtype: see split_variables; float32 or None: as they are)."""
    cast = (lambda x: x.astype(dtype)) if dtype not in (None, "float32") else jnp.copy
    return jax.jit(lambda p: jax.tree.map(cast, p), out_shardings=shardings(params))(params)


def save_model(model, params, path):
    """Write trained values back and save a KerasHub preset (LoRA merged into kernels; the adapters beside, in
    PEFT's files: lora.save_adapter). A run on a quantized base (--quantize) saves its LoRA merged into the base
    reloaded unquantized on the host, as PEFT merges a QLoRA adapter into the base in its own precision:
    merged into the int8 kernels, the update would round away."""
    for var, value in zip(model.backbone.trainable_variables, params):
        var.assign(value)
    if getattr(model, "unquantized", None):  # every process, on its host
        model = model.unquantized(
            jax.sharding.Mesh(np.reshape(jax.local_devices(backend="cpu")[:1], (1, 1)), ("data", "model"))
        )
        for var, value in zip(model.backbone.trainable_variables, params):
            var.assign(to_host(value))
    elif jax.process_count() > 1:
        # Keras saves host copies of the weights, and arrays spanning other hosts' devices have none: every
        # process gathers every weight and keeps the copy (sft.py samples from it after saving); 0 writes alone.
        for var in model.weights:
            var._value = jnp.asarray(to_host(var.value))  # keras 3.15 internals: a whole local copy
    if jax.process_index() != 0:
        return
    model.save_to_preset(path)  # makes the directory
    interop.plain_saved_dtype(path)  # mixed_bfloat16, which keras-hub's from_preset cannot read back
    lora.save_adapter(model.backbone, path)  # LoRA: its adapters beside, as PEFT writes them


def host_model(path):
    """A saved preset, text only, whole on the host CPU, with the scripts' start token: --export-hf's input."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        model = text_causal_lm(path)
    ensure_start_token(model.preprocessor.tokenizer, path)  # Qwen's: <|endoftext|>, as the scripts train
    return model


# A reward model (reward.py's `model/`): the CausalLM preset + reward_head.npz (+ .json: how it was normalised).
HEAD_FILE, HEAD_INFO = "reward_head.npz", "reward_head.json"


def check_reward_model(path, flag="--reward-model"):
    if not os.path.exists(os.path.join(path, HEAD_FILE)):
        raise UsageError(f"{flag} {path}: no {HEAD_FILE} here; expected the model/ dir written by reward.py")


def load_reward_model(path, mesh, dtype=None, lora_rank=0, flag="--reward-model", **lora):
    """-> (CausalLM, head {weight [D, 1], bias []}, float32) from a reward.py `model/` directory (`lora`:
    load_model's lora_alpha, lora_target_modules)."""
    check_reward_model(path, flag)
    with np.load(os.path.join(path, HEAD_FILE)) as f:  # the head: float32, replicated
        return load_model(path, mesh, dtype, 0, lora_rank, **lora), {
            k: put_global(np.asarray(f[k], np.float32), replicated(mesh)) for k in ("weight", "bias")
        }


def load_reward_fn(spec, flag="--reward-fn"):
    """`path.py:function` -> the function: TRL's f(prompts, completions, **kwargs) or f(prompts, responses)."""
    import importlib.util

    path, _, name = spec.rpartition(":")
    if not path or not os.path.exists(path):
        raise UsageError(f"{flag} {spec!r}: expected an existing `path.py:function`")
    module_spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise UsageError(f"{flag} {spec!r}: {path} has no function {name!r}")
    return getattr(module, name)


# the weights are jit arguments (closed over, they would be baked in as constants); the backbone is static
@functools.partial(jax.jit, static_argnums=0)
def reward_model_scores(backbone, params, frozen, head, token_ids, padding_mask):
    """reward.py's r_φ(x, y) = w·h + b, h the final hidden state at the padding mask's last True: [B] float32."""
    with weights(backbone, params, frozen):
        hidden = backbone(inputs(backbone, token_ids, padding_mask))  # [B, T, D]
    last = padding_mask.shape[1] - 1 - jnp.argmax(padding_mask[:, ::-1], 1)
    h = jnp.take_along_axis(hidden, last[:, None, None], 1)[:, 0].astype(jnp.float32)  # f32 head
    return (h @ head["weight"])[:, 0] + head["bias"]


def reward_fn_signature(fn):
    """-> (the parameters `fn` requires, all it names, whether it takes **kwargs), or None for the
    two-argument form f(prompts, responses) (two positional parameters, no **kwargs, not `completions`)."""
    import inspect

    params = inspect.signature(fn).parameters.values()
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not var_kw and "completions" not in [p.name for p in named] and len(named) == 2:
        return None
    return [p.name for p in named if p.default is p.empty], [p.name for p in named], var_kw


def described(fn):
    """`name (file:line)` of a reward function, for error messages."""
    code = getattr(fn, "__code__", None)
    return f"{fn.__name__} ({code.co_filename}:{code.co_firstlineno})" if code else fn.__name__


def call_reward_fn(fn, signature, prompts, texts, inputs, rows=()):
    """fn on the n completions `texts` in its form (`signature`: reward_fn_signature's): f(prompts, texts), or
    TRL's keyword arguments from `inputs` (reward_inputs) -> ([n] float64 scores, NaN where it returned None
    or NaN; [n] bool: it returned NaN itself); a UsageError naming fn when it raises (a KeyError: with the
    columns of the dataset `rows`, what it could have read) or returns anything else."""
    import traceback

    try:
        # f(prompts, responses), or TRL's keywords: those it names ([1]), or all where it takes **kwargs ([2])
        out = (
            fn(prompts, texts)
            if signature is None
            else fn(**{k: v for k, v in inputs.items() if signature[2] or k in signature[1]})
        )
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]  # the innermost frame: where in its code
        has = (
            f"; the rows' columns: {', '.join(sorted({k for r in rows for k in r}))}"
            if isinstance(e, KeyError) and any(rows)  # a row with a column
            else ""
        )
        raise UsageError(
            f"reward function {described(fn)} raised {type(e).__name__}: {e} "
            f"(at {where.filename}:{where.lineno}{has})"
        ) from None
    try:
        scores = [None if v is None else float(v) for v in out]
    except (TypeError, ValueError):
        raise UsageError(
            f"reward function {described(fn)} returned {str(out)[:80]!r}: expected one float "
            f"(or None) per completion"
        ) from None
    if len(scores) != len(texts):
        raise UsageError(
            f"reward function {described(fn)} returned {len(scores)} scores for {len(texts)} completions"
        )
    values = np.array([np.nan if v is None else v for v in scores], np.float64)
    return values, np.array([v is not None for v in scores], bool) & np.isnan(values)


def reward_names(fns):
    """One metric name per function, by position: its __name__; where two share it, `module.name` (the file's
    stem: data/toy.py:accuracy -> toy.accuracy); where those clash too, `module.name_<position, from 1>`."""
    names = [
        f"{f.__module__}.{f.__name__}" if [g.__name__ for g in fns].count(f.__name__) > 1 else f.__name__
        for f in fns
    ]
    return [f"{n}_{i + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]


TRL_INPUTS = ("prompts", "completions", "completion_ids")


def reward_inputs(prompts, texts, rows, completion_ids, messages=None):
    """TRL's keyword arguments of a reward function, each a list aligned with the completions: prompts and
    completions as the dataset holds them (a chat: the prompt's messages, each completion [{"role": "assistant",
    "content": text}], or its `messages`: a multi-turn completion's turns), completion_ids, every other column."""
    chat = [isinstance(r.get("prompt"), list) for r in rows]
    messages = messages or [[{"role": "assistant", "content": t}] for t in texts]
    return {
        "prompts": [r["prompt"] if c else p for r, p, c in zip(rows, prompts, chat)],
        "completions": [m if c else t for t, m, c in zip(texts, messages, chat)],
        "completion_ids": [list(map(int, x)) for x in completion_ids],
        **{
            k: [r.get(k) for r in rows]
            for k in sorted({k for r in rows for k in r} - {"prompt", "completion", *TRL_INPUTS})
        },
    }


def decode_completions(tokenizer, batch, sequence_lengths, context_length, stop_ids):
    """A rollout batch's responses cut before their stop token -> (texts, their token ids, lengths [B]: tokens
    before it (all R without one), has_eos [B]: ended by a stop token, EOS or another), on the host, whole:
    what the reward functions read (sequence_lengths [B]: the index of each response's stop token, or R-1)."""
    responses = to_host(batch["query_responses"][:, context_length:])
    has_eos = np.isin(responses, stop_ids).any(1)
    lengths = to_host(sequence_lengths) + 1 - has_eos
    ids = [list(x[:n]) for x, n in zip(responses, lengths)]
    return (
        [t.decode() if isinstance(t, bytes) else str(t) for t in tokenizer.detokenize(ids)],
        ids,
        lengths,
        has_eos,
    )


def reward_metrics(rewards, parts, lengths, has_eos):
    """TRL's reward and completion metrics of a rollout: the summed reward, each reward function's (or the
    reward model's) mean and std (a function's None, NaN here, left out of them as TRL does), the lengths."""
    return {
        "reward": float(rewards.mean()),
        **{
            f"rewards/{k}/{s}": float(f(v))
            for k, v in parts.items()
            for s, f in (("mean", np.nanmean), ("std", np.nanstd))
        },
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(1.0 - has_eos.mean()),
    }


class Scorer:
    """s(x, y) per completion, the one scoring call of ppo.py, grpo.py and evaluate.py (made by load_scorer):
    `scores, parts = scorer(prompts, texts, batch, rows, completion_ids, end)`, s the weighted sum of the parts:
    reward functions (TRL's form: reward_inputs, `messages` its multi-turn completions; or f(prompt texts,
    texts)) on the texts cut at `end`, the turn end (`rows`: each completion's dataset row), or reward.py's
    model on batch["query_responses"] / ["padding_mask"] [B, T]. A None or NaN leaves its function out of that
    sample's sum (TRL's nansum). -> scores [B] float32 over `data`, parts {reward_names' name or
    "reward_model": [B] float64 on the host, NaN for None}; every process passes the whole batch. `model`,
    `head`, `values`: a reward model's, its head and its weights (PPO's value model starts from the first
    two), else None."""

    def __init__(self, mesh, fns=(), weights=(), model=None, head=None, name=None, values=None):
        self.model = model
        self.head = head
        self.name = name
        self.on_data = NamedSharding(mesh, P("data"))  # scores [B], as the batch
        self.fns = [
            (f, w, reward_fn_signature(f), n)
            for f, w, n in zip(fns, weights or [1.0] * len(fns), reward_names(fns), strict=True)
        ]  # by position
        self.warned = set()  # the functions told once that their NaN counts as None
        self.values = values  # (trainable, frozen): split_variables'

    def check_columns(self, rows, flag="--dataset"):
        """Before the model loads: each TRL-form function's required parameters are inputs or columns."""
        have = {k for r in rows for k in r} | set(TRL_INPUTS)
        for f, _, signature, _ in self.fns:
            if missing := [k for k in (signature[0] if signature else []) if k not in have]:
                raise UsageError(
                    f"reward function {described(f)} takes {missing[0]!r}, which is not a "
                    f"column of {flag} (its columns: {', '.join(sorted(have - set(TRL_INPUTS)))})"
                )

    def __call__(self, prompts, texts, batch, rows, completion_ids, end=None, messages=None):
        texts = [t.split(end)[0] for t in texts] if end else list(texts)
        # TRL's keyword arguments, where a function takes them
        inputs = (
            reward_inputs(prompts, texts, rows, completion_ids, messages)
            if any(f[2] for f in self.fns)
            else None
        )
        parts, nan = {}, {}
        for f, _, signature, name in self.fns:
            parts[name], nan[name] = call_reward_fn(f, signature, prompts, texts, inputs, rows=rows)
            if nan[name].any() and name not in self.warned:  # TRL's nansum takes a NaN as a None
                self.warned.add(name)
                from tqdm import tqdm  # on a line of its own, above the progress bar

                tqdm.write(
                    f"warning: reward function {described(f)} returned NaN for {nan[name].sum()} of "
                    f"{len(texts)} completions: taken as None (does not apply), as TRL does",
                    sys.stderr,
                )
        if self.model is not None:  # the last part
            scores = reward_model_scores(
                self.model.backbone, *self.values, self.head, batch["query_responses"], batch["padding_mask"]
            )
            parts["reward_model"] = np.asarray(to_host(scores), np.float64)
        # w_k × s_k by position, the reward model's × 1: [parts, B], NaN where a function returned None or NaN
        weights = [w for _, w, _, _ in self.fns] + [1.0]
        weighted = np.stack([w * part for w, part in zip(weights, parts.values())])
        none = np.isnan(weighted).all(0)
        if none.any():
            i = int(np.argmax(none))
            said = ", ".join(
                f"{described(f)} returned {'NaN' if nan[n][i] else 'None'}" for f, _, _, n in self.fns
            )
            raise UsageError(
                f"every reward function returned None or NaN for completion {i} of the batch "
                f"(prompt {prompts[i][:80]!r}): {said}; at least one must score each completion"
            )
        return put_global(np.asarray(np.nansum(weighted, 0), np.float32), self.on_data), parts

    def check_tokenizer(self, tokenizer):
        """The reward model scores the policy's token ids as they are: refuse another vocabulary."""
        if self.model is not None and (
            self.model.preprocessor.tokenizer.vocabulary_size() != tokenizer.vocabulary_size()
        ):
            raise UsageError(
                f"--reward-model {self.name}: its tokenizer differs from the policy's "
                "(it scores the policy's token ids directly)"
            )


def load_scorer(
    mesh,
    dtype=None,
    frozen_dtype=None,
    reward_model=None,
    reward_fns=(),
    weights=(),
    value_model=False,
    lora_rank=0,
    **lora,
):
    """The Scorer of --reward-model (reward.py's model/, loaded sharded, its weights held in `frozen_dtype`:
    see split_variables), else of --reward-fn weighted by --reward-weights (empty: all 1); called before the
    policy loads. value_model (PPO's, which starts from the reward model; `lora_rank`, `lora`: its LoRA): the
    model's own weights stay as loaded for it, and the scorer holds its own copy in `frozen_dtype`."""
    if weights and len(weights) != len(reward_fns):
        raise UsageError(
            f"--reward-weights: {len(weights)} weights for {len(reward_fns)} --reward-fn functions"
        )
    if not reward_model:
        return Scorer(mesh, [load_reward_fn(spec) for spec in reward_fns], weights)
    model, head = load_reward_model(reward_model, mesh, dtype, lora_rank, **lora)
    return Scorer(
        mesh,
        model=model,
        head=head,
        name=reward_model,
        values=tuple(frozen_copy(v, frozen_dtype) for v in split_variables(model.backbone))
        if value_model  # the value model trains the loaded weights: the scorer's own copy
        else split_variables(model.backbone, frozen_dtype=frozen_dtype, all_frozen=True),
    )


# --- 3. File formats: dataset files and TRL's row formats -> text ---
def read_rows(path, flag="--dataset", config=None, split="train"):
    """[(row, line number)] of split `split` (None: the only one) of a .jsonl, a .json (JSON, or JSON Lines as
    `Dataset.to_json` writes them), or through `datasets`: a .parquet or .csv, a `save_to_disk` folder, a Hub id
    (`gsm8k`, `org/name`) or a local copy of a Hub repo, in configuration `config`. A file is one split, `train`."""
    formats = (".jsonl", ".json", ".parquet", ".csv")
    if not os.path.exists(path) and (path.endswith(formats) or path[:1] in "./~"):
        raise UsageError(f"{flag} {path}: no such file")
    if os.path.isfile(path) and not path.endswith(formats):
        raise UsageError(
            f"{flag} {path}: not a format read here; a data file is {', '.join(formats)} (or a saved dataset "
            "folder, or a Hub dataset id)"
        )
    if path.endswith((".jsonl", ".json")):
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            raise UsageError(
                f"{path}:{line}: not UTF-8 text (byte offset {e.start}: {raw[e.start : e.start + 4]!r})"
            ) from None
        rows = None
        if path.endswith(".json"):
            try:
                data = json.loads(text)
                rows = [(r, i) for i, r in enumerate(data if isinstance(data, list) else [data], 1)]
            except json.JSONDecodeError as e:
                if e.msg != "Extra data":  # "Extra data": more than one JSON value, so JSON Lines
                    raise UsageError(f"{path}:{e.lineno}: invalid JSON ({e.msg})")
        if rows is None:
            rows = []
            for i, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
                if line.strip():
                    try:
                        rows.append((json.loads(line), i))
                    except json.JSONDecodeError as e:
                        raise UsageError(f"{path}:{i}: invalid JSON ({e.msg})")
        splits = {"train": rows}
    else:
        splits = {  # each split's (row, its number from 1), read when taken
            name: ((r, i) for i, r in enumerate(dataset, 1))
            for name, dataset in interop.load_splits(path, config, flag).items()
        }
    split = split or (next(iter(splits)) if len(splits) == 1 else None)
    if split not in splits:
        split_flag = interop.DATA_FLAGS.get(flag, (None, None))[1]
        which = f"no split {split!r}" if split else "name a split" + f" ({split_flag})" * bool(split_flag)
        raise UsageError(f"{flag} {path}: {which}; its splits: {', '.join(splits)}")
    if not (rows := list(splits[split])):
        raise UsageError(f"{path}: no examples")
    for row, line in rows:  # TRL's vision-language rows: their images would be dropped silently
        if isinstance(row, dict) and {"image", "images"} & row.keys():
            raise UsageError(
                f"{path}:{line}: field {sorted({'image', 'images'} & row.keys())[0]!r}: "
                "the scripts train and sample on text only"
            )
    return rows


# A chat as its models' Hugging Face chat_template (tokenizer_config.json) writes it, the BOS being the
# scripts' start token: user and assistant turn prefixes, turn end, system turn prefix (None: no system role,
# so a leading system text + "\n\n" opens the first user turn), and whether contents are stripped (`| trim`).
Template = collections.namedtuple("Template", "user model end system trim")
CHAT_TEMPLATES = {
    # Gemma 1-3: the model's turn is "model"; no system role: Gemma 3 folds it in as here (1 and 2 refuse one)
    # https://huggingface.co/google/gemma-3-1b-it/blob/main/tokenizer_config.json
    "gemma": Template("<start_of_turn>user\n", "<start_of_turn>model\n", "<end_of_turn>\n", None, True),
    # Llama 3 Instruct: a header per role, system included (3.1+ also add a dated system turn; not here)
    # https://huggingface.co/meta-llama/Meta-Llama-3-8B-Instruct/blob/main/tokenizer_config.json
    "llama3": Template(
        "<|start_header_id|>user<|end_header_id|>\n\n",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
        "<|start_header_id|>system<|end_header_id|>\n\n",
        True,
    ),
    # Mistral Instruct v0.1/v0.2: "[INST] {system}\n\n{user} [/INST]{answer}</s>" (v0.3 moves the system
    # text to the last user turn); </s> is the EOS id (no text yields it): only the last answer gets the EOS
    # https://huggingface.co/mistralai/Mistral-7B-Instruct-v0.2/blob/main/tokenizer_config.json
    "mistral": Template("[INST] ", " [/INST]", "", None, False),
    # ChatML (Qwen 2.5, Qwen 3): with no system turn Qwen 2.5 adds a default one; this, as Qwen 3, does not
    # https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/tokenizer_config.json
    "chatml": Template(
        "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n", "<|im_start|>system\n", False
    ),
    # Qwen 3.5: ChatML, each answer opened by an empty thinking block, as its template writes an answer without
    # reasoning_content and its non-thinking generation prompt (enable_thinking=false, 0.8B's default, per its
    # card); it leaves the block out of answers before the last user turn, this does not
    # https://huggingface.co/Qwen/Qwen3.5-0.8B (its chat_template, as quoted in public discussions)
    "qwen3.5": Template(
        "<|im_start|>user\n",
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "<|im_end|>\n",
        "<|im_start|>system\n",
        False,
    ),
    # Gemma 4: <|turn>role ... <turn|>, with a system role; contents trimmed. Its non-thinking generation
    # prompt differs by size: E2B / E4B open the model's turn plainly, 26B-A4B and 31B with an empty thought
    # channel (gemma4_large), written here on every answer, as their template writes earlier answers
    # https://ai.google.dev/gemma/docs/core/prompt-formatting-gemma4, .../capabilities/thinking
    "gemma4": Template("<|turn>user\n", "<|turn>model\n", "<turn|>\n", "<|turn>system\n", True),
    "gemma4_large": Template(
        "<|turn>user\n", "<|turn>model\n<|channel>thought\n<channel|>", "<turn|>\n", "<|turn>system\n", True
    ),
}


def chat_template(model_name, name=None):
    """The template `name` (--chat-template), else the one of --model's family, known from its config
    before any weight loads; None for a family not in FAMILIES (a chat then stops with a UsageError)."""
    if name is not None and name not in CHAT_TEMPLATES:
        raise UsageError(f"--chat-template {name!r}: expected one of {', '.join(CHAT_TEMPLATES)}")
    return CHAT_TEMPLATES.get(name or family_template(resolve_model(model_name)))


def family_template(preset):
    """The name of the preset's own chat template (FAMILIES; Gemma 4 by size: 26B-A4B and 31B, the sizes
    without per-layer embeddings, have gemma4_large), from its config; None outside FAMILIES."""
    family = FAMILIES.get(backbone_class(preset).__name__)
    if family == "gemma4":
        config = interop.model_config(preset)  # a KerasHub preset's, or a Hugging Face config.json
        config = config.get("config") or config.get("text_config") or config
        family = "gemma4" if config.get("hidden_size_per_layer_input") else "gemma4_large"
    return family


def turn_end(template):
    """The template's end-of-turn marker (`<end_of_turn>`, `<|eot_id|>`, `<|im_end|>`), where a
    completion ends for reward functions; None without a template or marker (Mistral's is the EOS)."""
    return (template.end.strip() or None) if template else None


def stop_token_ids(tokenizer, template, extra=()):
    """The ids a sampled completion ends at, as the models' own generation configs (Gemma 3's eos_token_id
    is [1, 106]): the EOS, the template's turn end where the vocabulary holds it as one token, and `extra`
    (--stop-token: a token's text, else its id) -> a tuple of ints, EOS first."""
    vocab = set(tokenizer.get_vocabulary())
    size = tokenizer.vocabulary_size()
    end = turn_end(template)
    ids = [tokenizer.end_token_id] + ([tokenizer.token_to_id(end)] if end in vocab else [])
    for token in extra:
        if token not in vocab and not (token.isdigit() and int(token) < size):
            raise UsageError(
                f"--stop-token {token!r}: neither a token of this tokenizer's vocabulary nor an "
                f"id below its size {size}"
            )
        ids.append(tokenizer.token_to_id(token) if token in vocab else int(token))
    return tuple(dict.fromkeys(int(i) for i in ids))  # each once, in order


def _fold(messages, template):
    """[(role, turn prefix, content)] as the template writes them (where it has no system role, folded in)"""
    prefix = {"system": template.system, "user": template.user, "assistant": template.model}
    turns = [
        (m["role"], prefix[m["role"]], m["content"].strip() if template.trim else m["content"])
        for m in messages
    ]
    if template.system is None and turns and turns[0][0] == "system":  # Gemma, Mistral: "{system}\n\n{user}"
        role, start, content = turns[1]
        turns = [(role, start, messages[0]["content"] + "\n\n" + content)] + turns[2:]
    return turns


def render(messages, template):
    """Chat turns -> text, each role as the family's template writes it (CHAT_TEMPLATES)."""
    return "".join(start + content + template.end for _, start, content in _fold(messages, template))


def _messages(value, key, where, template):
    if template is None:
        raise UsageError(
            f"{where}: field {key!r} is a chat, and --model's family has no known chat template: "
            f"pass --chat-template ({', '.join(CHAT_TEMPLATES)})"
        )
    if (
        not isinstance(value, list)
        or not value
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        raise UsageError(
            f"{where}: field {key!r} must be a non-empty list of {{role, content}} objects, "
            "content a string (text only: no image parts)"
        )
    for i, m in enumerate(value):
        if m["role"] not in ("system", "user", "assistant"):
            raise UsageError(
                f"{where}: field {key!r}, turn {i + 1}: unknown role {m['role']!r} "
                "(expected 'system', 'user' or 'assistant')"
            )
        # no system role: a system turn opens the next user turn
        if (
            m["role"] == "system"
            and template.system is None
            and (i or [t["role"] for t in value[:2]] != ["system", "user"])
        ):
            raise UsageError(f"{where}: field {key!r}: a system turn must come first, then a user turn")
    return value


def _text(row, key, where):
    v = row.get(key)
    if not isinstance(v, str) or not v.strip():
        raise UsageError(f"{where}: field {key!r} must be a non-empty string, got {v!r:.40}")
    return v


def sft_segments(row, where, template):
    """An SFT row -> [(text, is_completion)] in order: `text`; `prompt`+`completion` as strings or as chats
    (TRL's conversational form: the completion's answers carry the loss); `messages` (its answers do)."""
    if not isinstance(row, dict):
        raise UsageError(f"{where}: expected a JSON object")
    if ("chosen" in row or "rejected" in row) and "completion" not in row:  # another script's data
        raise UsageError(
            f"{where}: this row holds 'chosen'/'rejected', i.e. preference data: train on it with dpo.py, "
            "simpo.py, orpo.py or reward.py (kto.py unpairs it); sft.py takes 'text', 'prompt'+'completion' "
            "or 'messages'"
        )
    if isinstance(row.get("label"), bool) and "completion" in row:  # TRL's unpaired preference form
        raise UsageError(
            f"{where}: this row looks like KTO's unpaired data (prompt, completion, label): kto.py trains on it; "
            "sft.py would imitate the undesirable (label false) completions too (to fine-tune on the desirable "
            "ones, keep the label-true rows without the column)"
        )
    if "messages" in row or any(isinstance(row.get(k), list) for k in ("prompt", "completion")):
        keys = ("messages",) if "messages" in row else ("prompt", "completion")
        chats = [_messages(row.get(k), k, where, template) for k in keys]
        if not any(m["role"] == "assistant" and m["content"].strip() for m in chats[-1]):
            raise UsageError(f"{where}: no assistant turn with text in {keys[-1]!r}: nothing to train on")
        turns = [(*turn, chat is chats[-1]) for chat in chats for turn in _fold(chat, template)]
        # up to the last answer: the turns after it train nothing (the EOS follows it)
        turns = turns[: max(i for i, turn in enumerate(turns) if turn[0] == "assistant") + 1]
        end, segments = template.end, []
        for role, start, content, trained in turns:
            if role == "assistant":
                segments += [
                    (start, False),
                    (content + end.rstrip("\n"), trained),
                    (end[len(end.rstrip("\n")) :], False),
                ]  # the turn end's newline, if any
            else:
                segments.append((start + content + end, False))
        return segments[:-1]  # the EOS follows the last assistant turn directly
    if "prompt" in row or "completion" in row:
        return [(_text(row, "prompt", where), False), (_text(row, "completion", where), True)]
    if "text" in row:
        return [(_text(row, "text", where), True)]
    raise UsageError(f"{where}: need 'text', 'prompt'+'completion' or 'messages' (got {sorted(row)})")


def preference_triple(row, where, template, names=("chosen", "rejected")):
    """A preference row -> (prompt, chosen, rejected) texts: explicit or implicit prompt, strings or messages.
    Implicit prompt (only `chosen`/`rejected`): their longest common prefix (of messages for chats; of
    characters for strings, a split space going to the responses). `names`: the fields read as chosen and
    rejected (unpaired_example reads `completion` as both)."""
    if not isinstance(row, dict):
        raise UsageError(f"{where}: expected a JSON object")
    if missing := [key for key in names if key not in row]:
        other = (  # another script's data
            "KTO's unpaired data (prompt, completion, label): kto.py"
            if "label" in row
            else "SFT data: sft.py"
            if {"text", "completion", "messages"} & set(row)
            else ""
        )
        raise UsageError(
            f"{where}: missing field {missing[0]!r} (need 'chosen', 'rejected', optional 'prompt')"
            + (f"; this row looks like {other} trains on it" if other else "")
        )
    if isinstance(row[names[0]], list):  # conversational: message lists
        prompt, chosen, rejected = (
            _messages(row[k], k, where, template) if k in row else [] for k in ("prompt", *names)
        )
        if "prompt" not in row:
            # the turns they share
            n = next(
                (i for i, (c, r) in enumerate(zip(chosen, rejected)) if c != r),
                min(len(chosen), len(rejected)),
            )
            prompt = chosen[:n]
            chosen, rejected = chosen[n:], rejected[n:]
        for name, msgs in zip(names, (chosen, rejected)):
            if not msgs or msgs[0]["role"] != "assistant" or not msgs[0]["content"].strip():
                raise UsageError(
                    f"{where}: {name!r} must continue the prompt with an assistant turn with text"
                )
        # each response: its turns without the first one's prefix and the last one's end (the EOS follows)
        responses = [
            render(msgs, template)[len(template.model) :].removesuffix(template.end)
            + template.end.rstrip("\n")
            for msgs in (chosen, rejected)
        ]
        return (render(prompt, template) + template.model, *responses)
    if "prompt" in row:  # each a non-empty string
        return _text(row, "prompt", where), _text(row, names[0], where), _text(row, names[1], where)
    chosen, rejected = _text(row, names[0], where), _text(row, names[1], where)
    n = len(os.path.commonprefix([chosen, rejected]))
    n -= n > 0 and chosen[n - 1] == " "  # " 2 8 9" vs " 2 5 9": the responses keep their leading space
    if n == 0 or not chosen[n:].strip() or not rejected[n:].strip():
        raise UsageError(
            f"{where}: without 'prompt', the prompt is the longest common prefix of "
            "'chosen' and 'rejected', which here leaves an empty prompt or response"
        )
    return chosen[:n], chosen[n:], rejected[n:]


def unpaired_example(row, where, template):
    """A row of TRL's unpaired format (KTO) -> (prompt, completion, label): `prompt` and `completion`
    strings or messages (rendered as preference_triple renders a pair), `label` a bool (True: desirable)."""
    for key in ("prompt", "completion", "label"):
        if not isinstance(row, dict) or key not in row:
            raise UsageError(f"{where}: missing field {key!r} (need 'prompt', 'completion', 'label')")
    if not isinstance(row["label"], bool):
        raise UsageError(f"{where}: field 'label' must be true or false, got {row['label']!r:.40}")
    return (*preference_triple(row, where, template, ("completion", "completion"))[:2], row["label"])


def prompt_text(row, where, template):
    """A prompt row: `prompt` as a string, or a message list rendered to open the model's turn."""
    value = row.get("prompt") if isinstance(row, dict) else None
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list):
        return render(_messages(value, "prompt", where, template), template) + template.model
    raise UsageError(f"{where}: need 'prompt' (a non-empty string or a list of {{role, content}})")


def read_dataset(path, form, template, flag="--dataset", config=None, split="train"):
    """Every row of `path` (read_rows) in TRL's format `form` ('sft', 'preference', 'prompt'), validated
    and rendered to text; a bad row stops with its file and line (exit 2)."""
    parse = {"sft": sft_segments, "preference": preference_triple, "prompt": prompt_text}[form]
    return [parse(row, f"{path}:{line}", template) for row, line in read_rows(path, flag, config, split)]


def eval_source(dataset, eval_dataset, eval_split, defaults):
    """The eval set -> (path, split, the flag its messages name), path None for none: --eval-dataset "", or your
    own --dataset without an eval set named (TRL evaluates only when asked; the bundled eval file goes with the
    bundled training file). --eval-split: that split of --eval-dataset if one other than the default is given,
    else of --dataset (TRL's dataset_test_split). defaults: the script's (dataset, eval_dataset) defaults."""
    if eval_split and not eval_dataset:
        raise UsageError(f'--eval-split {eval_split}: --eval-dataset "" turns evaluation off')
    if not eval_split and eval_dataset == defaults[1] and dataset != defaults[0]:
        return None, None, None
    if eval_split and eval_dataset == defaults[1]:
        return dataset, eval_split, "--eval-split of --dataset"
    return eval_dataset or None, eval_split, "--eval-dataset"


def read_prompts(path, template, flag="--dataset", config=None, split="train"):
    """TRL prompt rows -> (the prompts rendered for the model, the rows as read): what reward functions
    see (Scorer), a chat `prompt` as its message list and every other column (e.g. `answer`)."""
    rows = read_rows(path, flag, config, split)
    return [prompt_text(row, f"{path}:{line}", template) for row, line in rows], [row for row, _ in rows]


# --- 4. Data order: a pure function of (seed, step), so a resumed run sees the same batches ---
GROUP_WINDOW = 50  # --group-by-length: batches per length-sorted window (HF's megabatch of 50)


def _stream(n, start, count, seed):
    """Positions [start, start + count) of an endless stream over n examples, reshuffled per epoch."""
    return np.concatenate(
        [
            np.random.default_rng([seed, e]).permutation(n)
            for e in range(start // n, (start + count - 1) // n + 1)
        ]
    )[start % n :][:count]


def _local(idx):
    """This process's part of a global batch (each process loads its own slice)."""
    per_proc = len(idx) // jax.process_count()
    return idx[jax.process_index() * per_proc :][:per_proc]


def bucket_length(n, max_length):
    """The padded length of a batch whose longest sequence has n tokens: the smallest of 32, 48, 64, 96, 128,
    192, ... (powers of two and 1.5x midpoints) that holds it, at most max_length: at most 1/3 padding beyond
    the longest, and a step compiles at most once per bucket (11 shapes up to 1024, 13 up to 2048)."""
    b = 32
    while b < n:
        b = b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3
    return min(b, max_length)


def length_batch(lengths, step, batch_size, seed, max_length, group=False):
    """`step`'s batch: (this process's indices, the bucket of the whole batch's longest sequence, the whole
    batch's real tokens); lengths [N] or [N, k]: each example's k sequences (a pair: 2). group: each window
    of GROUP_WINDOW batches is sorted by length and dealt out in an order drawn from (seed, window), so a
    batch pads less. A pure function of (seed, step): resume is exact."""
    lengths = np.asarray(lengths).reshape(len(lengths), -1)
    if group:
        window, i = divmod(step, GROUP_WINDOW)
        idx = _stream(len(lengths), window * GROUP_WINDOW * batch_size, GROUP_WINDOW * batch_size, seed)
        idx = idx[np.argsort(lengths[idx].max(-1), kind="stable")].reshape(GROUP_WINDOW, batch_size)
        idx = idx[np.random.default_rng([seed, window, 1]).permutation(GROUP_WINDOW)[i]]
    else:
        idx = _stream(len(lengths), step * batch_size, batch_size, seed)
    return _local(idx), bucket_length(int(lengths[idx].max()), max_length), int(lengths[idx].sum())


def query_length(batch):
    """Qb, the width of a rollout batch's queries: query_responses [B, Qb+R] less response_mask [B, R]."""
    return batch["query_responses"].shape[1] - batch["response_mask"].shape[1]


def mini_batches(rng, batch_size, num_mini_batches, num_epochs, on_data):
    """An RL step's update order: index arrays [B / num_mini_batches] over its rollout batch, num_epochs
    passes (μ), each reshuffled by the host `rng` (a numpy Generator, checkpointed with the run)."""
    for _ in range(num_epochs):
        for part in np.split(rng.permutation(batch_size), num_mini_batches):  # equal parts: checked at start
            yield put_global(part, on_data)


def per_example(fn, data, batch_size, mesh, lengths=None, max_length=None):
    """fn(batch [1, B, ...]) -> a pytree of [B] arrays (one value an example) or scalars (a batch's sum), over
    every example once in global batches of B (each process passes its own slice) -> that pytree, the arrays
    [N] in the data's order, the scalars summed over the batches. The last batch wraps around: its repeats
    are trimmed from the arrays and carry no loss tokens (their `*loss_mask` rows are False), so a loss summed
    over the batches, each normalised by the whole set's count, is the whole set's. With lengths (as
    length_batch): examples go in length order, each batch cut to its bucket (one compilation per bucket)."""
    n = len(next(iter(data.values())))
    longest = None if lengths is None else np.asarray(lengths).reshape(n, -1).max(-1)
    order = np.arange(n) if lengths is None else np.argsort(longest, kind="stable")
    outs = []
    for i in range(0, n, batch_size):
        idx = order[np.arange(i, i + batch_size) % n]
        t = None if lengths is None else bucket_length(int(longest[idx].max()), max_length)
        mine = _local(idx)  # shard_batch takes this process's slice of the global batch
        first = _local(np.arange(i, i + batch_size) < n)[None, :, None]  # [1, B, 1]: not a repeat
        batch = {k: v[None, mine, :t] if v.ndim > 1 else v[None, mine] for k, v in data.items()}
        batch.update({k: v & first for k, v in batch.items() if k.endswith("loss_mask")})
        outs.append(jax.tree.map(to_host, fn(shard_batch(mesh, batch))))
    # the arrays come in `order`: put back in the data's
    return jax.tree.map(
        lambda *o: np.sum(o) if o[0].ndim == 0 else np.concatenate(o)[:n][np.argsort(order)], *outs
    )
