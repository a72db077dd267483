"""The outside world: the Hugging Face Hub and Kaggle, their files and formats, and fixes to upstream.
  1. Base         HERE, TINY_TOKENIZER (the bundled `tiny` vocabulary), UsageError (bad input: one line,
                  exit 2; every module raises it), before_keras (the JAX backend, the CPU without an
                  accelerator, no TensorFlow)
  2. Tokenizers   BPE_SPLITS, fix_bpe_splits (keras-hub's byte-level BPE splits words as its models' own
                  tokenizers do)
  3. Model hubs   MODEL_ALIASES (--model's short names), model_config (a preset's config.json, read once),
                  hub_errors / hub_error (a Kaggle or Hugging Face failure in one line saying what to do),
                  loaded_not_drawn (a checkpoint's weights made as zeros, not drawn, before they load),
                  NETWORK_ERRORS, hub_unreachable; plain_saved_dtype (a bf16-trained preset that keras-hub
                  can read back)
  4. Datasets     load_splits (a Hub id, a local copy of a Hub repo, a saved folder, a .parquet or .csv),
                  DATA_FLAGS
  5. --export-hf  check_export_hf (refused at start-up), hf_tokenizer (tokenizer.json), export_hf
                  (model.safetensors, config.json, tokenizer files), HF_CHAT_TEMPLATES (Jinja)
  6. TRL's flags  TRL_FLAGS (TRL's flag names spelled otherwise here -> this project's)
The bottom of the chain interop <- common <- plumbing: it needs nothing of the project's, so what every
module raises (UsageError) lives here. common.py (what an algorithm calls) reads models and datasets
through it; plumbing.py (the run shell) calls its --export-hf at the start and the end of a run. No
algorithm file, evaluate.py or compare.py imports it. Only the standard library loads with it: keras,
keras-hub, tokenizers, datasets and the hubs' clients are imported inside the functions that use them."""

import contextlib
import functools
import glob
import json
import os
import shutil
import sys
import unittest.mock

# --- 1. Base: the repository's place, `tiny`'s vocabulary, bad input, the start-up before keras ---
HERE = os.path.dirname(os.path.abspath(__file__))
TINY_TOKENIZER = os.path.join(HERE, "data", "tiny_tokenizer.model")  # `tiny`'s SentencePiece vocabulary


class UsageError(Exception):
    """Bad input (flag, file, model name): one line on stderr, exit code 2."""


