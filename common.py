"""What every script needs and no one reads to learn an algorithm (DESIGN §1).

Contents (in file order)
  1. Start-up    --help from Args' source before any heavy import (grouped by its comments);
                 `cli` (tyro, errors in one line); UsageError -> one line on stderr, exit 2
  2. Mesh        init_distributed, make_mesh, ShardedParallel (layouts), shard_batch, put_global,
                 to_host, init_optimizer (optimizer state laid out like the params)
  3. Models      MODEL_ALIASES, FAMILIES; resolve_model, hub_errors (a hub failure in one line),
                 load_model (created sharded), check_sampler; per-family model I/O: logits, empty_cache,
                 cached_forward (KV-cached, left padding); enable_remat + jit_step (--remat), split_variables,
                 save_model, export_hf (--export-hf), count_params; reward models (save/load_reward_model),
                 load_reward_fn
  4. Files       read_rows (.jsonl/.json/.parquet/Hub), CHAT_TEMPLATES / chat_template / render,
                 TRL's formats -> text (sft_segments, preference_triple, prompt_text), read_dataset
  5. Data order  batch_indices, length_batch (padded to a length bucket, optionally grouped by
                 length; pure functions of the step: resume is exact), bucket_length, per_example
  6. The run     Run: output dir and --resume/--overwrite, --max-steps from --num-epochs, args.json,
                 metrics.jsonl + TensorBoard
                 (+ W&B), progress bar, tokens/s and MFU, the non-finite stop, eval and
                 checkpoint cadence, SIGTERM/SIGINT, the final model and a summary line;
                 synced / phase_metrics: the generate / score / update timing of RL steps
  7. Accounting  peak_flops (DESIGN §8)
Mesh axes are ("data", "model") everywhere: batch over `data`, parameters over both.
"""

import ast
import contextlib
import functools
import glob
import json
import math
import os
import shutil
import signal
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------
# 1. Start-up: fast --help, one-line errors
# ---------------------------------------------------------------------------
def _help_from_source(path, width=100):
    """--help of the script at `path`, read from its `class Args` source (no import, so it is
    instant): one section per `# comment` in Args, each flag with its type or choices, its
    docstring and its default. Returns None if the file has no Args dataclass."""
    source = open(path).read()
    tree = ast.parse(source)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args"), None)
    if cls is None:
        return None
    lines, names = source.splitlines(), {"os": os, "common": sys.modules[__name__]}
    out = [f"usage: {os.path.basename(path)} [OPTIONS]", "", ast.get_docstring(tree) or "", ""]
    previous = cls.lineno
    for i, node in enumerate(cls.body):
        if not isinstance(node, ast.AnnAssign):
            continue
        for line in lines[previous:node.lineno - 1]:  # a comment between fields opens a section
            if line.strip().startswith("#"):
                out += ["", line.strip("# ").rstrip() + ":"]
        previous = node.end_lineno
        doc = cls.body[i + 1].value.value if i + 1 < len(cls.body) and isinstance(
            cls.body[i + 1], ast.Expr) and isinstance(cls.body[i + 1].value, ast.Constant) else ""
        flag, kind = "--" + node.target.id.replace("_", "-"), ast.unparse(node.annotation)
        if kind == "bool":
            flag = f"{flag}, --no-{flag[2:]}"
        elif "Literal[" in kind:  # Literal[...] or Literal[...] | None: list the choices
            literal = next(n for n in ast.walk(node.annotation) if isinstance(n, ast.Subscript))
            flag += " {" + ",".join(str(c.value) for c in ast.walk(literal.slice) if isinstance(c, ast.Constant)) + "}"
        else:
            flag += " " + kind.replace(" | None", "").upper()
        try:
            default = eval(compile(ast.Expression(node.value), path, "eval"), names)
            if isinstance(default, str) and default.startswith(HERE):
                default = os.path.relpath(default, HERE)  # a bundled file: show data/…
        except Exception:
            default = ast.unparse(node.value)
        text = " ".join(doc.split()) + f" (default: {default if default != '' else repr(default)})"
        out += [f"  {flag}"] + textwrap.wrap(text, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(out)


_main = getattr(sys.modules.get("__main__"), "__file__", None) or ""
if {"-h", "--help"} & set(sys.argv[1:]) and _main.endswith(".py") and os.path.dirname(
        os.path.abspath(_main)) in (HERE, os.path.join(HERE, "benchmarks")):  # one of our scripts
    _text = _help_from_source(_main)  # before the imports below, which take seconds (keras-hub)
    if _text is not None:
        with contextlib.suppress(BrokenPipeError):  # `--help | head`
            print(_text)
        os._exit(0)


class UsageError(Exception):
    """Bad input (flag, file, model name): reported in one line, exit code 2."""


def _excepthook(kind, value, tb, _default=sys.excepthook):
    if issubclass(kind, UsageError):  # raised anywhere in a script's set-up: one line, exit 2
        print(f"error: {value}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    _default(kind, value, tb)


sys.excepthook = _excepthook


def cli(args_class):
    """tyro.cli(Args), with tyro's boxed parse errors (bad choice, bad number…) in one line."""
    import io
    import tyro
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return tyro.cli(args_class)
    except SystemExit as e:
        if not e.code:
            raise
        text = []
        for line in err.getvalue().splitlines()[1:]:  # the first line is the box's title
            line = line.strip("│╭╮╰╯ \n")
            if set(line) <= {"─"}:
                break
            text.append(line)
        raise UsageError(" ".join(text) or err.getvalue().strip()) from None


os.environ.setdefault("KERAS_BACKEND", "jax")
if not (os.environ.get("JAX_PLATFORMS") or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
        or os.path.exists("/dev/nvidia0")):
    os.environ["JAX_PLATFORMS"] = "cpu"  # no accelerator: skip libtpu's noisy TPU probe
# keras-hub imports TensorFlow when it is installed (keras-hub 0.32 requires tensorflow-text), though
# only its tf.data tokenizer layers use it; without it they fall back to the `sentencepiece` and
# `tokenizers` packages, which give the same ids. Kept out, it costs nothing: start-up (every run,
# every test subprocess) takes 2.8 s instead of 5.1 s here.
for _name in ("tensorflow", "tensorflow_text"):
    sys.modules.setdefault(_name, None)  # `import tensorflow` now raises ImportError

import jax  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

TINY_TOKENIZER = os.path.join(HERE, "data", "tiny_tokenizer.model")

# Short names -> KerasHub preset names (the full list: keras_hub.models.CausalLM.presets). Each
# family here is checked offline by tests/test_families.py (README, "Model families").
MODEL_ALIASES = {
    "gemma_2b": "gemma_2b_en", "gemma_7b": "gemma_7b_en",
    "gemma_2b_it": "gemma_instruct_2b_en", "gemma_7b_it": "gemma_instruct_7b_en",
    "gemma2_2b": "gemma2_2b_en", "gemma2_9b": "gemma2_9b_en", "gemma2_27b": "gemma2_27b_en",
    "gemma2_2b_it": "gemma2_instruct_2b_en", "gemma2_9b_it": "gemma2_instruct_9b_en",
    "llama3_8b": "llama3_8b_en", "llama3_8b_it": "llama3_instruct_8b_en",
    "mistral_7b": "mistral_7b_en", "mistral_7b_it": "mistral_instruct_7b_en",
    "qwen2.5_0.5b": "qwen2.5_0.5b_en", "qwen2.5_0.5b_it": "qwen2.5_instruct_0.5b_en", "qwen2.5_7b": "qwen2.5_7b_en",
    "qwen3_0.6b": "qwen3_0.6b_en", "qwen3_8b": "qwen3_8b_en",
}
# Backbone class -> its chat template (CHAT_TEMPLATES). These are the families the KV-cached sampler
# (cached_forward) knows; Gemma 2 is a GemmaBackbone. Another family trains (its logits come from
# KerasHub's own output layer) but needs --chat-template for chats and has no sampler.
FAMILIES = {"GemmaBackbone": "gemma", "Llama3Backbone": "llama3", "MistralBackbone": "mistral",
            "QwenBackbone": "chatml", "Qwen3Backbone": "chatml"}
# The `tiny` model: a 4-layer Gemma (about 1.5M parameters) with the bundled tokenizer.
TINY_CONFIG = dict(num_layers=4, num_query_heads=4, num_key_value_heads=1, hidden_dim=192,
                   intermediate_dim=1024, head_dim=48)


def default_dtype():
    """The compute dtype: bfloat16 on accelerators, float32 on CPU (bf16 matmuls are slow on CPU)."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def dtype_policy(dtype):
    """Compute dtype -> Keras policy. Variables are always float32 (master weights, hence float32
    Adam moments: a bf16 weight near 0.01 has a step of 6e-5, so lr 1e-6 updates would round
    away); "mixed_bfloat16" casts each weight to bf16 as a layer reads it, stateless_call too."""
    return "mixed_bfloat16" if (dtype or default_dtype()) == "bfloat16" else "float32"


# ---------------------------------------------------------------------------
# 2. Multi-host start-up and the mesh
# ---------------------------------------------------------------------------
def init_distributed(coordinator_address=None, num_processes=None, process_id=None):
    """Start `jax.distributed` when several processes take part (flags or cluster env)."""
    if coordinator_address or (num_processes or 1) > 1:
        if os.environ.get("JAX_PLATFORMS") == "cpu":  # CPU collectives across processes need gloo
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    elif any(k in os.environ for k in ("TPU_WORKER_HOSTNAMES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")):
        jax.distributed.initialize()  # JAX auto-detects TPU pods, SLURM and Open MPI


def parse_mesh(spec):
    """'data=4,model=2' -> {'data': 4, 'model': 2}; default: every device on `data`."""
    n = jax.device_count()
    if not spec:
        return {"data": n, "model": 1}
    sizes = {"data": 1, "model": 1}
    for part in spec.split(","):
        name, _, size = part.partition("=")
        if name.strip() not in sizes or not size.strip().isdigit():
            raise UsageError(f"--mesh {spec!r}: expected e.g. 'data=4,model=2' (axes: data, model)")
        sizes[name.strip()] = int(size)
    if sizes["data"] * sizes["model"] != n:
        raise UsageError(f"--mesh {spec!r} has {sizes['data'] * sizes['model']} devices, but {n} are present")
    return sizes


def make_mesh(spec=None):
    """A `jax.sharding.Mesh` with axes ("data", "model") over all devices (all hosts)."""
    sizes = parse_mesh(spec)
    devices = np.asarray(jax.devices()).reshape(sizes["data"], sizes["model"])
    return jax.sharding.Mesh(devices, ("data", "model"))


class ShardedParallel(keras.distribution.ModelParallel):
    """Keras ModelParallel with the rules of DESIGN §4 filled in.

    Variables the backbone's layout map names keep that layout; every other
    variable of rank >= 2 shards its largest divisible dim over `data` (FSDP).
    Any mesh axis that does not divide its dim is dropped (replicated): e.g.
    Gemma-2B's single key/value head on `model=2`.
    """

    def get_variable_layout(self, variable):
        layout = super().get_variable_layout(variable)
        axes = list(layout.axes) if layout is not None else [None] * len(variable.shape)
        mesh = dict(zip(self.device_mesh.axis_names, self.device_mesh.shape))
        if all(a is None for a in axes) and len(variable.shape) >= 2 and mesh["data"] > 1:
            for i in np.argsort(variable.shape)[::-1]:
                if variable.shape[i] % mesh["data"] == 0:
                    axes[i] = "data"
                    break
        axes = [a if a is None or variable.shape[i] % mesh[a] == 0 else None for i, a in enumerate(axes)]
        return keras.distribution.TensorLayout(axes, self.device_mesh)


def distribution_for(mesh, backbone_cls):
    """The Keras distribution that creates each weight directly in its shards."""
    device_mesh = keras.distribution.DeviceMesh(
        tuple(mesh.devices.shape), mesh.axis_names, devices=mesh.devices.flatten())
    try:
        layout_map = backbone_cls.get_layout_map(device_mesh, "model", "data")
    except (AttributeError, NotImplementedError, TypeError):
        layout_map = keras.distribution.LayoutMap(device_mesh)
    return ShardedParallel(layout_map=layout_map, batch_dim_name="data")


def shard_batch(mesh, batch):
    """Place a dict of host arrays [A, B, ...] (A = accumulation steps) with B split over `data`.

    Multi-host: each process passes its own slice [A, B / processes, ...] of the global batch.
    """
    sharding = NamedSharding(mesh, P(None, "data"))
    if jax.process_count() == 1:
        return {k: jax.device_put(v, sharding) for k, v in batch.items()}
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def replicated(mesh):
    return NamedSharding(mesh, P())


def put_global(x, sharding):
    """A host array every process holds whole (e.g. a rollout's prompts) -> a global array.

    jax.device_put would do on one process; make_array_from_callback also works when the
    sharding spans other processes' devices (each process fills only its own shards).
    """
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def to_host(x):
    """A global array -> the whole NumPy array on every process (allgather across processes)."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def init_optimizer(optimizer, params, mesh):
    """optimizer.init(params) with explicit layouts: moments follow their parameter,
    scalars (step counts) are replicated. Returns (opt_state, its shardings).

    Pinning these (and the params') layouts as the train step's out_shardings keeps
    the state's layout fixed from step to step, so the step compiles exactly once.
    """
    structure = jax.tree.structure(params)
    like_params = lambda x: jax.tree.structure(x) == structure
    out = jax.tree.map(lambda sub: shardings(params) if like_params(sub) else replicated(mesh),
                       jax.eval_shape(optimizer.init, params), is_leaf=like_params)
    return jax.jit(optimizer.init, out_shardings=out)(params), out


# ---------------------------------------------------------------------------
# 3. Models
# ---------------------------------------------------------------------------
def resolve_model(name):
    """--model -> what `CausalLM.from_preset` takes (or 'tiny'); unknown names raise."""
    if name == "tiny":
        return "tiny"
    if name in MODEL_ALIASES:
        return MODEL_ALIASES[name]
    if "://" in name:  # kaggle://, hf://, modelscope:// handles
        return name
    if os.path.isdir(name):
        if not any(os.path.exists(os.path.join(name, f)) for f in ("config.json", "metadata.json")):
            raise UsageError(f"--model {name}: directory has neither config.json (KerasHub/HF) nor metadata.json")
        return name
    if name in keras_hub.models.CausalLM.presets:
        return name
    aliases = ", ".join(["tiny"] + sorted(MODEL_ALIASES))
    raise UsageError(f"unknown --model {name!r}. Aliases: {aliases}; or any KerasHub preset, "
                     "a kaggle:// or hf:// handle, or a local preset / Hugging Face directory")


def tiny_causal_lm(seed, dtype):
    """The offline `tiny` Gemma: random init from `seed`, bundled SentencePiece vocab;
    float32 weights computing in `dtype` (see dtype_policy)."""
    keras.utils.set_random_seed(seed)
    tokenizer = keras_hub.models.GemmaTokenizer(proto=TINY_TOKENIZER)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), dtype=dtype_policy(dtype), **TINY_CONFIG)
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=128)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor)


@functools.cache  # asked by the chat template, load_model, the sampler and --export-hf checks
def backbone_class(preset):
    """The preset's backbone class, from its config.json (downloaded: the first hub contact),
    fetched once per process however many callers ask."""
    if preset == "tiny":
        return keras_hub.models.GemmaBackbone
    from keras_hub.src.utils.preset_utils import get_preset_loader
    with hub_errors(preset):
        _fetch_config(preset)  # a hub failure stops here, in one line; it is not a fallback
    try:
        return get_preset_loader(preset).check_backbone_class()
    except Exception:  # an unknown architecture falls back to the generic sharding rule
        return keras_hub.models.Backbone


def _fetch_config(preset):
    """Download (or find cached) the preset's config.json, raising the hub's own error: KerasHub's
    loader turns a missing, gated or unreachable model into one generic 'has no config.json'."""
    from keras_hub.src.utils.preset_utils import get_file
    if preset.startswith("hf://"):
        import huggingface_hub as hf
        from huggingface_hub import constants
        repo = preset.removeprefix("hf://")
        if hf.try_to_load_from_cache(repo, "config.json") is None and not constants.HF_HUB_OFFLINE:
            # one HEAD request, no retries: when nothing is cached, hf_hub_download retries network
            # errors with backoff (23 s here) before failing
            hf.get_hf_file_metadata(hf.hf_hub_url(repo, "config.json"))
    get_file(preset, "config.json")