def before_keras():
    """What common.py sets as it imports, before keras loads: the JAX backend, the CPU where no accelerator is
    present (skipping libtpu's noisy TPU probe), and no TensorFlow. keras-hub imports TensorFlow when it is
    installed (keras-hub 0.32 requires tensorflow-text), though only its tf.data tokenizer layers use it;
    without it they fall back to the `sentencepiece` and `tokenizers` packages, which give the same ids. Kept
    out, it costs nothing: start-up (every run, every test subprocess) takes 2.8 s instead of 5.1 s here."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    if not (
        os.environ.get("JAX_PLATFORMS")
        or glob.glob("/dev/accel*")
        or glob.glob("/dev/vfio/[0-9]*")
        or os.path.exists("/dev/nvidia0")
    ):
        os.environ["JAX_PLATFORMS"] = "cpu"
    for name in ("tensorflow", "tensorflow_text"):
        sys.modules.setdefault(name, None)  # `import tensorflow` now raises ImportError


# --- 2. Tokenizers: keras-hub's byte-level BPE, corrected ---
# Each byte-level BPE family's word-splitting regex, as its own tokenizer.json writes it (meta-llama/Meta-Llama-3-8B:
# digits in threes; Qwen/Qwen2.5-7B and Qwen3: one digit a piece; Qwen 3.5 adds marks \p{M} to words; openai gpt2)
_QWEN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
BPE_SPLITS = {
    "Llama3Tokenizer": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",
    **dict.fromkeys(["QwenTokenizer", "Qwen3Tokenizer", "QwenMoeTokenizer", "Qwen3MoeTokenizer"], _QWEN),
    **dict.fromkeys(
        ["Qwen3_5Tokenizer", "Qwen3_5MoeTokenizer"],
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?"
        r"[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "GPT2Tokenizer": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
}


def _split_words(set_vocabulary):
    """keras-hub 0.32's byte-level BPE without TensorFlow (Llama 3, Qwen, GPT-2) hands its split pattern to
    pre_tokenizers.Split as a str, which `tokenizers` matches as literal text: nothing is split into words, so
    BPE merges across words and digits and the ids are not the model's. Split by the family's regex instead."""
    import tokenizers
    from keras_hub.src.tokenizers import byte_pair_tokenizer as bpe

    def set_vocabulary_and_merges(self, vocabulary, merges):
        set_vocabulary(self, vocabulary, merges)
        pattern = tokenizers.Regex(BPE_SPLITS.get(type(self).__name__, bpe.SPLIT_PATTERN_TOKENIZERS))
        self._tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
            [
                tokenizers.pre_tokenizers.Split(pattern, "isolated"),
                tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=self.add_prefix_space, use_regex=False),
            ]
        )

    return set_vocabulary_and_merges


def fix_bpe_splits():
    """Install _split_words in keras-hub's BytePairTokenizer (common.py does, once, as it imports keras-hub)."""
    from keras_hub.src.tokenizers import byte_pair_tokenizer as bpe

    cls = bpe.BytePairTokenizer
    cls._set_vocabulary_and_merges_tokenizers = _split_words(cls._set_vocabulary_and_merges_tokenizers)


def fix_rope_rotation():
    """keras-hub's RotaryEmbedding writes rotate_half(x) = [-x2, x1] as a stack and a reshape (around an XLA
    concatenate bug, openxla/xla#7875, fixed since): compiled for a TPU, a decode step then makes two more
    fusions and a layout copy for each query and key, every layer. The same values, concatenated (common.py
    installs it once, as it imports keras-hub; tests/test_sampling.py checks them equal bit for bit)."""
    from keras import ops
    from keras_hub.src.layers.modeling import rotary_embedding

    def apply(self, tensor, cos_emb, sin_emb):
        x1, x2 = ops.split(tensor, 2, axis=-1)
        return (tensor * cos_emb) + (ops.concatenate((-x2, x1), axis=-1) * sin_emb)

    rotary_embedding.RotaryEmbedding._apply_rotary_pos_emb = apply


# --- 3. Model hubs: a preset's files, and a failure to fetch them in one line ---
# --model's short names -> KerasHub presets (all: keras_hub.models.CausalLM.presets; common.resolve_model
# reads them); tests/test_families.py checks each.
MODEL_ALIASES = {
    "gemma_2b": "gemma_2b_en",
    "gemma_7b": "gemma_7b_en",
    "gemma_2b_it": "gemma_instruct_2b_en",
    "gemma_7b_it": "gemma_instruct_7b_en",
    "gemma2_2b": "gemma2_2b_en",
    "gemma2_9b": "gemma2_9b_en",
    "gemma2_27b": "gemma2_27b_en",
    "gemma2_2b_it": "gemma2_instruct_2b_en",
    "gemma2_9b_it": "gemma2_instruct_9b_en",
    "llama3_8b": "llama3_8b_en",
    "llama3_8b_it": "llama3_instruct_8b_en",
    "mistral_7b": "mistral_7b_en",
    "mistral_7b_it": "mistral_instruct_7b_en",
    "qwen2.5_0.5b": "qwen2.5_0.5b_en",
    "qwen2.5_0.5b_it": "qwen2.5_instruct_0.5b_en",
    "qwen2.5_7b": "qwen2.5_7b_en",
    "qwen3_0.6b": "qwen3_0.6b_en",
    "qwen3_8b": "qwen3_8b_en",
    "qwen3_moe_30b_a3b": "qwen3_moe_30b_a3b_en",
    "qwen3_moe_235b_a22b": "qwen3_moe_235b_a22b_en",  # mixtures
    # Gemma 3: the text-only presets (4B and up also come as vision+text, which load_model reads text-only)
    "gemma3_270m": "gemma3_270m",
    "gemma3_1b": "gemma3_1b",
    "gemma3_4b": "gemma3_4b_text",
    "gemma3_12b": "gemma3_12b_text",
    "gemma3_27b": "gemma3_27b_text",
    "gemma3_270m_it": "gemma3_instruct_270m",
    "gemma3_1b_it": "gemma3_instruct_1b",
    "gemma3_4b_it": "gemma3_instruct_4b_text",
    "gemma3_12b_it": "gemma3_instruct_12b_text",
    "gemma3_27b_it": "gemma3_instruct_27b_text",
    # Qwen 3.5 (every preset is vision-and-text, loaded text-only): `_base` presets plain, post-trained `_it`
    "qwen3.5_0.8b": "qwen3_5_0.8b_base",
    "qwen3.5_2b": "qwen3_5_2b_base",
    "qwen3.5_4b": "qwen3_5_4b_base",
    "qwen3.5_9b": "qwen3_5_9b_base",
    "qwen3.5_0.8b_it": "qwen3_5_0.8b",
    "qwen3.5_2b_it": "qwen3_5_2b",
    "qwen3.5_4b_it": "qwen3_5_4b",
    "qwen3.5_9b_it": "qwen3_5_9b",
    "qwen3.5_27b_it": "qwen3_5_27b",
    # Gemma 4 (every preset is vision(-and-audio)-and-text, loaded text-only): E2B, E4B, 26B-A4B (MoE), 31B
    "gemma4_2b": "gemma4_2b",
    "gemma4_4b": "gemma4_4b",
    "gemma4_26b_a4b": "gemma4_26b_a4b",
    "gemma4_31b": "gemma4_31b",
    "gemma4_2b_it": "gemma4_instruct_2b",
    "gemma4_4b_it": "gemma4_instruct_4b",
    "gemma4_26b_a4b_it": "gemma4_instruct_26b_a4b",
    "gemma4_31b_it": "gemma4_instruct_31b",
}


@functools.cache  # asked by backbone_class, text_causal_lm, the chat template and the --export-hf check
def model_config(preset):
    """The preset's config.json (a KerasHub preset's, or a Hugging Face checkpoint's), once per process; a hub
    failure stops here, in one line (hub_errors)."""
    from keras_hub.src.utils.preset_utils import load_json

    with hub_errors(preset):
        _fetch_config(preset)
        return load_json(preset, "config.json")


def _fetch_config(preset):
    """Fetch the preset's config.json, raising the hub's own error (KerasHub's loader turns a missing,
    gated or unreachable model into one generic 'has no config.json')."""
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


def loaded_not_drawn(loading=True):
    """While a checkpoint loads (loading): each Keras variable made starts as zeros, not a random draw.
    KerasHub's from_preset (a preset's weights, or a Hugging Face checkpoint's converted) makes the model with
    its initializers, then replaces every weight with the file's: the draw is wasted, and it was most of the
    load. A Gemma-2B preset onto one TPU v5e: 49-53 -> 28-29 s (with --quantize int8, made on the host:
    104 -> 78 s), every weight the same (benchmarks/RESULTS.md, section 14)."""
    import keras  # keras 3.15 internals below: JaxVariable's draw, where a variable's first value is made

    variable = keras.src.backend.jax.core.JaxVariable
    return (
        unittest.mock.patch.object(
            variable,
            "_initialize_with_initializer",
            lambda v, _, draw=variable._initialize_with_initializer: draw(v, keras.initializers.Zeros()),
        )
        if loading
        else contextlib.nullcontext()
    )


NETWORK_ERRORS = {
    "ConnectionError",
    "ConnectError",
    "NetworkError",
    "TimeoutException",
    "Timeout",
    "gaierror",
    "LocalEntryNotFoundError",
}  # no network, or HF_HUB_OFFLINE and not in the cache