@contextlib.contextmanager
def hub_errors(preset):
    """A model-hub failure inside (Kaggle, Hugging Face, no network) -> UsageError: one line, exit 2."""
    try:
        yield
    except Exception as e:
        message = hub_error(preset, e)
        if message is None:
            raise
        raise UsageError(message) from None


def hub_error(preset, error):
    """What to do about `error` raised while fetching `preset` from a hub, in one line; None when
    it is no hub failure. Reads the whole exception chain: KerasHub re-raises the hubs' errors."""
    if preset == "tiny" or os.path.isdir(preset):
        return None
    chain, e = [], error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    kinds = {c.__name__ for x in chain for c in type(x).__mro__}
    text = " ".join(str(x) for x in chain)
    statuses = [getattr(getattr(x, "response", None), "status_code", None) for x in chain]
    status = next((s for s in statuses if isinstance(s, int)), None)  # HTTP errors carry their response
    offline = bool(kinds & {"ConnectionError", "ConnectError", "NetworkError", "TimeoutException", "Timeout",
                            "gaierror", "LocalEntryNotFoundError"})
    if preset.startswith("hf://"):
        return _hf_error(preset, kinds, text, status, offline)
    if "://" in preset and not preset.startswith("kaggle://"):
        return None  # modelscope:// and the like: their own messages
    return _kaggle_error(preset, kinds, text, status, offline)


_LOCAL = "or pass a local directory (a KerasHub preset or a Hugging Face checkpoint), or --model tiny"


def _hf_error(preset, kinds, text, status, offline):
    """hub_error for an hf:// handle."""
    repo = preset.removeprefix("hf://")
    page, token = f"https://huggingface.co/{repo}", "set HF_TOKEN or run `hf auth login`"
    if "GatedRepoError" in kinds:
        return f"--model {preset}: the repo is gated: accept its licence at {page}, then {token}; {_LOCAL}"
    if "RepositoryNotFoundError" in kinds:
        return (f"--model {preset}: no Hugging Face repo {repo!r} is visible: check the repo id at {page} "
                f"(for a private repo, {token}); {_LOCAL}")
    if "HFValidationError" in kinds or "Unexpected Hugging Face preset" in text:
        return f"--model {preset}: not a Hugging Face repo id; expected hf://{{org}}/{{model}}; {_LOCAL}"
    if "EntryNotFoundError" in kinds and not offline:
        return f"--model {preset}: the repo has no config.json at {page}: not a checkpoint KerasHub loads; {_LOCAL}"
    if offline:
        from huggingface_hub import constants
        why, fix = (("HF_HUB_OFFLINE is set", "unset it") if constants.HF_HUB_OFFLINE else
                    ("cannot reach the Hugging Face Hub (no network?)", "connect"))
        return (f"--model {preset}: {why} and the model is not in the local cache: {fix}, then {token} "
                f"if the repo is gated; {_LOCAL}")
    return f"--model {preset}: the Hugging Face Hub answered HTTP {status} for {page}; {_LOCAL}" if status else None


def _kaggle_error(preset, kinds, text, status, offline):
    """hub_error for a Kaggle handle or a KerasHub preset name (their files live on Kaggle)."""
    from keras_hub.src.utils.preset_utils import BUILTIN_PRESETS
    handle = BUILTIN_PRESETS.get(preset, {}).get("kaggle_handle", preset).removeprefix("kaggle://")
    page = "https://www.kaggle.com/models/" + "/".join(handle.split("/")[:2])
    try:
        import kagglehub.config
        user = kagglehub.config.get_kaggle_credentials()
    except ValueError as e:  # a malformed ~/.kaggle/kaggle.json
        return f"--model {preset}: {e}: fix it, or set KAGGLE_USERNAME and KAGGLE_KEY"
    creds = "set Kaggle credentials (KAGGLE_USERNAME and KAGGLE_KEY, or ~/.kaggle/kaggle.json)"
    who = f"the Kaggle account {user.username!r}" if user and user.username else "your Kaggle account"
    if status in (401, 403) or "is not accessible in preset directory" in text or kinds & {
            "CredentialError", "UnauthenticatedError"}:
        if user is None:
            return (f"--model {preset}: Kaggle refused kaggle://{handle} without credentials: {creds} for an "
                    f"account that has accepted the model's licence at {page}; {_LOCAL}")
        return (f"--model {preset}: Kaggle refused kaggle://{handle} to {who}: accept the model's licence at "
                f"{page} with that account, and check that its KAGGLE_KEY is current; {_LOCAL}")
    if status == 404 or "doesn't exist in preset directory" in text:
        return (f"--model {preset}: Kaggle has no model kaggle://{handle}: check the handle "
                f"(kaggle://{{org}}/{{model}}/keras/{{variant}}[/{{version}}], see {page}); {_LOCAL}")
    if "Unexpected Kaggle preset" in text:
        return (f"--model {preset}: not a Kaggle model handle; expected "
                f"kaggle://{{org}}/{{model}}/keras/{{variant}}[/{{version}}]; {_LOCAL}")
    if offline:
        then = f" and {creds} for an account that has accepted the model's licence at {page}" if user is None else ""
        return (f"--model {preset}: cannot reach Kaggle (no network?) to download kaggle://{handle}: "
                f"connect{then}; {_LOCAL}")
    return f"--model {preset}: Kaggle answered HTTP {status} for kaggle://{handle}; {_LOCAL}" if status else None


def check_sampler(name, flag="--model"):
    """The KV-cached sampler (cached_forward) knows the FAMILIES' decoder layers: refuse others early."""
    cls = backbone_class(resolve_model(name))
    if cls.__name__ not in FAMILIES:
        raise UsageError(f"{flag} {name}: the KV-cached sampler supports Gemma, Gemma 2, Llama 3, Mistral, "
                         f"Qwen 2.5 and Qwen 3 backbones, not {cls.__name__}")


def load_model(name, mesh, dtype=None, seed=0, lora_rank=0):
    """Resolve --model and build the CausalLM with every weight created sharded.

    Returns the KerasHub CausalLM (backbone + preprocessor/tokenizer). With
    `lora_rank > 0` the backbone's LoRA is enabled: only LoRA weights are trainable.
    `dtype` is the compute dtype; weights load as float32 whatever the checkpoint holds.
    """
    preset = resolve_model(name)
    with hub_errors(preset), distribution_for(mesh, backbone_class(preset)).scope():
        if preset == "tiny":
            model = tiny_causal_lm(seed, dtype)
        else:
            model = keras_hub.models.CausalLM.from_preset(preset, dtype=dtype_policy(dtype))
        if lora_rank:
            model.backbone.enable_lora(lora_rank)
    ensure_start_token(getattr(model.preprocessor, "tokenizer", None), name)
    return model


def ensure_start_token(tokenizer, name):
    """Every script writes [BOS] + text + [EOS]; Qwen's tokenizers have no BOS. Theirs becomes
    <|endoftext|>, which separates the packed documents of Qwen's pretraining: it opens a new one."""
    if tokenizer is not None and tokenizer.start_token_id is None:
        if "<|endoftext|>" not in tokenizer.get_vocabulary():
            raise UsageError(f"--model {name}: its tokenizer has no start token (BOS) and no <|endoftext|>")
        tokenizer.start_token_id = tokenizer.token_to_id("<|endoftext|>")


def logits(backbone, hidden):
    """Final hidden states [..., D] -> float32 logits [..., V]. KerasHub's ReversibleEmbedding is every
    family's output layer: tied (Gemma, Qwen) or its own matrix (Llama 3, Mistral), and Gemma 2's
    final_logit_soft_cap (c·tanh(z/c)) is applied inside it."""
    return backbone.token_embedding(hidden, reverse=True).astype(jnp.float32)  # f32 upcast