def hub_error(preset, error):
    """What to do about `error`, raised while fetching `preset` from a hub, in one line; None when it is no
    hub failure. Reads the whole exception chain: KerasHub re-raises the hubs' errors."""
    scheme = preset.split("://")[0] if "://" in preset else "kaggle"  # a preset name: its files are on Kaggle
    if preset == "tiny" or os.path.isdir(preset) or scheme not in ("hf", "kaggle"):
        return None  # not fetched, or another hub (modelscope://…) with its own messages
    chain, e = [], error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    kinds = {c.__name__ for x in chain for c in type(x).__mro__}
    text = " ".join(str(x) for x in chain)
    statuses = (getattr(getattr(x, "response", None), "status_code", None) for x in chain)
    status = next((s for s in statuses if isinstance(s, int)), None)  # HTTP errors carry their response
    offline = bool(kinds & NETWORK_ERRORS)
    explain = _hf_error if preset.startswith("hf://") else _kaggle_error
    message = explain(preset, kinds, text, status, offline)
    return message and (
        f"--model {preset}: {message}; or pass a local directory (a KerasHub preset or a "
        "Hugging Face checkpoint), or --model tiny"
    )


def _hf_error(preset, kinds, text, status, offline):
    repo = preset.removeprefix("hf://")
    page, token = f"https://huggingface.co/{repo}", "set HF_TOKEN or run `hf auth login`"
    if "GatedRepoError" in kinds:
        return f"the repo is gated: accept its licence at {page}, then {token}"
    if "RepositoryNotFoundError" in kinds:
        return f"no Hugging Face repo {repo!r} is visible: check the repo id at {page} (for a private repo, {token})"
    if "HFValidationError" in kinds or "Unexpected Hugging Face preset" in text:
        return "not a Hugging Face repo id; expected hf://{org}/{model}"
    if "EntryNotFoundError" in kinds and not offline:
        return f"the repo has no config.json at {page}: not a checkpoint KerasHub loads"
    if offline:
        from huggingface_hub import constants

        return f"{hub_unreachable(constants.HF_HUB_OFFLINE, 'the model')}, then {token} if the repo is gated"
    return status and f"the Hugging Face Hub answered HTTP {status} for {page}"


def _kaggle_error(preset, kinds, text, status, offline):
    """A KerasHub preset name's files live on Kaggle too."""
    from keras_hub.src.utils.preset_utils import BUILTIN_PRESETS

    handle = BUILTIN_PRESETS.get(preset, {}).get("kaggle_handle", preset).removeprefix("kaggle://")
    page = "https://www.kaggle.com/models/" + "/".join(handle.split("/")[:2])
    try:
        import kagglehub.config

        user = kagglehub.config.get_kaggle_credentials()
    except ValueError as e:  # a malformed ~/.kaggle/kaggle.json
        return f"{e}: fix it, or set KAGGLE_USERNAME and KAGGLE_KEY"
    creds = (
        f"set Kaggle credentials (KAGGLE_USERNAME and KAGGLE_KEY, or ~/.kaggle/kaggle.json) for an account "
        f"that has accepted the model's licence at {page}"
    )
    if (
        status in (401, 403)
        or "is not accessible in preset directory" in text
        or kinds & {"CredentialError", "UnauthenticatedError"}
    ):
        if user is None:
            return f"Kaggle refused kaggle://{handle} without credentials: {creds}"
        who = f"the Kaggle account {user.username!r}" if user.username else "your Kaggle account"
        return (
            f"Kaggle refused kaggle://{handle} to {who}: accept the model's licence at {page} with that "
            "account, and check that its KAGGLE_KEY is current"
        )
    if status == 404 or "doesn't exist in preset directory" in text:
        return (
            f"Kaggle has no model kaggle://{handle}: check the handle "
            f"(kaggle://{{org}}/{{model}}/keras/{{variant}}[/{{version}}], see {page})"
        )
    if "Unexpected Kaggle preset" in text:
        return "not a Kaggle model handle; expected kaggle://{org}/{model}/keras/{variant}[/{version}]"
    if offline:
        return f"cannot reach Kaggle (no network?) to download kaggle://{handle}: connect" + (
            f" and {creds}" if user is None else ""
        )
    return status and f"Kaggle answered HTTP {status} for kaggle://{handle}"


def hub_unreachable(offline, what):
    """What to do when `what` (the model, a dataset) is not in the local cache and the Hugging Face Hub gave
    nothing: HF_HUB_OFFLINE is set (`offline`), or the Hub cannot be reached."""
    if offline:
        return f"HF_HUB_OFFLINE is set and {what} is not in the local cache: unset it"
    return "the Hugging Face Hub cannot be reached (no network?): connect"


# --- 4. Datasets: through `datasets`, from the Hub or a local copy ---
def load_splits(path, config, flag):
    """{split: Dataset} through `datasets`; a Hub failure in one line (UsageError), and a fast one: with no
    network, load_dataset retries for 23 s, so one request without retries goes first."""
    import datasets
    import huggingface_hub as hf

    hub, offline = not os.path.exists(path), datasets.config.HF_HUB_OFFLINE
    saved = any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))
    try:
        if hub and not offline:
            with contextlib.suppress(hf.errors.HfHubHTTPError):  # a refusal: load_dataset's to explain
                hf.HfApi().dataset_info(path, timeout=10)
        ds = (
            datasets.load_from_disk(path)
            if saved
            else datasets.load_dataset(path.rsplit(".", 1)[1], data_files=path)  # the builder named so
            if path.endswith((".parquet", ".csv"))
            else datasets.load_dataset(path, config, cache_dir=local_cache(hub))
        )
    except Exception as e:
        if hub and {c.__name__ for c in type(e).__mro__} & NETWORK_ERRORS:
            raise UsageError(
                f"{flag} {path}: no such local file or folder, and {hub_unreachable(offline, 'it')}"
                + ("" if offline else ", or set HF_HUB_OFFLINE=1 to use a cached copy")
            ) from None
        if hub and not isinstance(e, (ValueError, FileNotFoundError)):  # else datasets' words, on one line
            raise
        # on one line; a folder datasets could not build: its cause (the columns that do not match)
        text = " ".join(str(e.__cause__ or e).split("Example of usage")[0].split())
        config_flag = DATA_FLAGS.get(flag, (None, None))[0]
        if os.path.isdir(path) and e.__cause__ is not None:  # a folder whose files could not make one dataset
            text += "; datasets reads a folder's data files as one dataset: each needs the same columns"
        raise UsageError(
            f"{flag} {path}: {text}" + (f" ({config_flag})" if config_flag and "onfig" in text else "")
        ) from None
    return ds if isinstance(ds, dict) else {"train": ds}


def local_cache(hub):
    """None (datasets' cache) for a Hub id; for a local copy of a Hub repo, a fresh cache removed at exit, so it
    is read afresh: datasets' cache of one is keyed by the folder's name and configs, not its files, and gave
    stale rows after an edit, or another folder's of that name (their schema too, even re-downloading)."""
    if hub:
        return None
    import atexit
    import tempfile

    cache = tempfile.mkdtemp(prefix="datasets_")
    atexit.register(shutil.rmtree, cache, True)
    return cache


# The flags that name a data flag's configuration and split, for datasets' messages (compare.py's prompt
# flags have none: its prompts are files or folders)
DATA_FLAGS = {
    "--dataset": ("--dataset-config", "--dataset-split"),
    "--eval-dataset": ("--dataset-config", "--eval-split"),
    "--eval-split of --dataset": ("--dataset-config", "--eval-split"),
    "--prompts": ("--prompts-config", "--prompts-split"),
}