def empty_cache(backbone, batch, length):
    """A zero KV cache [B, L, 2, S, K, H], the layout of every FAMILIES' CausalLM.call_with_cache."""
    head_dim = getattr(backbone, "head_dim", None) or backbone.hidden_dim // backbone.num_query_heads
    return jnp.zeros((batch, backbone.num_layers, 2, length, backbone.num_key_value_heads, head_dim),
                     backbone.compute_dtype)


def cached_forward(backbone, token_ids, padding_mask, cache, index):
    """The family's CausalLM.call_with_cache plus a key padding mask, so left-padded prompts work.

    token_ids [B, t] are written at cache positions index…index+t-1; padding_mask [B, S] covers the
    whole cache, masking the prompts' left padding as attention keys (the decoder layers broadcast it
    over queries and AND it with their causal, and Mistral's sliding-window, mask). RoPE positions
    count the padding too, which changes nothing: RoPE scores depend only on the distance between
    query and key. -> (logits [B, t, V] float32, cache [B, L, 2, S, K, H]).
    """
    gemma = isinstance(backbone, keras_hub.models.GemmaBackbone)
    x = backbone.token_embedding(token_ids)
    if gemma:
        x = x * jnp.sqrt(jnp.asarray(backbone.hidden_dim, x.dtype))  # Gemma's embedding scale
    caches = []
    for i, layer in enumerate(backbone.transformer_layers):
        if gemma:
            x, c = layer(x, padding_mask=padding_mask, cache=cache[:, i], cache_update_index=index)
        else:  # Llama 3, Mistral, Qwen 2.5 / 3 decoders
            x, c = layer(x, decoder_padding_mask=padding_mask, self_attention_cache=cache[:, i],
                         self_attention_cache_update_index=index)
        caches.append(c)
    return logits(backbone, backbone.layer_norm(x)), jnp.stack(caches, 1)


def enable_remat(backbone, on=True):
    """Activation checkpointing per decoder block: each block's activations are recomputed
    in the backward pass, so only the block inputs [B, T, D] stay alive between forward and
    backward (about +1/3 FLOPs; what makes Gemma-2B DPO fit 16 GiB chips). Calls with a KV
    cache (generation) are left alone: they have no backward pass. `backbone.remat_on`, read
    when a step is traced, switches it (jit_step's --remat auto). Returns the backbone."""
    backbone.remat_on = on
    for layer in [] if hasattr(backbone, "_remat_layers") else getattr(backbone, "transformer_layers", []):
        def call(*args, _call=layer.call, **kwargs):
            if not backbone.remat_on or any(v is not None for k, v in kwargs.items()
                                            if "cache" in k and "index" not in k):
                return _call(*args, **kwargs)
            arrays = {k: v for k, v in kwargs.items() if hasattr(v, "shape")}
            rest = {k: v for k, v in kwargs.items() if k not in arrays}
            return jax.checkpoint(lambda a, kw: _call(*a, **kw, **rest))(args, arrays)
        layer.call = call
    backbone._remat_layers = True
    return backbone