def plain_saved_dtype(path):
    """A preset saved from a model computing under a mixed policy (`mixed_bfloat16`: every run on a TPU or
    GPU) names that policy in config.json and task.json, and keras-hub 0.32's from_preset cannot read it
    back (its `_resolve_dtype` asks is_float_dtype("mixed_bfloat16"), which raises): name the dtype the
    weights are stored in, float32, instead; the compute dtype is the loader's to choose (`--dtype`)."""
    for name in ("config.json", "task.json"):
        file = os.path.join(path, name)
        with open(file) as f:
            data = json.load(f)
        config = data.get("config", {})
        for policy in (config.get("dtype"), config.get("backbone", {}).get("config", {}).get("dtype")):
            if isinstance(policy, dict) and str(policy.get("config", {}).get("name")).startswith("mixed_"):
                policy["config"]["name"] = "float32"
        with open(file, "w") as f:
            json.dump(data, f, indent=2)


# --- 5. --export-hf: a saved preset as a Hugging Face checkpoint ---

# `architectures` where keras-hub 0.32's exporter leaves it out of config.json (transformers and KerasHub read
# it) or names a class without the output layer (Gemma 4: Gemma4TextModel)
HF_ARCHITECTURES = {
    "GemmaBackbone": "GemmaForCausalLM",
    "QwenBackbone": "Qwen2ForCausalLM",
    "GPT2Backbone": "GPT2LMHeadModel",
    "Gemma4Backbone": "Gemma4ForCausalLM",
}


def check_export_hf(name, preset, family):
    """--export-hf: refuse (at start-up) a family keras-hub cannot write as a transformers checkpoint (`name`:
    --model, `preset`: what it resolves to, `family`: its backbone class's name)."""
    import keras_hub
    from keras_hub.src.utils.transformers.export.hf_exporter import MODEL_EXPORTERS

    if family == "GemmaBackbone" and preset != "tiny":  # Gemma 2 is a GemmaBackbone too, which the
        config = model_config(preset)  # Gemma exporter would write as Gemma 1 (no post-norms)
        if config.get("model_type") == "gemma2" or any(
            config.get("config", {}).get(k)
            for k in (
                "use_post_ffw_norm",
                "use_post_attention_norm",
                "final_logit_soft_cap",
                "attention_logit_soft_cap",
            )
        ):
            family = "Gemma 2 (GemmaBackbone with post-norms and soft-caps)"
        elif (
            config.get("config", config).get("num_key_value_heads", 1) > 1
        ):  # it writes key/value head 0 only
            family = "a Gemma with several key/value heads (Gemma 7B)"
    if family not in MODEL_EXPORTERS:
        raise UsageError(
            f"--export-hf: keras-hub {keras_hub.__version__} cannot write {family} as a Hugging Face "
            f"checkpoint (--model {name}); it can write {', '.join(sorted(MODEL_EXPORTERS))}"
        )


def hf_tokenizer(tokenizer):
    """The project's tokenizer as a `tokenizers` Tokenizer (tokenizer.json), giving its ids. KerasHub's
    byte-level BPE (Llama 3, Qwen, GPT-2) runs one already; a SentencePiece BPE (Gemma, Mistral, `tiny`) is
    rebuilt from its pieces and its own normalizer spec, which transformers' Gemma class replaces by Gemma's
    (no NFKC, no dummy prefix, spaces kept): `tiny`, with SentencePiece's defaults, got "Sort" as "So", "rt"."""
    import re
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models
    from tokenizers import normalizers as norm, pre_tokenizers as pre

    if (
        getattr(tokenizer, "_tokenizer", None) is not None
    ):  # keras-hub 0.32's BytePairTokenizer, no TensorFlow
        return Tokenizer.from_str(tokenizer._tokenizer.to_str())
    proto = sentencepiece_model_pb2.ModelProto.FromString(tokenizer.proto)
    spec = proto.normalizer_spec
    trainer = proto.trainer_spec
    pieces = list(proto.pieces)
    if trainer.model_type != trainer.BPE:
        raise ValueError(
            f"{type(tokenizer).__name__}: SentencePiece model type {trainer.model_type}, not BPE"
        )
    # SentencePiece's BPE merges the adjacent pair making the highest-scoring piece: one merge per split of a
    # piece, ranked by its score, then id. Types: 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte.
    normal = {p.piece: (-p.score, i) for i, p in enumerate(pieces) if p.type == 1}
    merges = sorted(
        (normal[p], p[:k], p[k:])
        for p in normal
        for k in range(1, len(p))
        if p[:k] in normal and p[k:] in normal
    )
    # a user-defined piece, which no merge makes, taken whole
    hf = Tokenizer(
        models.BPE(
            {p.piece: i for i, p in enumerate(pieces)},
            [m[1:] for m in merges],
            unk_token=trainer.unk_piece,
            fuse_unk=True,
            byte_fallback=trainer.byte_fallback,
            ignore_merges=True,
        )
    )
    steps = [norm.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []  # e.g. NFKC
    if spec.remove_extra_whitespaces:  # spaces only (after the charsmap, which makes "\n" one in nmt_nfkc)
        steps += [norm.Replace(Regex(r"\A +| +\z"), ""), norm.Replace(Regex(" {2,}"), " ")]
    steps.append(norm.Replace(" ", "▁"))
    if spec.add_dummy_prefix:  # "▁" before the text even where it starts with one (Metaspace would skip it)
        steps.append(norm.Replace(Regex(r"\A▁"), "▁▁"))
    hf.normalizer = norm.Sequence(steps)
    user = sorted((p.piece for p in pieces if p.type == 4), key=len, reverse=True)  # matched whole, anywhere
    split = [pre.Split(Regex("|".join(map(re.escape, user))), "isolated")] if user else []
    # the dummy prefix after an added token too (a template's "<bos>"): the scripts tokenize text apart from it
    prefix = [pre.Metaspace("▁", "always", split=False)] if spec.add_dummy_prefix else []
    hf.pre_tokenizer = pre.Sequence(prefix + split)
    strip = [decoders.Strip(" ", 1, 0)] if spec.add_dummy_prefix else []
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    # so a template's "<bos>" is the BOS id
    hf.add_special_tokens(
        [AddedToken(p.piece, normalized=False, special=True) for p in pieces if p.type in (2, 3)]
    )
    return hf


def _edit_json(path, **changes):
    """Set keys of a JSON file; None removes one."""
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    with open(path, "w") as f:
        json.dump({k: v for k, v in data.items() if v is not None}, f, indent=2)


def export_hf(model, path, chat_template=None):
    """A saved model (common.host_model: LoRA merged, text only, on the host CPU, with the scripts' start
    token) -> a Hugging Face checkpoint in `path`: model.safetensors, config.json with `architectures`,
    tokenizer.json (hf_tokenizer, adding the scripts' start token), tokenizer_config.json with the chat
    template trained with (`chat_template`: its name in HF_CHAT_TEMPLATES); files 0644 under umask 022;
    renamed from path.tmp once complete. On the host CPU: the exporter needs whole weights."""
    import jax
    from tokenizers import processors

    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        model.export_to_transformers(tmp)
    tokenizer, family = model.preprocessor.tokenizer, type(model.backbone).__name__
    bos = tokenizer.id_to_token(tokenizer.start_token_id)
    hf = hf_tokenizer(tokenizer)
    hf.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, tokenizer.start_token_id)]
    )
    hf.save(os.path.join(tmp, "tokenizer.json"))
    if family in HF_ARCHITECTURES:
        _edit_json(os.path.join(tmp, "config.json"), architectures=[HF_ARCHITECTURES[family]])
    # tokenizer.json as it is: a model's own class would rebuild it, and keras-hub's added_tokens_decoder
    # lists Gemma's turn markers, which as added tokens would cut the text before its dummy prefix
    _edit_json(
        os.path.join(tmp, "tokenizer_config.json"),
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token=bos,
        added_tokens_decoder=None,
        clean_up_tokenization_spaces=False,
        chat_template=HF_CHAT_TEMPLATES.get(chat_template),
    )
    umask = os.umask(0o22)
    os.umask(umask)
    for name in os.listdir(tmp):  # safetensors writes 0600
        os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