def device_memory_limit():
    """Bytes one device may allocate; None where the backend sets no limit (CPU)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def jit_step(fn, args, backbones, length=None, **jit_kwargs):
    """jax.jit(fn, **jit_kwargs) with --remat (`args.remat`) applied to `backbones` (enable_remat'd).

    on / off: as asked. auto: off where the device sets no memory limit (CPU: remat is pure cost).
    Else, at the first call, fn is compiled ahead of time without remat for that call's argument
    shapes and shardings, the batch (third argument, leaves [A, B, T, ...]) at `length` tokens (the
    run's longest), and remat is turned on when the compiled peak per device (argument + output +
    temp − alias) exceeds 90% of the limit: the 10% covers what the analysis leaves out (allocator
    fragmentation, the runtime's own buffers, the next batch and eval arrays living beside the step).
    Costs one extra compile of the step (CPU-measured in benchmarks/RESULTS.md "Step performance").
    args.remat becomes the resolved "on"/"off" (args.json records it); one console line says why.
    """
    limit, resolved = device_memory_limit(), []

    def resolve(value, why):
        args.remat = value
        for backbone in backbones:
            backbone.remat_on = value == "on"
        if why and jax.process_index() == 0:
            from tqdm import tqdm
            tqdm.write(f"remat: auto -> {value} ({why})")  # above the progress bar the first step runs under
        return jax.jit(functools.partial(fn), **jit_kwargs)  # a new callable: traced afresh, with the switch

    if args.remat != "auto" or limit is None:
        return resolve("off" if args.remat == "auto" else args.remat,
                       args.remat == "auto" and f"{jax.devices()[0].platform}: no device memory limit")

    def step(*a):
        if not resolved:
            spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), a)
            at = lambda s: s.update(shape=s.shape[:2] + (length,) + s.shape[3:]) if length and s.ndim >= 3 else s
            t, spec = time.perf_counter(), (*spec[:2], jax.tree.map(at, spec[2]), *spec[3:])
            m = resolve("off", None).lower(*spec).compile().memory_analysis()
            peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
            why = (f"compiled peak {peak / 2**30:.2f} GiB of {limit / 2**30:.2f} GiB per device; "
                   f"checked in {time.perf_counter() - t:.1f} s")
            resolved.append(resolve("on" if peak > 0.9 * limit else "off", why))
        return resolved[0](*a)
    return step


def split_variables(backbone):
    """(trainable values, frozen values) in the order `stateless_call` expects."""
    return ([v.value for v in backbone.trainable_variables],
            [v.value for v in backbone.non_trainable_variables])


def save_model(model, params, path):
    """Write trained values back and save a KerasHub preset (LoRA merged into kernels)."""
    for var, value in zip(model.backbone.trainable_variables, params):
        var.assign(value)
    if jax.process_count() > 1:
        # Keras saves host copies of the weights, and arrays spanning other hosts' devices
        # have none: gather every weight (all processes take part); process 0 writes alone.
        from jax.experimental import multihost_utils
        gathered = [multihost_utils.process_allgather(v.value, tiled=True) for v in model.weights]
        if jax.process_index() != 0:
            return
        for var, value in zip(model.weights, gathered):
            var._value = jax.numpy.asarray(value)  # keras 3.15 internals: a local copy, only to save
    os.makedirs(path, exist_ok=True)
    model.save_to_preset(path)


# `architectures` per family where keras-hub 0.32's exporter leaves it out of config.json
# (transformers and KerasHub's own loader read it); the other families' exporters write it.
HF_ARCHITECTURES = {"GemmaBackbone": "GemmaForCausalLM", "QwenBackbone": "Qwen2ForCausalLM",
                    "GPT2Backbone": "GPT2LMHeadModel"}


def check_export_hf(name):
    """--export-hf: refuse (at start-up) a family keras-hub cannot write as a transformers checkpoint."""
    from keras_hub.src.utils.preset_utils import load_json
    from keras_hub.src.utils.transformers.export.hf_exporter import MODEL_EXPORTERS
    preset = resolve_model(name)
    family = backbone_class(preset).__name__
    if family == "GemmaBackbone" and preset != "tiny":  # Gemma 2 is a GemmaBackbone too, which the
        config = load_json(preset, "config.json")  # Gemma exporter would write as Gemma 1 (no post-norms)
        if config.get("model_type") == "gemma2" or any(config.get("config", {}).get(k) for k in (
                "use_post_ffw_norm", "use_post_attention_norm", "final_logit_soft_cap", "attention_logit_soft_cap")):
            family = "Gemma 2 (GemmaBackbone with post-norms and soft-caps)"
    if family not in MODEL_EXPORTERS:
        raise UsageError(f"--export-hf: keras-hub {keras_hub.__version__} cannot write {family} as a Hugging Face "
                         f"checkpoint (--model {name}); it can write {', '.join(sorted(MODEL_EXPORTERS))}")


def export_hf(preset_dir, path):
    """The saved KerasHub preset `preset_dir` (LoRA merged) -> a Hugging Face checkpoint in `path`:
    model.safetensors, config.json (with `architectures`), tokenizer files; written to path.tmp
    and renamed once complete. Loaded on the host CPU: the exporter needs whole weights."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        model = keras_hub.models.CausalLM.from_preset(preset_dir)
        model.export_to_transformers(tmp)
    with open(os.path.join(tmp, "config.json")) as f:
        config = json.load(f)
    config.setdefault("architectures", [HF_ARCHITECTURES.get(type(model.backbone).__name__)])
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def count_params(backbone):
    """N for FLOP accounting (DESIGN §8): every weight used in a matmul. A tied embedding is also the
    output matmul (Gemma, Qwen); an untied one (Llama 3, Mistral) is a lookup, and its output matrix
    is the matmul."""
    embedding = backbone.token_embedding
    lookup = embedding.embeddings if not embedding.tie_weights else None
    return int(sum(np.prod(v.shape) for v in backbone.weights if "lora" not in v.path and v is not lookup))


# A reward model (reward.py's `model/`): the CausalLM preset + reward_head.npz (+ .json: how it was normalised).
HEAD_FILE, HEAD_INFO = "reward_head.npz", "reward_head.json"


def check_reward_model(path, flag="--reward-model"):
    if not os.path.exists(os.path.join(path, HEAD_FILE)):
        raise UsageError(f"{flag} {path}: no {HEAD_FILE} here; expected the model/ dir written by reward.py")


def save_reward_model(model, params, head, info, path):
    """The backbone as a KerasHub preset (see save_model) + the scalar head {weight [D, 1], bias []}."""
    save_model(model, params, path)
    if jax.process_index() == 0:
        np.savez(os.path.join(path, HEAD_FILE), weight=np.asarray(head["weight"]), bias=np.asarray(head["bias"]))
        with open(os.path.join(path, HEAD_INFO), "w") as f:
            json.dump(info, f, indent=2)


def load_reward_model(path, mesh, dtype=None, lora_rank=0, flag="--reward-model"):
    """-> (CausalLM, head {weight [D, 1], bias []}, float32) from a reward.py `model/` directory."""
    check_reward_model(path, flag)
    model = load_model(path, mesh, dtype, 0, lora_rank)
    with np.load(os.path.join(path, HEAD_FILE)) as f:
        head = {"weight": np.asarray(f["weight"], np.float32), "bias": np.asarray(f["bias"], np.float32)}
    return model, jax.tree.map(lambda x: put_global(x, replicated(mesh)), head)


def load_reward_fn(spec, flag="--reward-fn"):
    """`path.py:function` -> the function f(prompts, responses) -> scores."""
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


# ---------------------------------------------------------------------------
# 4. File formats: dataset files and TRL's row formats -> text
# ---------------------------------------------------------------------------
def read_rows(path, flag="--dataset"):
    """[(row, line number)] from .jsonl/.json, or through `datasets` for .parquet and Hub ids/dirs."""
    local = path.endswith((".jsonl", ".json", ".parquet")) or os.sep in path or path.startswith(".")
    if local and not os.path.exists(path):
        raise UsageError(f"{flag} {path}: no such file")
    if path.endswith(".jsonl"):
        rows = []
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append((json.loads(line), i))
                    except json.JSONDecodeError as e:
                        raise UsageError(f"{path}:{i}: invalid JSON ({e.msg})")
    elif path.endswith(".json"):
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{e.lineno}: invalid JSON ({e.msg})")
        rows = [(r, i) for i, r in enumerate(data if isinstance(data, list) else [data], 1)]
    else:
        try:
            import datasets
        except ImportError:
            raise UsageError(f"{flag} {path}: parquet files and Hub datasets need `pip install datasets`")
        ds = (datasets.load_dataset("parquet", data_files=path, split="train") if path.endswith(".parquet")
              else datasets.load_from_disk(path) if os.path.isdir(path)
              else datasets.load_dataset(path, split="train"))
        rows = [(r, i) for i, r in enumerate(ds, 1)]
    if not rows:
        raise UsageError(f"{path}: no examples")
    return rows


# (user turn prefix, assistant turn prefix, turn end) per template; each follows the chat_template of
# its models' Hugging Face tokenizer_config.json (the BOS that opens them is the scripts' start token).
CHAT_TEMPLATES = {
    # Gemma 1, 2 and 3 (google/gemma-2b-it, gemma-2-2b-it, gemma-3-1b-it): the model's turn is "model"
    "gemma": ("<start_of_turn>user\n", "<start_of_turn>model\n", "<end_of_turn>\n"),
    # Llama 3 / 3.1 / 3.2 Instruct (meta-llama/Meta-Llama-3-8B-Instruct)
    "llama3": ("<|start_header_id|>user<|end_header_id|>\n\n",
               "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    # Mistral Instruct v0.1-v0.3 (mistralai/Mistral-7B-Instruct-v0.2): "[INST] {user} [/INST]{answer}</s>";
    # </s> is the EOS id, which no text tokenizes to: the scripts' EOS ends the last answer only.
    "mistral": ("[INST] ", " [/INST]", ""),
    # ChatML: Qwen 2.5 / Qwen 3 (Qwen/Qwen2.5-7B-Instruct; without a system turn Qwen 2.5's template
    # adds its default system prompt, which this one does not)
    "chatml": ("<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n"),
}


def chat_template(model_name, name=None):
    """The template `name` (--chat-template), else the one of --model's family, known from its config
    before any weight loads; None for a family not in FAMILIES (a chat then stops with a UsageError)."""
    if name is not None:
        if name not in CHAT_TEMPLATES:
            raise UsageError(f"--chat-template {name!r}: expected one of {', '.join(CHAT_TEMPLATES)}")
        return CHAT_TEMPLATES[name]
    family = FAMILIES.get(backbone_class(resolve_model(model_name)).__name__)
    return CHAT_TEMPLATES[family] if family else None


def render(messages, template):
    """Chat turns -> text (system turns fold into user turns, as Gemma's template does)."""
    user, model, end = template
    return "".join((model if m["role"] == "assistant" else user) + m["content"] + end for m in messages)


def _messages(value, key, where, template):
    if template is None:
        raise UsageError(f"{where}: field {key!r} is a chat, and --model's family has no known chat template: "
                         f"pass --chat-template ({', '.join(CHAT_TEMPLATES)})")
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        raise UsageError(f"{where}: field {key!r} must be a non-empty list of {{role, content}} objects")
    return value


def _text(row, key, where):
    v = row.get(key)
    if not isinstance(v, str) or not v.strip():
        raise UsageError(f"{where}: field {key!r} must be a non-empty string, got {v!r:.40}")
    return v


def sft_segments(row, where, template):
    """An SFT row (`text`, `prompt`+`completion`, or `messages`) -> [(text, is_completion)] in order."""
    if not isinstance(row, dict):
        raise UsageError(f"{where}: expected a JSON object")
    if "messages" in row:
        messages = _messages(row["messages"], "messages", where, template)
        user, model, end = template
        segments = []
        for m in messages:
            if m["role"] == "assistant":
                segments += [(model, False), (m["content"] + end.rstrip("\n"), True),
                             (end[len(end.rstrip("\n")):], False)]  # the turn end's newline, if any
            else:
                segments.append((user + m["content"] + end, False))
        return segments[:-1]  # the EOS follows the last assistant turn directly
    if "prompt" in row or "completion" in row:
        return [(_text(row, "prompt", where), False), (_text(row, "completion", where), True)]
    if "text" in row:
        return [(_text(row, "text", where), True)]
    raise UsageError(f"{where}: need 'text', 'prompt'+'completion' or 'messages' (got {sorted(row)})")


def preference_triple(row, where, template):
    """A preference row -> (prompt, chosen, rejected) texts: explicit or implicit prompt, strings or messages.

    Implicit prompt (only `chosen`/`rejected`): their longest common prefix (of messages for
    chats; of characters for strings, a split space going to the responses).
    """
    if not isinstance(row, dict):
        raise UsageError(f"{where}: expected a JSON object")
    for key in ("chosen", "rejected"):
        if key not in row:
            raise UsageError(f"{where}: missing field {key!r} (need 'chosen', 'rejected', optional 'prompt')")
    keys = [k for k in ("prompt", "chosen", "rejected") if k in row]
    if isinstance(row["chosen"], list):  # conversational: message lists
        prompt, chosen, rejected = (_messages(row[k], k, where, template) if k in row else []
                                    for k in ("prompt", "chosen", "rejected"))
        if "prompt" not in row:
            n = 0
            while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
                n += 1
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        model, end = template[1], template[2]
        responses = []
        for name, msgs in (("chosen", chosen), ("rejected", rejected)):
            if not msgs or msgs[0]["role"] != "assistant":
                raise UsageError(f"{where}: {name!r} must continue the prompt with an assistant turn")
            text = render(msgs, template)
            responses.append(text[len(model):len(text) - len(end)] + end.rstrip("\n"))  # EOS follows
        return (render(prompt, template) + model, *responses)
    for k in keys:
        _text(row, k, where)
    chosen, rejected = row["chosen"], row["rejected"]
    if "prompt" in row:
        return row["prompt"], chosen, rejected
    n = len(os.path.commonprefix([chosen, rejected]))
    n -= n > 0 and chosen[n - 1] == " "  # " 2 8 9" vs " 2 5 9": the responses keep their leading space
    if n == 0 or not chosen[n:].strip() or not rejected[n:].strip():
        raise UsageError(f"{where}: without 'prompt', the prompt is the longest common prefix of "
                         "'chosen' and 'rejected', which here leaves an empty prompt or response")
    return chosen[:n], chosen[n:], rejected[n:]


def prompt_text(row, where, template):
    """A prompt row: `prompt` as a string, or a message list rendered to open the model's turn."""
    value = row.get("prompt") if isinstance(row, dict) else None
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list):
        return render(_messages(value, "prompt", where, template), template) + template[1]
    raise UsageError(f"{where}: need 'prompt' (a non-empty string or a list of {{role, content}})")


FORMATS = {"sft": sft_segments, "preference": preference_triple, "prompt": prompt_text}


def read_dataset(path, form, template, flag="--dataset"):
    """Every row of `path` in TRL's format `form` ('sft', 'preference', 'prompt'), validated
    and rendered to text; a bad row stops with its file and line (exit 2)."""
    return [FORMATS[form](row, f"{path}:{line}", template) for row, line in read_rows(path, flag)]


# ---------------------------------------------------------------------------
# 5. Data order: a pure function of (seed, step), so a resumed run sees the same batches
# ---------------------------------------------------------------------------
GROUP_WINDOW = 50  # --group-by-length: batches per length-sorted window (HF's megabatch of 50)


def _stream(n, start, count, seed):
    """Positions [start, start + count) of an endless stream over n examples, reshuffled per epoch."""
    idx = np.concatenate([np.random.default_rng([seed, e]).permutation(n)
                          for e in range(start // n, (start + count - 1) // n + 1)])
    return idx[start % n:][:count]


def _local(idx):
    """This process's part of a global batch (each process loads its own slice)."""
    per_proc = len(idx) // jax.process_count()
    return idx[jax.process_index() * per_proc:][:per_proc]


def batch_indices(n, step, batch_size, seed):
    """This process's example indices for `step` of the stream: batch_size / processes of them."""
    return _local(_stream(n, step * batch_size, batch_size, seed))


def bucket_length(n, max_length):
    """The padded length of a batch whose longest sequence has n tokens: the smallest of 32, 48,
    64, 96, 128, 192, ... (powers of two and their 1.5x midpoints) that holds it, at most
    max_length. A batch pads at most 1/3 of its length beyond its longest sequence, and a run
    compiles its step at most once per bucket: 11 shapes up to 1024, 13 up to 2048."""
    b = 32
    while b < n:
        b = b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3
    return min(b, max_length)


def length_batch(lengths, step, batch_size, seed, max_length, group=False):
    """`step`'s batch: (this process's indices, its padded length, its real tokens), where
    lengths [N] or [N, k] are the real lengths of each example's k sequences (a pair: 2).

    The length is the bucket of the whole batch's longest sequence (every process agrees on
    it); real tokens count the whole batch. group: each window of GROUP_WINDOW batches of the
    stream is sorted by length and dealt out in an order drawn from (seed, window), so a batch
    holds similar lengths and pads less; both are pure functions of (seed, step): resume is exact.
    """
    lengths = np.asarray(lengths).reshape(len(lengths), -1)
    if group:
        window, i = divmod(step, GROUP_WINDOW)
        idx = _stream(len(lengths), window * GROUP_WINDOW * batch_size, GROUP_WINDOW * batch_size, seed)
        idx = idx[np.argsort(lengths[idx].max(-1), kind="stable")].reshape(GROUP_WINDOW, batch_size)
        idx = idx[np.random.default_rng([seed, window, 1]).permutation(GROUP_WINDOW)[i]]
    else:
        idx = _stream(len(lengths), step * batch_size, batch_size, seed)
    return _local(idx), bucket_length(int(lengths[idx].max()), max_length), int(lengths[idx].sum())


def per_example(fn, data, batch_size, mesh, lengths=None, max_length=None):
    """fn(batch [1, B, ...]) -> tuple of [B] arrays, over every example once in fixed-size
    batches (the last wraps around, then is trimmed). With lengths ([N] or [N, k], as
    length_batch): examples go in length order and each batch's [N, T] arrays are cut to its
    bucket (bucket_length), so padding is small and compilations are at most the bucket count;
    without: one shape, one compilation."""
    n = len(next(iter(data.values())))
    longest = None if lengths is None else np.asarray(lengths).reshape(n, -1).max(-1)
    order = np.arange(n) if lengths is None else np.argsort(longest, kind="stable")
    outs = []
    for i in range(0, n, batch_size):
        idx = order[np.arange(i, i + batch_size) % n]
        t = None if lengths is None else bucket_length(int(longest[idx].max()), max_length)
        batch = {k: v[None, idx, :t] if v.ndim > 1 else v[None, idx] for k, v in data.items()}
        outs.append([to_host(x) for x in fn(shard_batch(mesh, batch))])
    inverse = np.argsort(order)  # outputs come in `order`; put them back in the data's
    return tuple(np.concatenate(o)[:n][inverse] for o in zip(*outs))


# ---------------------------------------------------------------------------
# 6. The run's lifecycle
# ---------------------------------------------------------------------------
RUN_FILES = ("args.json", "metrics.jsonl", "checkpoints", "model", "model_hf")
# (flag, lowest allowed value, whether the lowest value itself is refused)
FLAG_RANGES = (("learning_rate", 0, True), ("batch_size", 1, False), ("grad_accum_steps", 1, False),
               ("max_steps", 0, False), ("num_epochs", 0, True), ("warmup_steps", 0, False), ("log_every", 1, False),
               ("eval_every", 0, False), ("save_every", 0, False))


def default_output_dir(script, model, seed):
    tag = os.path.basename(os.path.normpath(model))
    return os.path.join("runs", f"{script}__{tag}__{seed}__{time.strftime('%Y%m%d-%H%M%S')}")


def checkpoint_steps(output_dir):
    """Steps of the complete checkpoints (orbax renames a step's directory into place once written)."""
    path = os.path.join(output_dir, "checkpoints")
    return sorted(int(d) for d in os.listdir(path) if d.isdigit()) if os.path.isdir(path) else []


def synced(tree):
    """The time once every array of `tree` is computed (dispatch is asynchronous): a phase's end."""
    jax.block_until_ready(tree)
    return time.perf_counter()


def phase_metrics(updates, ticks, new_tokens):
    """An RL step's row (ppo, grpo): its updates' metrics averaged on the host (one sync), and the
    seconds of each phase from ticks [start, generated, scored] to now: generate, score, update."""
    fetched = jax.device_get(updates)
    generate, score, update = np.diff(ticks + [time.perf_counter()])
    return {**{k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]},
            "charts/generate_tokens_per_sec": new_tokens / generate, "charts/generate_time": generate,
            "charts/score_time": score, "charts/update_time": update}


class Run:
    """One training run's life, so that each script's loop shows only its algorithm:

        run = common.Run("dpo", args)      # flags, --output-dir and --resume checked; nothing written
        ...                                # read and check data, load the model, build the state
        state, _ = run.resume(state)       # the newest checkpoint with --resume, else as given
        for step in run.steps(flops_per_token, schedule):   # progress bar
            state, metrics = step_fn(state, ...)
            run.log(metrics, real, padded) # on device; one host sync per --log-every; real-token tokens/s
            if run.eval_due():
                run.log_eval(evaluate(state[0]))
            run.checkpoint(state)          # every --save-every steps, and on SIGTERM/SIGINT (then exit 0)
        run.finish(lambda path: common.save_model(model, state[0], path))

    Nothing is written until the first step has been compiled and dispatched (its run.log):
    until then SIGINT/SIGTERM end the process at once. From then on the first signal checkpoints
    at the next step boundary and exits 0, and a second one ends the process at once. model/ is
    renamed into place only once complete.
    """

    def __init__(self, script, args):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)  # start-up: nothing to save, so stop at once
        init_distributed(getattr(args, "coordinator_address", None), getattr(args, "num_processes", None),
                         getattr(args, "process_id", None))
        self.script, self.args, self.main, self._remat = script, args, jax.process_index() == 0, []
        for name, low, strict in FLAG_RANGES:
            value = getattr(args, name, None)
            if value is not None and (value <= low if strict else value < low):
                raise UsageError(f"--{name.replace('_', '-')} {value}: must be {'>' if strict else '>='} {low}")
        if getattr(args, "dtype", None) not in (None, "bfloat16", "float32"):
            raise UsageError(f"--dtype {args.dtype}: expected bfloat16 or float32")
        if getattr(args, "export_hf", False):
            check_export_hf(args.model)
        if getattr(args, "track", False):
            import importlib.util
            if importlib.util.find_spec("wandb") is None:
                raise UsageError("--track logs to Weights & Biases, which is not installed: pip install wandb")
        if hasattr(args, "dtype"):
            args.dtype = args.dtype or default_dtype()  # args.json records what ran
        args.output_dir = self.dir = args.output_dir or default_output_dir(script, args.model, args.seed)
        self.model_dir = os.path.join(self.dir, "model")
        self.mesh = make_mesh(getattr(args, "mesh", None))
        accum = getattr(args, "grad_accum_steps", None)
        if accum and args.batch_size % (self.mesh.shape["data"] * accum):
            raise UsageError(f"--batch-size {args.batch_size} must divide by data axis "
                             f"({self.mesh.shape['data']}) × --grad-accum-steps ({accum})")
        self._done, self._no_checkpoint = None, None  # --resume: steps of a finished run; why it cannot resume
        self.start = self.step = self._check_output_dir()
        self.stop_signal, self.last_train, self.last_eval = None, {}, {}
        self._pending, self._tokens, self._flops, self._paused, self._eval_started = [], 0, 0.0, 0.0, None
        self._padded, self._shapes = 0, set()
        self._opened, self._buffered, self._manager, self._started = False, [], None, time.perf_counter()

    def _check_output_dir(self):
        """The step to start from; refuses to touch a previous run unless asked (exit 2)."""
        args, d = self.args, self.dir
        held = [f for f in RUN_FILES if os.path.exists(os.path.join(d, f))]
        steps = checkpoint_steps(d)
        last = steps[-1] if steps else None
        finished = os.path.isdir(self.model_dir)
        if args.resume:
            if finished and "args.json" in held:
                with open(os.path.join(d, "args.json")) as f:
                    self._done = max(last or 0, json.load(f).get("max_steps") or 0)
            if last is None:
                self._no_checkpoint = (f"--resume: {d} holds no checkpoint to continue from"
                                       + ("" if held else " (no run there)")
                                       + "; checkpoints are written by --save-every N and on SIGTERM/SIGINT")
            self._exit_if_complete()  # with --max-steps None: in read_data, once it is derived
            return last or 0
        if held and not args.overwrite:
            what, hint = "a run without checkpoints", "pass --overwrite to replace it, or choose another --output-dir"
            if finished:
                what = "a finished run (model/)"
            elif last is not None:
                what, hint = f"an unfinished run (checkpoint at step {last})", \
                    "pass --resume to continue it or --overwrite to replace it"
            raise UsageError(f"--output-dir {d} already holds {what}; {hint}")
        return 0

    def _exit_if_complete(self):
        """--resume on a complete run: exit 0; with no checkpoint to continue from: exit 2."""
        if self.args.max_steps is None:
            return
        if self._done is not None and self.args.max_steps <= self._done:
            print(f"{self.dir}: this run is complete ({self._done} steps, model/ saved); nothing to resume")
            sys.exit(0)
        if self._no_checkpoint:
            raise UsageError(self._no_checkpoint)

    def _on_signal(self, signum, frame):
        self.stop_signal = signal.Signals(signum).name
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)  # a second signal ends the process at once
        os.write(1, f"\n{self.stop_signal}: checkpoint at the end of this step, then exit "
                    "(again to quit at once)\n".encode())  # os.write: safe inside a handler

    def _open(self):
        """After the first step: signals now checkpoint; the outputs are created (process 0)."""
        if self._opened:
            return
        self._opened = True
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        if not self.main:
            return
        if self.args.overwrite and not self.args.resume and os.path.isdir(self.dir):
            for f in os.listdir(self.dir):
                if f in RUN_FILES or f.startswith("events.out.tfevents"):
                    path = os.path.join(self.dir, f)
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, "args.json.tmp"), "w") as f:
            json.dump(vars(self.args), f, indent=2, default=str)
        os.replace(os.path.join(self.dir, "args.json.tmp"), os.path.join(self.dir, "args.json"))
        path = os.path.join(self.dir, "metrics.jsonl")
        if self.args.resume and os.path.exists(path):  # drop rows logged past the checkpoint
            with open(path) as f:
                kept = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= self.start]
            with open(path, "w") as f:
                f.writelines(kept)
        from tensorboardX import SummaryWriter
        self._metrics, self._tb, self._wandb = open(path, "a"), SummaryWriter(self.dir), None
        if getattr(self.args, "track", False):
            import wandb
            self._wandb = wandb.init(config=vars(self.args), name=os.path.basename(self.dir))
        for step, row in self._buffered:
            self._write(step, row)

    def _write(self, step, row):
        if not self._opened:
            self._buffered.append((step, row))
        elif self.main:
            self._metrics.write(json.dumps({"step": int(step), **row}) + "\n")
            self._metrics.flush()
            for k, v in row.items():
                self._tb.add_scalar(k, v, step)
            if self._wandb:
                self._wandb.log(row, step=step)

    def read_data(self, form):
        """(train rows, eval rows) of --dataset / --eval-dataset in TRL's `form`, rendered with
        --chat-template or --model's family's chat template: checked before the model loads.
        --max-steps None becomes ceil(--num-epochs × rows / rows per step) here (GRPO: batch_size /
        num_generations prompts a step), before training starts; args.json records it, so --resume
        derives the same."""
        args = self.args
        template = chat_template(args.model, getattr(args, "chat_template", None))
        path = getattr(args, "eval_dataset", None)
        evals = read_dataset(path, form, template, "--eval-dataset") if path else []
        train = read_dataset(args.dataset, form, template)
        if args.max_steps is None:
            per_step = args.batch_size // getattr(args, "num_generations", 1)
            args.max_steps = max(1, math.ceil(args.num_epochs * len(train) / per_step))
            if self.main:
                print(f"--max-steps {args.max_steps}: {args.num_epochs:g} epochs of {len(train)} rows, "
                      f"{per_step} a step")
        self._exit_if_complete()
        return train, evals

    def load_model(self):
        """--model created sharded over the mesh, with --lora-rank and --remat (see jit_step) applied."""
        args = self.args
        model = load_model(args.model, self.mesh, args.dtype, args.seed, args.lora_rank)
        return self.remat(model)

    def remat(self, model):
        """--remat for `model` (a CausalLM) when jit_step builds the train step."""
        if self.args.remat != "off":
            self._remat.append(enable_remat(model.backbone, self.args.remat == "on"))
        return model

    def jit_step(self, fn, length=None, **jit_kwargs):
        """The train step, jitted with --remat resolved (common.jit_step)."""
        return jit_step(fn, self.args, self._remat, length, **jit_kwargs)

    def resume(self, state, meta=None):
        """(state, meta) of the newest checkpoint with --resume (shaped and sharded like `state`:
        a pytree of arrays), else as given. The data position is the step itself."""
        if not self.start:
            return state, meta
        ocp, manager = self._checkpoints()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = manager.restore(self.start, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        print(f"resumed from step {self.start}")
        return restored.state, restored.meta

    def _checkpoints(self):
        """(orbax, its manager), made on first use. orbax is the JAX standard: each process writes
        its shards, a step appears only once complete, and the newest 3 are kept."""
        import orbax.checkpoint as ocp
        if self._manager is None:
            self._manager = ocp.CheckpointManager(
                os.path.abspath(os.path.join(self.dir, "checkpoints")),
                options=ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=False))
        return ocp, self._manager

    def steps(self, flops_per_token=0, learning_rate=None, show=(), summed=()):
        """Step indices from the start (or the resumed step) to --max-steps, with a progress bar.

        flops_per_token: for charts/mfu (DESIGN §8); learning_rate: the schedule, for
        charts/learning_rate; show: metrics on the progress bar; summed: metrics logged as a
        count per interval rather than a mean.
        """
        from tqdm import tqdm
        self._flops_per_token, self._lr, self._show, self._summed = flops_per_token, learning_rate, show, summed
        self._peak, self._t0, self._paused = peak_flops(), time.perf_counter(), 0.0
        self._bar = tqdm(total=self.args.max_steps, initial=self.start, desc=self.script, dynamic_ncols=True,
                         disable=not self.main)
        for step in range(self.start, self.args.max_steps):
            self.step = step + 1  # updates done once this step's body has run
            yield step  # the body's run.log opens the outputs after the first step
            self._bar.update(1)
        self._bar.close()

    def log(self, metrics, tokens=0, padded=None, flops=None):
        """Keep one step's metrics (device arrays: no host sync) and the real (non-pad) tokens it
        trained on, which tokens/s and MFU count (flops: when not tokens × flops_per_token);
        padded: the tokens of its padded batch, for charts/padding_fraction and charts/compilations
        (the distinct batch shapes so far: the step compiles once per shape). Every --log-every
        steps and at the last, fetch them in one sync, stop on a non-finite train/loss, and log
        their means."""
        self._open()  # the first step is compiled and dispatched: from here on a signal checkpoints
        self._pending.append(metrics)
        self._tokens += tokens
        if padded:
            self._padded += padded
            self._shapes.add(padded)  # a fixed --batch-size: one padded size per length bucket
        self._flops += tokens * self._flops_per_token if flops is None else flops
        if self.step % getattr(self.args, "log_every", 1) == 0 or self.step == self.args.max_steps:
            self._flush()

    def _flush(self):
        if not self._pending:
            return
        fetched = jax.device_get(self._pending)
        elapsed = time.perf_counter() - self._t0 - self._paused  # after the fetch: dispatch is async
        first = self.step - len(fetched) + 1
        bad = [first + i for i, m in enumerate(fetched) if not np.isfinite(m.get("train/loss", 0.0))]
        skip = getattr(self.args, "skip_nonfinite", None)
        if bad and not skip:
            self.close()
            print(f"error: non-finite train/loss at step {bad[0]}; the newest checkpoint is the last good "
                  "state (rerun with --resume and a lower --learning-rate"
                  + (", or --skip-nonfinite)" if skip is not None else ")"), file=sys.stderr)
            sys.exit(1)
        row = {k: float((np.sum if k in self._summed else np.mean)([m[k] for m in fetched])) for k in fetched[0]}
        if self._lr is not None:
            row["charts/learning_rate"] = float(self._lr(self.step - 1))
        row["charts/tokens_per_sec"] = self._tokens / elapsed
        row["charts/mfu"] = self._flops / elapsed / self._peak
        row["charts/tokens"], row["charts/flops"] = float(self._tokens), float(self._flops)  # the interval's (sums)
        if self._padded:
            row["charts/padding_fraction"] = 1.0 - self._tokens / self._padded
            row["charts/compilations"] = float(len(self._shapes))
        self._write(self.step, row)
        self.last_train = row
        shown = {k.split("/")[-1]: f"{row[k]:.4g}" for k in ("train/loss", *self._show) if k in row}
        self._bar.set_postfix(**shown, tok_s=f"{row['charts/tokens_per_sec']:.0f}")
        self._pending, self._tokens, self._flops, self._padded = [], 0, 0.0, 0
        self._t0, self._paused = time.perf_counter(), 0.0

    def eval_due(self):
        """True every --eval-every steps and at the last (eval time is kept out of tokens/s)."""
        every = getattr(self.args, "eval_every", 0)
        due = bool(every) and (self.step % every == 0 or self.step == self.args.max_steps)
        self._eval_started = time.perf_counter() if due else None
        return due

    def log_eval(self, row):
        """Log eval metrics (host floats, names prefixed eval/) at the current step, and print them."""
        row = {k: float(v) for k, v in row.items()}
        self._write(self.step, row)
        self.last_eval = row
        print(f"step {self.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in list(row.items())[:3]), flush=True)
        if self._eval_started is not None:
            self._paused += time.perf_counter() - self._eval_started
            self._eval_started = None

    def checkpoint(self, state, meta=None):
        """Every --save-every steps, and when a SIGTERM/SIGINT has arrived: log what is pending,
        save `state` (a pytree of arrays) + meta (JSON) + the step; after a signal, exit 0."""
        stopping = self.stop_signal  # read once: a signal arriving later is handled at the next step
        every = getattr(self.args, "save_every", 0)
        if not (stopping or (every and self.step % every == 0)):
            return
        self._open()
        self._flush()
        t = time.perf_counter()
        ocp, manager = self._checkpoints()
        manager.save(self.step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"step": self.step, **(meta or {})})))
        manager.wait_until_finished()
        self._paused += time.perf_counter() - t
        if stopping:
            self.close()
            print(f"{stopping}: checkpoint saved at step {self.step}; continue with --resume", flush=True)
            sys.exit(0)

    def finish(self, save):
        """save(path) writes the final model into model.tmp/, renamed to model/ once complete;
        then one summary line (last train and eval metrics, where the outputs are)."""
        self._open()
        self._flush()
        tmp = self.model_dir + ".tmp"
        if self.main and os.path.exists(tmp):
            shutil.rmtree(tmp)
        save(tmp)
        if self.main:
            if os.path.exists(self.model_dir):
                shutil.rmtree(self.model_dir)
            os.replace(tmp, self.model_dir)
            if getattr(self.args, "export_hf", False):
                export_hf(self.model_dir, os.path.join(self.dir, "model_hf"))
        self.close()
        shown = {k: self.last_train[k] for k in ("train/loss", *self._show) if k in self.last_train}
        shown.update(list(self.last_eval.items())[:2])
        took = time.perf_counter() - self._started
        print(f"done: {self.args.max_steps} steps in {took // 60:.0f}m{took % 60:02.0f}s; "
              + ", ".join(f"{k} {v:.4g}" for k, v in shown.items())
              + f"; outputs in {self.dir} (model/{', model_hf/' if getattr(self.args, 'export_hf', False) else ''}"
              + ", metrics.jsonl, args.json)", flush=True)

    def close(self):
        if self._opened and self.main:
            self._metrics.close()
            self._tb.close()
            if self._wandb:
                self._wandb.finish()


# ---------------------------------------------------------------------------
# 7. Performance accounting (DESIGN §8)
# ---------------------------------------------------------------------------
# Dense bf16 peak FLOP/s per chip, from the vendors' datasheets.
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
              "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12,
              "H100": 989e12, "H200": 989e12, "A100": 312e12}
_measured_peak = {}


def peak_flops():
    """Peak FLOP/s of all devices together: the table above per chip, or on CPU (and
    unknown kinds) a measured float32 matmul. Simulated CPU devices share the host's
    cores, so on CPU the host peak counts once per process, not once per device."""
    kind = jax.devices()[0].device_kind
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return flops * jax.device_count()
    return _measured_matmul_flops(kind) * jax.process_count()


def _measured_matmul_flops(kind):
    if kind not in _measured_peak:
        _measured_peak[kind] = matmul_flops_per_sec()
    return _measured_peak[kind]


def matmul_flops_per_sec(n=1024, repeats=5):
    """FLOP/s of a float32 n × n matmul on this process's first device, best of `repeats` (measured now)."""
    x = jax.device_put(np.ones((n, n), np.float32), jax.local_devices()[0])
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times)