# common.CHAT_TEMPLATES in Jinja (--export-hf's chat_template), as the model cards cited there write them,
# opened by the scripts' start token; Mistral's card ends every answer with </s>, where render() leaves the
# EOS id to the scripts, after the last answer only.
HF_CHAT_TEMPLATES = {
    "gemma": "{{ bos_token }}{% for m in messages if m['role'] != 'system' %}{{ '<start_of_turn>' + "
    "('model' if m['role'] == 'assistant' else 'user') + '\\n' + (messages[0]['content'] + '\\n\\n' "
    "if loop.first and messages[0]['role'] == 'system' else '') + (m['content'] | trim) + "
    "'<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}"
    "{% endif %}",
    "llama3": "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
    "'<|end_header_id|>\\n\\n' + (m['content'] | trim) + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}",
    "mistral": "{{ bos_token }}{% for m in messages if m['role'] != 'system' %}"
    "{% if m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% else %}{{ '[INST] ' + "
    "(messages[0]['content'] + '\\n\\n' if loop.first and messages[0]['role'] == 'system' else '') "
    "+ m['content'] + ' [/INST]' }}{% endif %}{% endfor %}",
    "chatml": "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}",
    "qwen3.5": "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + "
    "('<think>\\n\\n</think>\\n\\n' if m['role'] == 'assistant' else '') + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{% endif %}",
    "gemma4": "{{ bos_token }}{% for m in messages %}{{ '<|turn>' + ('model' if m['role'] == 'assistant' else "
    "m['role']) + '\\n' + (m['content'] | trim) + '<turn|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}",
    "gemma4_large": "{{ bos_token }}{% for m in messages %}{{ '<|turn>' + ('model' if m['role'] == 'assistant' "
    "else m['role']) + '\\n' + ('<|channel>thought\\n<channel|>' if m['role'] == 'assistant' else "
    "'') + (m['content'] | trim) + '<turn|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|turn>model\\n<|channel>thought\\n<channel|>' }}{% endif %}",
}


# --- 6. TRL's flags: the names a TRL user types, answered by plumbing.check_options ---
# TRL's (transformers') flag names that are spelled otherwise here -> this project's: the first flag of the
# " | " alternatives the script takes (a hint without a flag fits every script; none: no counterpart there)
TRL_FLAGS = {
    "num-train-epochs": "--num-epochs",
    "per-device-train-batch-size": "--batch-size (global: all devices)",
    "gradient-accumulation-steps": "--grad-accum-steps",
    "max-completion-length": "--response-length | --max-new-tokens",
    "max-new-tokens": "--response-length",
    "lora-r": "--lora-rank",
    "use-peft": "--lora-rank N",
    "load-in-8bit": "--quantize int8 (with --lora-rank)",
    "load-in-4bit": "--quantize int4 (with --lora-rank)",
    "model-name-or-path": "--model",
    "dataset-name": "--dataset | --prompts",
    "save-steps": "--save-every",
    "eval-steps": "--eval-every",
    "max-tool-calling-iterations": "--max-tool-calls",
    "logging-steps": "--log-every",
    "gradient-checkpointing": "--remat on",
    "bf16": "--dtype bfloat16",
    "resume-from-checkpoint": "--resume",
    "report-to": "--track (W&B; TensorBoard files are always written)",
    "per-device-eval-batch-size": "--batch-size",
    "eval-strategy": "--eval-every N (0: none)",
    "dataset-train-split": "--dataset-split | --prompts-split",
    "dataset-test-split": "--eval-split",
    "lr-scheduler-kwargs": "--min-lr-rate (cosine_with_min_lr's min_lr_rate, the one kwarg taken)",
    "lora-dropout": "absent (Keras' LoRA layers have no dropout)",
    "teacher-model-name-or-path": "--teacher-model",
}
