"""The run shell: plumbing every script shares and no one needs to read to learn an algorithm.
  1. The boundary  UsageError (interop's), RunComplete, Preempted, RunFailed (NonFiniteLoss); launch: main
                   under the one boundary that turns them into exit codes 2, 0, 0, 1; cli (tyro, errors in
                   one line; check_options: unknown ones, TRL's names answered); answer_help (--help and
                   unknown options from the script's source, before its heavy imports)
  2. Shared flags  SharedArgs (every script's Args extends it), RolloutArgs (+ the RL scripts' rollouts);
                   make_optimizer (AdamW and the rate schedule those flags set)
  3. The run       Run: output dir, --resume/--overwrite, --max-steps from --num-epochs, args.json,
                   metrics.jsonl + TensorBoard (+ W&B), progress, tokens/s and MFU, the non-finite stop, eval
                   and checkpoint cadence, SIGTERM/SIGINT, the final model, a summary line
  4. Remat         Remat: blocks.py's --remat switch on each decoder block, its decision announced
  5. Accounting    count_params, peak_flops (docs/design.md, "FLOPs"); synced, phase_metrics (RL phase times);
                   compilation_cache (JAX's persistent cache, on by default)
The top of the chain interop <- common <- plumbing: it may call both (common: the mesh and the model; interop:
--export-hf), and neither imports it. jax, numpy, keras and common are imported inside the functions that use
them: `import plumbing` is instant, and `python dpo.py --help` answers before the script's own imports."""

import ast
import collections
import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import os
import pathlib
import shutil
import signal
import sys
import textwrap
import time
from typing import Literal

import blocks  # what is done to each decoder block: remat, packing (imports interop alone)
import interop  # the outside world (standard library only at import): --export-hf, the `tiny` vocabulary
from blocks import AUTO_ORDER, choose_remat, enable_remat, halve_batch, pack, peak_bytes  # noqa: F401
from interop import HERE, TRL_FLAGS, UsageError  # noqa: F401  (UsageError: bad input, exit 2)


# --- 1. The boundary: the only place the process ends ---
class RunComplete(Exception):
    """--resume on a run that already reached --max-steps: the message on stdout, exit code 0."""


class Preempted(Exception):
    """SIGTERM/SIGINT arrived and the state was checkpointed: the message on stdout, exit code 0."""


class RunFailed(Exception):
    """The work itself failed (not the input): the message on stderr, exit code 1."""


class NonFiniteLoss(RunFailed):
    """train/loss became NaN or inf: the message on stderr, exit code 1 (the checkpoints stay)."""


def _end(code, message, stream=None):
    """Print `message` on a line of its own (an open progress bar closed first) and end the process (answer_help's
    and launch's exit, nowhere else). os._exit skips teardown, which can wait on JAX's or orbax's threads."""
    for bar in list(getattr(getattr(sys.modules.get("tqdm"), "tqdm", None), "_instances", ())):
        bar.close()
    with contextlib.suppress(BrokenPipeError):  # `--help | head`
        print(message, file=stream or sys.stdout)
    sys.stdout.flush()
    sys.stderr.flush()
    # where JAX is loaded (else a KeyError), a pod's processes leave the coordination service together: one that
    # found it closed by process 0 would die with a fatal error
    with contextlib.suppress(Exception):
        sys.modules["jax"].distributed.shutdown()
    os._exit(code)


def launch(main, args_class):
    """main(the parsed Args) under the boundary: UsageError -> `error: ...` on stderr, exit 2; RunComplete,
    Preempted -> stdout, 0; RunFailed -> stderr, 1. Until a Run's loop starts, a SIGINT/SIGTERM ends it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    try:
        compilation_cache()
        main(cli(args_class))
    except (RunComplete, Preempted) as e:
        _end(0, str(e))
    except (UsageError, RunFailed) as e:
        _end(2 if isinstance(e, UsageError) else 1, f"error: {e}", sys.stderr)


def check_options(argv, ours, script):
    """A UsageError naming the options of argv that `script` lacks (`ours`: its flags; --x_y passes as --x-y),
    with hints: a TRL flag's name there (interop.TRL_FLAGS' first alternative taken, or none), else the closest."""
    import difflib

    unknown = [
        a.split("=")[0]
        for a in argv[: argv.index("--") if "--" in argv else None]  # " ": a value
        if a[:2] == "--" and " " not in a and a.split("=")[0].replace("_", "-") not in ours | {"--help"}
    ]
    hints = []
    for name in unknown:
        if (trl := name[2:].replace("_", "-")) in TRL_FLAGS:
            here = [h for h in TRL_FLAGS[trl].split(" | ") if h[:2] != "--" or h.split()[0] in ours]
            hints.append(
                f"{name} is {here[0]} here" if here else f"{name} has no counterpart in {script} (see --help)"
            )
    if unknown:
        close = difflib.get_close_matches(unknown[0].replace("_", "-"), ours, 1)
        raise UsageError(
            f"Unrecognized options: {', '.join(unknown)}"
            + "".join(f"; {h}" for h in hints or [f"perhaps you meant {c}" for c in close])
        )


def cli(args_class, argv=None):
    """tyro.cli(Args) on argv (None: sys.argv), with tyro's boxed parse errors as one UsageError (an unknown
    option: check_options' line, hint included). Then check_defaults; or, with --resume and an --output-dir that
    holds a run, that run's flags (args.json) as the defaults: `--resume --output-dir DIR` alone continues it."""
    import io
    import tyro

    err, argv = io.StringIO(), sys.argv[1:] if argv is None else list(argv)
    check_options(
        argv,
        {f"--{no}{f.name.replace('_', '-')}" for f in dataclasses.fields(args_class) for no in ("", "no-")},
        os.path.basename(getattr(sys.modules.get(args_class.__module__), "__file__", "")),
    )

    def parse(default=None):
        try:
            with contextlib.redirect_stderr(err):
                return tyro.cli(args_class, args=argv, default=default)
        except SystemExit as e:
            if not e.code:
                raise
            # the box's lines ([0]: its title) up to its first rule
            lines = [line.strip("│╭╮╰╯ \n") for line in err.getvalue().splitlines()[1:]]
            raise UsageError(
                " ".join(lines[: next((i for i, x in enumerate(lines) if set(x) <= {"─"}), len(lines))])
                or err.getvalue().strip()
            ) from None

    args = parse()
    recorded = recorded_run(args.output_dir) if isinstance(args, SharedArgs) and args.resume else {}
    if not recorded:
        check_defaults(args, argv)
        return args
    # --resume: the run's own flags are the defaults, what this command line gives changes them (the Run refuses
    # what may not change); --remat is decided again (args.json holds the mode a run chose, not the flag)
    taken = {f.name for f in dataclasses.fields(args_class)} - {"resume", "overwrite", "remat"}
    # (JSON holds a tuple flag as a list)
    args = parse(
        args_class(**{k: tuple(v) if isinstance(v, list) else v for k, v in recorded.items() if k in taken})
    )
    changed = [
        f"--{k.replace('_', '-')} {v} (was {recorded[k]})"
        for k, v in vars(args).items()
        if k in taken and k in recorded and json.loads(json.dumps(v, default=str)) != recorded[k]
    ]
    print(
        f"--resume: the run's flags from {args.output_dir}/args.json"
        + ("; changed here: " + ", ".join(changed) if changed else "")
    )
    return args


def recorded_run(output_dir):
    """args.json's record of the run in output_dir (its resumes applied: the latest values), {} without one."""
    path = pathlib.Path(output_dir or "", "args.json")
    recorded = json.loads(path.read_text()) if output_dir and path.is_file() else {}
    for resumed in recorded.get("resumes", []):
        recorded.update(resumed)
    return recorded


def check_defaults(args, argv):
    """A model other than the `tiny` demo (or a model trained from it) never silently trains or scores with
    the bundled toy task: each data or reward flag left at its data/ default must be given."""
    given = {a.split("=")[0] for a in argv} | {"--eval-dataset"}  # no eval: no toy eval
    toy = [
        flag
        for f in dataclasses.fields(args)
        if os.path.join(HERE, "data") in str(f.default)
        and (flag := "--" + f.name.replace("_", "-")) not in given
        and not (flag == "--reward-fn" and "--reward-model" in given)  # a reward model: no toy checker
    ]
    if toy and not is_toy_model(args.model):
        import common

        common.resolve_model(args.model)  # an unknown --model is reported as that
        raise UsageError(
            f"--model {args.model} would use the bundled toy task (data/): pass "
            + ", ".join({"--reward-fn": "--reward-fn path.py:function"}.get(f, f + " DATA") for f in toy)
            + (
                "; DATA: a .jsonl/.json/.parquet/.csv file, a saved dataset dir or a Hub dataset id"
                if toy != ["--reward-fn"]
                else ""
            )
        )


def is_toy_model(model):
    """`tiny`, or a model dir trained from it (its tokenizer is the bundled one: KerasHub's or HF's file) on the
    toy task: a run's model/ whose args.json names a --dataset of your own is not (its task is yours)."""
    record = pathlib.Path(model).parent / "args.json"  # a model folder's run (not the working folder's)
    toy_data = os.path.join(HERE, "data")  # a record without a --dataset: the tokenizer decides
    if (
        os.path.isdir(model)
        and record.is_file()
        and not json.loads(record.read_text()).get("dataset", toy_data).startswith(toy_data)
    ):
        return False
    for name in ("assets/tokenizer/vocabulary.spm", "tokenizer.model"):
        if os.path.isfile(os.path.join(model, name)):
            return pathlib.Path(model, name).read_bytes() == pathlib.Path(interop.TINY_TOKENIZER).read_bytes()
    return model == "tiny"


def answer_help(module_name, path):
    """`python <script> --help`: the help read from its `Args` source, exit 0; an option it lacks: cli's line
    (check_options), exit 2; both before its heavy imports (seconds). Does nothing on `import <script>`."""
    if module_name != "__main__" or not (fields := _fields(path, "Args")):
        return
    if {"-h", "--help"} & set(argv := sys.argv[1:]):
        _end(0, help_from_source(path))
    try:  # what tyro would refuse, after the imports
        check_options(
            argv,
            {word.rstrip(",") for f in fields.values() for word in f[1].split() if word[:2] == "--"},
            os.path.basename(path),
        )
    except UsageError as e:
        _end(2, f"error: {e}", sys.stderr)


def _fields(path, name):
    """{name: (section, flag, doc, default)} of class `name` in `path`, not imported: its bases' fields first
    (one redefined keeps its place); a `# comment` between fields opens a section. None: no such class, or a
    base whose source cannot be found (then answer_help leaves the command line to tyro)."""
    source = open(path).read()
    cls = next((n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None or None in (inherited := [_base_fields(ast.unparse(base), path) for base in cls.bases]):
        return None
    fields = {k: v for base in inherited for k, v in base.items()}
    section = None
    # what a default may name: `common.HERE` is interop's (common takes it from there)
    names = {"os": os, "HERE": HERE, "common": interop, "plumbing": sys.modules[__name__]}
    # each field with what comes before it (the class line, for the first) and after it (its docstring)
    for before, node, after in zip([cls, *cls.body], cls.body, [*cls.body[1:], None]):
        if not isinstance(node, ast.AnnAssign):
            continue
        section = next(  # the last comment line since the line `before` starts on
            (
                x.strip("# ").rstrip()
                for x in source.splitlines()[before.lineno : node.lineno - 1][::-1]
                if x.strip().startswith("#")
            ),
            section,
        )
        doc = (
            after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
        )
        flag, kind = "--" + node.target.id.replace("_", "-"), ast.unparse(node.annotation)
        if kind == "bool":
            flag = f"{flag}, --no-{flag[2:]}"
        elif "Literal[" in kind:  # Literal[...] or Literal[...] | None: list the choices
            choices = (c.value for c in ast.walk(node.annotation) if isinstance(c, ast.Constant))
            flag += " {" + ",".join(str(c) for c in choices if c is not None) + "}"
        else:
            flag += " " + kind.replace(" | None", "").upper()
        try:
            default = eval(compile(ast.Expression(node.value), path, "eval"), names)
            default = os.path.relpath(default, HERE) if str(default).startswith(HERE) else default  # data/…
        except Exception:
            default = ast.unparse(node.value)
        fields[node.target.id] = (fields.get(node.target.id, (section,))[0], flag, doc, default)
    return fields


def _base_fields(base, path):
    """The fields of a base class `base` (its source text: `SharedArgs`, `plumbing.RolloutArgs`, `grpo.Args`,
    `Args` of the same file) of a class in `path`, read from its module's source; None where it cannot be
    found without importing anything (a module in a package, a name imported under another name)."""
    module, _, name = base.rpartition(".")
    if base == "object":
        return {}
    if not module:  # plumbing's (`from plumbing import SharedArgs`), else the same file's (None: not there)
        return _fields(__file__ if name in ("SharedArgs", "RolloutArgs") else path, name)
    # the module as `import module` would find it (the script's folder first), not executed; none in a package
    # (finding it would import the package)
    try:
        spec = None if "." in module else importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return _fields(spec.origin, name) if spec and (spec.origin or "").endswith(".py") else None


def help_from_source(path, width=100):
    """--help of the script at `path` from its `class Args` source (no import, so it is instant): every
    flag in its section (the outputs' sections last), with its choices, doc and default."""
    fields = _fields(path, "Args").values()
    out = [
        f"usage: {os.path.basename(path)} [OPTIONS]",
        "",
        ast.get_docstring(ast.parse(open(path).read())) or "",
    ]
    for section in sorted(  # the sections as they first come, the outputs' last
        dict.fromkeys(s for s, *_ in fields),
        key=lambda s: (
            s in ("logging and outputs", "multi-host (TPU pods and clusters are detected without these)")
        ),
    ):
        out += ["", f"{section}:"]
        for _, flag, doc, default in [f for f in fields if f[0] == section]:
            out += [
                f"  {flag}",
                *textwrap.wrap(
                    " ".join(doc.split()) + f" (default: {default if default != '' else repr(default)})",
                    width,
                    initial_indent=" " * 6,
                    subsequent_indent=" " * 6,
                ),
            ]
    return "\n".join(out)


# --- 2. The flags every script shares (the Run reads these fields, and nothing else of Args) ---
@dataclasses.dataclass
class SharedArgs:
    # model
    model: str = "tiny"
    """alias (gemma_2b, …), KerasHub preset, kaggle:// or hf:// handle, local preset / HF dir, or `tiny`"""
    chat_template: (
        Literal["gemma", "gemma4", "gemma4_large", "llama3", "mistral", "chatml", "qwen3.5"] | None
    ) = None
    """how chats (message lists) are rendered; None: --model's family's (Gemma 1-3: gemma, Gemma 4: gemma4,
    or gemma4_large at 26B-A4B / 31B, Llama 3: llama3, Mistral: mistral, Qwen 2.5 / 3: chatml, Qwen 3.5: qwen3.5)"""
    dtype: Literal["bfloat16", "float32"] | None = None
    """compute dtype; weights and optimizer state stay float32. None: bfloat16 on TPU/GPU, float32 on CPU"""
    frozen_dtype: Literal["bfloat16", "float32"] | None = None
    """dtype of the weights that are never updated (LoRA's base, references, reward models, a teacher); None:
    the compute dtype, which halves them under bfloat16 (no float32 master copy is needed: nothing updates
    them); float32 keeps them as loaded (TRL: the dtype its model_init_kwargs / ref_model_init_kwargs load in)"""
    logits_chunk: int | None = None
    """sequence positions whose [B, chunk, V] float32 logits exist at a time, in every log-prob, forward and
    backward (recomputed), so that [B, T, V] never does (Gemma's 256k vocabulary: 8 GiB at 8 × 1024); 0: whole;
    None: 1024 // B positions (1,024 tokens of the batch), or whole where the batch's float32 logits take at
    most 1 GiB (small vocabularies, short batches)"""
    lora_rank: int = 0
    """0 = full fine-tuning; r > 0: LoRA of rank r, only its A and B train (TRL: --use-peft --lora-r r)"""
    lora_alpha: int = 32
    """LoRA's α: the update is (α / r)·A·B, merged so into the saved weights (TRL ModelConfig: 32)"""
    lora_target_modules: tuple[str, ...] | None = None
    """the layers LoRA adapts: `all-linear` (attention q/k/v/o and the MLP; not the embedding / output head),
    or KerasHub layer names, e.g. `query value`; None: query and value (PEFT's default for these families)"""
    lora_adapter: str | None = None
    """a folder of PEFT's adapter files (adapter_config.json, adapter_model.safetensors: PEFT's or TRL's, or a LoRA
    run's model/) for --model's Hugging Face form: LoRA starts from it, on its modules at its ranks (PeftModel's
    from_pretrained, trainable). Needs --lora-rank (any: the adapter's ranks are used)"""
    quantize: Literal["int8", "int4"] | None = None
    """QLoRA: LoRA's frozen base held quantized (TRL: --load-in-8bit / --load-in-4bit): the attention and MLP
    weights in int8 per output channel or int4 in blocks of 64, computing in the compute dtype; the embedding,
    output head and norms stay; the adapters train in float32. Needs --lora-rank"""
    mesh: str | None = None
    """device mesh, e.g. `data=4,model=2`; None: every device on `data`"""
    remat: Literal["auto", "off", "on", "full", "minimal", "save_dots", "minimal_offloaded"] = "auto"
    """what each decoder block keeps for the backward pass (the rest is recomputed): off (everything), save_dots
    (every matmul's output), minimal (the weight projections' outputs), minimal_offloaded (those, in host
    memory), full or on (only the block's input: ~1/3 more FLOPs); auto: the first of off, save_dots, minimal,
    full whose compiled step fits the device's memory (off on CPU, which sets no limit)"""
    # data
    dataset: str = ""
    """training data: .jsonl/.json/.parquet, a `save_to_disk` folder, or a Hugging Face Hub dataset id"""
    dataset_config: str | None = None
    """the Hub dataset's configuration, e.g. `main` for gsm8k (TRL's dataset_config)"""
    dataset_split: str = "train"
    """the split of --dataset to train on (TRL's dataset_train_split); a file is one split, `train`"""
    # optimisation
    max_steps: int | None = None
    """optimizer updates; None: ceil(--num-epochs × rows of --dataset / rows per step), resolved before training"""
    num_epochs: float = 3.0
    """passes over --dataset that set --max-steps when it is None (TRL's num_train_epochs: 3)"""
    batch_size: int = 8
    """examples per update, global over devices (and accumulation) (TRL: 8 per device)"""
    learning_rate: float = 1e-6
    """peak AdamW learning rate"""
    lr_scheduler_type: Literal[
        "linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup"
    ] = "linear"
    """the rate after the warmup, as transformers' (TRL's default: linear to 0): linear or cosine to 0,
    cosine_with_min_lr to --min-lr-rate × the peak, constant_with_warmup; constant (no warmup either)"""
    warmup_steps: int = 0
    """linear warmup from 0, in optimizer updates (TRL: 0); wins over --warmup-ratio"""
    warmup_ratio: float = 0.0
    """warmup as a fraction of all optimizer updates (ceil(ratio × updates) steps) when --warmup-steps is 0"""
    min_lr_rate: float = 0.1
    """cosine_with_min_lr's floor, a fraction of the peak (transformers' lr_scheduler_kwargs min_lr_rate)"""
    weight_decay: float = 0.0
    """AdamW weight decay, on matrices only (not norms or biases) (TRL: 0.0)"""
    max_grad_norm: float = 1.0
    """global gradient-norm clip"""
    adam_mu_dtype: Literal["float32", "bfloat16"] = "float32"
    """AdamW's first moment (optax's and MaxText's mu_dtype); the weights and the second moment stay float32.
    bfloat16: 2 bytes a trained weight fewer, read and written each update (one v5e, full fine-tuning at
    Gemma-2B width: 71.0% -> 72.4% MFU)"""
    seed: int = 0
    """seeds init (tiny), data order and sampling"""
    # logging and outputs
    output_dir: str | None = None
    """None: runs/{script}__{model}__{seed}__{time}"""
    save_every: int = 500
    """checkpoint every N steps and at a run's last (TRL's save_steps); 0: on signals only"""
    save_total_limit: int = 3
    """checkpoints kept, the newest (TRL's save_total_limit); 0: every one (compare.py scores each)"""
    resume: bool = False
    """continue from the newest complete checkpoint in --output-dir"""
    resume_schedule: Literal["keep", "stretch"] = "keep"
    """--resume with another --max-steps: keep the run's learning-rate schedule (past its end: its last rate),
    or stretch it over the new length as transformers' Trainer does (the rate can rise)"""
    overwrite: bool = False
    """replace a run already in --output-dir (otherwise refused)"""
    track: bool = False
    """also log to Weights & Biases"""
    # multi-host (TPU pods and clusters are detected without these)
    coordinator_address: str | None = None
    """host:port of process 0, for jax.distributed"""
    num_processes: int | None = None
    """number of processes in the run"""
    process_id: int | None = None
    """this process's index"""

    # common.load_model's LoRA keywords: --lora-rank, --lora-alpha, --lora-target-modules, --quantize, --lora-adapter
    @property
    def lora(self):
        return {
            "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "lora_target_modules": self.lora_target_modules,
            "quantize": self.quantize,
            "lora_adapter": self.lora_adapter,
        }


@dataclasses.dataclass
class RolloutArgs(SharedArgs):
    """SharedArgs plus what every RL script (ppo, grpo, rloo) samples with: prompts, lengths, temperature."""

    # data
    dataset: str = os.path.join(HERE, "data", "prompts_train.jsonl")
    """prompts (`prompt`: string or message list): .jsonl/.json/.parquet, a saved folder or a Hub dataset id"""
    max_prompt_length: int = 512
    """prompt tokens (BOS included); longer prompts are cut from the left (TRL GRPOConfig ≤ 0.2x: 512)"""
    # rollouts
    response_length: int = 256
    """new tokens per completion (TRL GRPOConfig's max_completion_length: 256); without EOS by then: `clipped`"""
    temperature: float = 1.0
    """sampling temperature; log-probs are computed from logits / temperature to match"""
    # logging and outputs
    sample_every: int = 10
    """print a few decoded completions with their rewards every N steps (0: never)"""


def make_optimizer(args, steps, updates_per_step=1, eps=1e-8):
    """AdamW from the shared flags, as transformers' Trainer builds it for TRL: the gradients clipped to
    --max-grad-norm (global norm), --weight-decay on matrices only (not norms or biases), --learning-rate on
    --lr-scheduler-type over steps × updates_per_step optimizer updates (TRL counts updates: an RL step makes
    μ × mini-batches) -> (optimizer, schedule of the update count, warmup updates). eps: Adam's ε (PPO: 1e-5)."""
    import common
    import jax
    import optax

    schedule, warmup = common.lr_schedule(
        args.lr_scheduler_type,
        args.learning_rate,
        steps * updates_per_step,
        warmup_steps=args.warmup_steps,
        warmup_ratio=args.warmup_ratio,
        min_lr_rate=args.min_lr_rate,
    )
    return (
        optax.chain(
            optax.clip_by_global_norm(args.max_grad_norm),
            optax.adamw(  # the weight decay on matrices only: not on norms or biases
                schedule,
                eps=eps,
                weight_decay=args.weight_decay,
                mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
                mu_dtype=args.adam_mu_dtype,
            ),
        ),
        schedule,
        warmup,
    )


# --- 3. The run's lifecycle ---
RUN_FILES = ("args.json", "metrics.jsonl", "checkpoints", "model", "model_hf")
# Flags a --resume may change: what the run does next, not what it computes (every other flag, and the script,
# must match args.json; --max-steps and --num-epochs may extend the run)
RESUMABLE = {
    "max_steps",
    "num_epochs",
    "output_dir",
    "resume",
    "overwrite",
    "track",
    "save_every",
    "eval_every",
    "save_total_limit",
    "log_every",
    "sample_every",
    "num_samples",
    "mesh",
    "logits_chunk",
    "remat",
    "export_hf",
    "skip_nonfinite",
    "resume_schedule",
    "coordinator_address",
    "num_processes",
    "process_id",
}


def default_output_dir(script, model, seed):
    return os.path.join(
        "runs",
        f"{script}__{os.path.basename(os.path.normpath(model))}__{seed}__{time.strftime('%Y%m%d-%H%M%S')}",
    )


def check_flags(**flags):
    """flags: name=(value, lowest allowed, whether the lowest itself is refused); None values pass."""
    for name, (value, low, strict) in flags.items():
        if value is not None and (value <= low if strict else value < low):
            raise UsageError(f"--{name.replace('_', '-')} {value}: must be {'>' if strict else '>='} {low}")


class Run:
    """One training run's life, so that each script's loop shows only its algorithm: made in main as
    Run(__file__, args, ...), named by the script's file (a fork by its own), it starts
    jax.distributed where several processes take part, makes run.mesh, checks the shared flags and
    --output-dir, and writes nothing); then run.resolve_max_steps, run.resume(state), and the loop: `for step in
    run.steps(...)`: step, run.log(metrics, real, padded tokens), run.eval_due() / run.log_eval(...),
    run.checkpoint(state); then run.finish(save). It reads only SharedArgs' fields of `args` and the keywords
    given, and never changes `args`: what it resolves (output_dir, dtype, max_steps, what main passes to
    `record`) is an attribute and goes into args.json. Outputs are created after the first step (its run.log);
    from then on a first SIGINT/SIGTERM checkpoints at the next step and raises Preempted, a second ends it."""

    def __init__(
        self,
        script,
        args,
        *,
        log_every=1,
        eval_every=0,
        grad_accum_steps=1,
        export_hf=False,
        skip_nonfinite=None,
    ):
        import common

        common.init_distributed(args.coordinator_address, args.num_processes, args.process_id)
        check_flags(
            learning_rate=(args.learning_rate, 0, True),
            batch_size=(args.batch_size, 1, False),
            max_steps=(args.max_steps, 0, False),
            num_epochs=(args.num_epochs, 0, True),
            weight_decay=(args.weight_decay, 0, False),
            save_every=(args.save_every, 0, False),
            save_total_limit=(args.save_total_limit, 0, False),
            log_every=(log_every, 1, False),
            eval_every=(eval_every, 0, False),
            grad_accum_steps=(grad_accum_steps, 1, False),
            warmup_steps=(args.warmup_steps, 0, False),
            logits_chunk=(args.logits_chunk, 0, False),
        )
        if not (0 <= args.warmup_ratio <= 1 and 0 <= args.min_lr_rate <= 1):
            raise UsageError(
                f"--warmup-ratio {args.warmup_ratio}, --min-lr-rate {args.min_lr_rate}: "
                "each must be in [0, 1]"
            )
        if export_hf:
            preset = common.resolve_model(args.model)
            interop.check_export_hf(args.model, preset, common.backbone_class(preset).__name__)
        if args.track and importlib.util.find_spec("wandb") is None:
            raise UsageError("--track logs to Weights & Biases, which is not installed: pip install wandb")
        self.script = os.path.splitext(os.path.basename(script))[0]  # a fork's own name: mydpo.py -> mydpo
        self.args = args
        self.log_every = log_every
        self.eval_every = eval_every
        self.export_hf = export_hf
        self.skip_nonfinite = skip_nonfinite
        self.resolved = {}  # what main and the Run resolve, for args.json
        self.dtype = args.dtype or common.default_dtype()
        self.frozen_dtype = args.frozen_dtype or self.dtype  # common.split_variables' frozen_dtype
        self.dir = args.output_dir or default_output_dir(self.script, args.model, args.seed)
        self.model_dir = os.path.join(self.dir, "model")
        self.max_steps = args.max_steps
        self.mesh = common.make_mesh(args.mesh)
        self.main = common.jax.process_index() == 0  # process 0 writes the outputs
        if args.batch_size % (self.mesh.shape["data"] * grad_accum_steps):
            raise UsageError(
                f"--batch-size {args.batch_size} must divide by data axis ({self.mesh.shape['data']})"
                + (f" × --grad-accum-steps ({grad_accum_steps})" if grad_accum_steps > 1 else "")
            )
        self.start = self._check_output_dir()  # 0, or the checkpoint --resume continues from
        self.step = self.start
        self.stop_signal = None  # the name of a signal that asked to stop
        self.last_train = {}  # the last logged rows, for the summary line
        self.last_eval = {}
        self._handlers = {}  # the signal handlers from before the loop, set when the outputs open (first step)
        self._new_interval()
        self._shapes = set()  # the padded sizes met: a step's compilations
        self._buffered = []  # rows logged before the outputs open
        self._closing = contextlib.ExitStack()  # the logs close() closes, once open
        self._started = time.perf_counter()
        self._eval_started = None

    def _check_output_dir(self):
        """The step to start from; refuses to touch a previous run unless asked, or a place that cannot hold one
        (a file, or under one; not writable): exit 2 now, not after the model loads and the first step."""
        held = [f for f in RUN_FILES if os.path.exists(os.path.join(self.dir, f))]
        path = pathlib.Path(os.path.abspath(self.dir))
        existing = next(p for p in [path, *path.parents] if p.exists())  # the nearest that exists
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
            raise UsageError(
                f"--output-dir {self.dir}: {existing} is {'not writable' if os.path.isdir(existing) else 'a file'}"
            )
        # the newest checkpoint (a step's dir appears, renamed, once complete); None: none, or no such dir
        last = max(
            (int(p.name) for p in pathlib.Path(self.dir, "checkpoints").glob("*") if p.name.isdigit()),
            default=None,
        )
        finished = os.path.isdir(self.model_dir)
        recorded = self._check_same_run() if self.args.resume and "args.json" in held else {}
        # the steps the resumed run's schedule spans; a finished run's last step; why --resume cannot continue
        self._scheduled = recorded.get("schedule_steps", recorded.get("max_steps"))
        self._done = max(last or 0, recorded.get("max_steps") or 0) if finished and recorded else None
        self._no_checkpoint = None
        if self.args.resume:
            if last is None:
                self._no_checkpoint = f"--resume: {self.dir} holds no checkpoint to continue from" + (
                    "" if held else " (no run there)"
                )
            elif (self._done or 0) > last:  # a finished run extends from its final state, or not at all
                self._no_checkpoint = (
                    f"--resume: the newest checkpoint in {self.dir} (step {last}) is older than its "
                    f"finished model/ (step {self._done}), which continuing from it would replace"
                )
            self._check_resumable()  # with --max-steps None: in resolve_max_steps, once it is derived
            return last or 0
        if held and not self.args.overwrite:
            unfinished = last is not None and not finished
            what = (
                "a finished run (model/)"
                if finished
                else f"an unfinished run (checkpoint at step {last})"
                if unfinished
                else "a run without checkpoints"
            )
            hint = (
                "--resume to continue it or --overwrite to replace it"
                if unfinished
                else "--overwrite to replace it, or choose another --output-dir"
            )
            raise UsageError(f"--output-dir {self.dir} already holds {what}; pass {hint}")
        return 0

    def _check_same_run(self):
        """args.json's record (its resumes applied); a UsageError listing each run-defining flag that differs."""
        recorded = recorded_run(self.dir)
        diff = [  # this run's record as JSON holds it, against args.json's
            f"{'--' + k.replace('_', '-') if k != 'script' else 'the script'} {recorded[k]!r} -> {v!r}"
            for k, v in json.loads(json.dumps(self._record(), default=str)).items()
            if k not in RESUMABLE and k in recorded and recorded[k] != v
        ]
        if diff:
            raise UsageError(
                f"--resume: {self.dir} is another run: "
                + "; ".join(diff)
                + " (only --max-steps/--num-epochs and output flags may change; or pass --overwrite)"
            )
        return recorded

    def _record(self):
        """What args.json records of this run: the flags, the script and the values resolved so far."""
        return {
            "script": self.script,
            **vars(self.args),
            "output_dir": self.dir,
            "dtype": self.dtype,
            "frozen_dtype": self.frozen_dtype,
            "max_steps": self.max_steps,
            **self.resolved,
        }

    def _check_resumable(self):
        """--resume on a complete run: RunComplete; with no checkpoint to continue from: UsageError."""
        if self.max_steps is not None and self._done is not None and self.max_steps <= self._done:
            raise RunComplete(
                f"{self.dir}: this run is complete ({self._done} steps, model/ saved); nothing to resume"
            )
        if self.max_steps is not None and self._no_checkpoint:
            raise UsageError(
                self._no_checkpoint
                + "; checkpoints are written by --save-every N and on SIGTERM/SIGINT"
                + (
                    f"; to train on, start a new run from --model {self.model_dir}"
                    if os.path.isdir(self.model_dir)  # finished (nothing is written before the first step)
                    else ""
                )
            )

    def resolve_max_steps(self, num_rows, rows_per_step=None):
        """--max-steps, or ceil(--num-epochs × num_rows / rows_per_step (default --batch-size)). Also sets
        run.schedule_steps, the steps the rate schedule spans: a resumed run's own (keep) or max_steps."""
        if self.max_steps is None:
            per_step = rows_per_step or self.args.batch_size
            self.max_steps = max(1, math.ceil(self.args.num_epochs * num_rows / per_step))
            announce(
                f"--max-steps {self.max_steps}: {self.args.num_epochs:g} epochs of {num_rows} rows, "
                f"{per_step} a step"
            )
        self._check_resumable()
        self.schedule_steps = (  # keep: the resumed run's own
            self._scheduled if self.args.resume_schedule == "keep" and self._scheduled else self.max_steps
        )
        self.resolved["schedule_steps"] = self.schedule_steps
        if self.schedule_steps != self.max_steps and self.args.lr_scheduler_type != "constant":
            announce(
                f"--resume: the learning-rate schedule stays the run's, over {self.schedule_steps} steps, then "
                "its last rate (--resume-schedule stretch: over all steps, as transformers does; the rate can rise)"
            )
        return self.max_steps

    def record(self, **values):
        """Values main resolved for args.json (remat=<Remat>: recorded as its str, the resolved mode)."""
        self.resolved.update(values)

    def _on_signal(self, signum, frame):
        self.stop_signal = signal.Signals(signum).name
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)  # a second signal ends the process at once
        # os.write: safe inside a handler
        os.write(
            1,
            f"\n{self.stop_signal}: checkpoint at the end of this step, then exit "
            "(again to quit at once)\n".encode(),
        )

    def _open(self):
        """After the first step: signals now checkpoint; the outputs are created (process 0)."""
        if self._handlers:  # opened already
            return
        self._handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        if not self.main:
            return
        os.makedirs(self.dir, exist_ok=True)
        if self.args.overwrite and not self.args.resume:  # the run there goes
            for path in pathlib.Path(self.dir).iterdir():
                if path.name in RUN_FILES or path.name.startswith("events.out.tfevents"):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        record = self._record()
        args_json = pathlib.Path(self.dir, "args.json")
        # the first part's record stays; each resume appends its own
        if self.args.resume and args_json.exists():
            first = json.loads(args_json.read_text())
            record = {
                **first,
                "resumes": [
                    *first.get("resumes", []),
                    {"resumed_at_step": self.start, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **record},
                ],
            }
        pathlib.Path(self.dir, "args.json.tmp").write_text(json.dumps(record, indent=2, default=str))
        os.replace(os.path.join(self.dir, "args.json.tmp"), args_json)
        path = pathlib.Path(self.dir, "metrics.jsonl")
        if self.args.resume and path.exists():  # keep the whole rows up to the checkpoint
            path.write_text(
                "".join(
                    x
                    for x in path.read_text().splitlines(keepends=True)
                    if x.endswith("\n") and json.loads(x)["step"] <= self.start
                )
            )
        from tensorboardX import SummaryWriter

        # line-buffered: each row is in the file once written
        self._metrics = self._closing.enter_context(open(path, "a", buffering=1))
        self._tb = self._closing.enter_context(SummaryWriter(self.dir))
        self._wandb = None
        if self.args.track:
            import wandb

            self._wandb = self._closing.enter_context(
                wandb.init(config=self._record(), name=os.path.basename(self.dir))
            )
        for step, row in self._buffered:
            self._write(step, row)

    def _write(self, step, row):
        if not self._handlers:  # the outputs are not open yet
            self._buffered.append((step, row))
        elif self.main:
            self._metrics.write(json.dumps({"step": int(step), **row}) + "\n")
            for k, v in row.items():
                self._tb.add_scalar(k, v, step)
            if self._wandb:
                self._wandb.log(row, step=step)

    @functools.cached_property
    def _manager(self):
        """orbax's, made at the first use: each process writes its shards, a step appears once complete (when
        save returns: synchronous), the newest kept."""
        import orbax.checkpoint as ocp

        return ocp.CheckpointManager(
            os.path.abspath(os.path.join(self.dir, "checkpoints")),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=self.args.save_total_limit or None, enable_async_checkpointing=False
            ),
        )

    def resume(self, state, meta=None):
        """--resume: (state, meta) of the newest checkpoint, laid out as `state` (data position = step)."""
        if not self.start:
            return state, meta
        import jax
        import orbax.checkpoint as ocp

        restored = self._manager.restore(
            self.start,
            args=ocp.args.Composite(
                meta=ocp.args.JsonRestore(),
                state=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, state)),
            ),
        )
        print(f"resumed from step {self.start}")
        return restored.state, restored.meta

    def steps(self, flops_per_token=0, learning_rate=None, show=(), summed=(), counted=None):
        """Step indices from the start (or resumed step) to max_steps, with a progress bar showing `show`.
        flops_per_token: for charts/mfu; learning_rate: the schedule; summed: metrics logged as sums; counted:
        {metric: count metrics} for a step's mean over some of its examples (those the count metrics count;
        pairs of two kinds: their product): the interval's mean over all such examples, 0 where it has none."""
        from tqdm import tqdm

        assert self.max_steps is not None, "call run.resolve_max_steps before the loop"
        self._flops_per_token = flops_per_token
        self._lr = learning_rate
        self._show = show
        self._summed = summed
        self._counted = counted or {}
        self._new_interval()
        with tqdm(
            total=self.max_steps,
            initial=self.start,
            desc=self.script,
            dynamic_ncols=True,
            disable=not self.main,
        ) as self._bar:  # closed after the last step
            for step in range(self.start, self.max_steps):
                self.step = step + 1  # updates done once this step's body has run
                yield step  # the body's run.log opens the outputs after the first step
                self._bar.update(1)

    def log(self, metrics, tokens=0, padded=None, flops=None):
        """Keep one step's metrics (device arrays: no host sync), real and padded tokens (tokens/s, MFU,
        padding). Every log_every steps and at the last: one sync, NonFiniteLoss on a non-finite train/loss."""
        self._open()  # the first step is compiled and dispatched: from here on a signal checkpoints
        self._pending.append(metrics)
        self._sums.update(
            tokens=tokens,
            padded=padded or 0,
            flops=tokens * self._flops_per_token if flops is None else flops,
        )
        if padded:
            self._shapes.add(padded)  # a fixed --batch-size: one padded size per length bucket
        if self.step % self.log_every == 0 or self.step == self.max_steps:
            self._flush()

    def _flush(self):
        import jax
        import numpy as np

        self._open()  # where a checkpoint or the end comes first
        if not self._pending:
            return
        fetched = jax.device_get(self._pending)
        elapsed = time.perf_counter() - self._t0  # after the fetch: dispatch is async
        bad = [  # the steps of a non-finite loss (fetched[0]'s: the first of the interval)
            step
            for step, m in enumerate(fetched, self.step - len(fetched) + 1)
            if not np.isfinite(m.get("train/loss", 0.0))
        ]
        if bad and not self.skip_nonfinite:
            self.close()
            raise NonFiniteLoss(
                f"non-finite train/loss at step {bad[0]}; the newest checkpoint is the last good "
                "state (rerun with --resume and a lower --learning-rate"
                + (", or --skip-nonfinite)" if self.skip_nonfinite is not None else ")")
            )
        row = {
            k: float((np.sum if k in self._summed else np.mean)([m[k] for m in fetched])) for k in fetched[0]
        }
        for k, counts in self._counted.items():  # each step weighted by how many examples its mean covers
            w = np.array([np.prod([float(m[c]) for c in counts]) for m in fetched])
            row[k] = float(np.dot([float(m[k]) for m in fetched], w) / w.sum()) if w.sum() else 0.0
        if self._lr is not None:
            row["charts/learning_rate"] = float(self._lr(self.step - 1))
        self.last_train = row  # for the summary line (the same dict: the rows below are in it too)
        row.update(
            {
                "charts/tokens_per_sec": self._sums["tokens"] / elapsed,
                "charts/mfu": self._sums["flops"] / elapsed / peak_flops(),
                "charts/tokens": float(self._sums["tokens"]),  # the interval's (sums)
                "charts/flops": float(self._sums["flops"]),
            }
        )
        if self._sums["padded"]:
            row.update(
                {
                    "charts/padding_fraction": 1.0 - self._sums["tokens"] / self._sums["padded"],
                    "charts/compilations": float(len(self._shapes)),
                }
            )
        self._write(self.step, row)
        self._bar.set_postfix(
            **{k.split("/")[-1]: f"{row[k]:.4g}" for k in ("train/loss", *self._show) if k in row},
            tok_s=f"{row['charts/tokens_per_sec']:.0f}",
        )
        self._new_interval()

    def _new_interval(self):
        """Start what the next log row sums: metrics (device arrays), real and padded tokens, FLOPs, and the
        time, less what evaluation and checkpoints take (kept out of tokens/s: they move its start)."""
        self._pending = []
        self._sums = collections.Counter()  # tokens, padded, flops
        self._t0 = time.perf_counter()

    def eval_due(self):
        """True every eval_every steps and at the last (eval time is kept out of tokens/s)."""
        due = bool(self.eval_every) and (self.step % self.eval_every == 0 or self.step == self.max_steps)
        self._eval_started = time.perf_counter() if due else None
        return due

    def log_eval(self, row):
        """Log eval metrics (host floats, names prefixed eval/) at the current step, and print them."""
        self.last_eval = {k: float(v) for k, v in row.items()}
        self._write(self.step, self.last_eval)
        announce(
            f"step {self.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in list(self.last_eval.items())[:3])
        )
        if self._eval_started is not None:
            self._t0 += time.perf_counter() - self._eval_started
            self._eval_started = None

    def checkpoint(self, state, meta=None):
        """Every --save-every steps (and at the last, where the run is that long: a finished run extends from
        its final state) and after a SIGTERM/SIGINT: save `state` (pytree), meta (JSON), step; then Preempted"""
        stopping, every = self.stop_signal, self.args.save_every  # a later signal: at the next step
        # every N steps, and the last where the run is at least N long
        if not (stopping or (every and (self.step % every == 0 or self.step == self.max_steps >= every))):
            return
        self._flush()
        import orbax.checkpoint as ocp

        t = time.perf_counter()
        self._manager.save(
            self.step,
            force=True,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave({"step": self.step, **(meta or {})}),
            ),
        )
        self._t0 += time.perf_counter() - t
        if stopping:
            self.close()
            raise Preempted(
                f"{stopping}: checkpoint saved at step {self.step}; continue with: python "
                + (sys.argv[0] if sys.argv[0].endswith(".py") else f"{self.script}.py")
                + f" --resume --output-dir {self.dir}"
            )

    def finish(self, save):
        """save(path) writes model.tmp/, renamed model/ once whole (+ model_hf/: export_hf); then a summary."""
        import common

        self._flush()
        tmp = self.model_dir + ".tmp"
        if self.main:
            shutil.rmtree(tmp, ignore_errors=True)  # a save cut short
        save(tmp)
        if self.main:
            shutil.rmtree(self.model_dir, ignore_errors=True)
            os.replace(tmp, self.model_dir)
            if self.export_hf:
                interop.export_hf(
                    common.host_model(self.model_dir),
                    os.path.join(self.dir, "model_hf"),
                    self.args.chat_template or common.family_template(self.model_dir),
                )
        self.close()
        train = [(k, self.last_train[k]) for k in ("train/loss", *self._show) if k in self.last_train]
        took = time.perf_counter() - self._started
        print(
            f"done: {self.max_steps} steps in {took // 60:.0f}m{took % 60:02.0f}s; "
            + ", ".join(f"{k} {v:.4g}" for k, v in train + list(self.last_eval.items())[:2])
            + f"; outputs in {self.dir} (model/{', model_hf/' if self.export_hf else ''}"
            + ", metrics.jsonl, args.json)",
            flush=True,
        )

    def close(self):
        """Close the logs; SIGINT/SIGTERM get back their handlers from before the loop."""
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._closing.close()


def announce(line):
    """One line on process 0, above a progress bar if one is open."""
    import jax

    if jax.process_index() == 0:
        from tqdm import tqdm

        tqdm.write(line)


# --remat's switch on each decoder block (blocks.py), its decision told in the run's first lines
Remat = functools.partial(blocks.Remat, say=announce)


# --- 5. Accounting: FLOPs, peak, phase times; the compilation cache ---
# Dense bf16 peak FLOP/s per chip, from the vendors' datasheets.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
}
# Memory bandwidth in bytes/s per chip, from the same datasheets: a decode step's floor (benchmarks/decode.py)
PEAK_BANDWIDTH = {
    "TPU v4": 1200e9,
    "TPU v5 lite": 819e9,
    "TPU v5e": 819e9,
    "TPU v5p": 2765e9,
    "TPU v5": 2765e9,
    "TPU v6 lite": 1640e9,
    "TPU v6e": 1640e9,
    "H100": 3350e9,
    "H200": 4800e9,
    "A100": 2039e9,
}


def datasheet(table, kind):
    """A chip's entry of PEAK_FLOPS or PEAK_BANDWIDTH by its device_kind (None: not listed, e.g. CPU)."""
    return next((value for name, value in table.items() if name.lower() in kind.lower()), None)


def count_params(backbone):
    """N for FLOP accounting (docs/design.md, "FLOPs"): the weights used in matmuls, a tied embedding (Gemma,
    Qwen) as the output's; an untied one (Llama 3, Mistral) or Gemma 4 E2B / E4B's per-layer one is a lookup."""
    embedding = backbone.token_embedding
    lookups = [  # an untied token embedding, a per-layer one
        layer.embeddings
        for layer in (
            None if embedding.tie_weights else embedding,
            getattr(backbone, "per_layer_token_embedding", None),
        )
        if layer
    ]
    return int(
        sum(
            math.prod(v.shape)
            for v in backbone.weights
            if "lora" not in v.path and not any(v is x for x in lookups)
        )
    )


@functools.cache
def peak_flops():
    """Peak FLOP/s of all devices together: the table above per chip, or on CPU (and unknown kinds) a
    measured float32 matmul, once per process: simulated CPU devices share the host's cores."""
    import jax

    per_chip = datasheet(PEAK_FLOPS, jax.devices()[0].device_kind)
    return per_chip * jax.device_count() if per_chip else matmul_flops_per_sec() * jax.process_count()


def matmul_flops_per_sec(n=1024, repeats=5):
    """FLOP/s of a float32 n × n matmul on this process's first device, best of `repeats` (measured now)."""
    import jax
    import timeit

    x = jax.device_put(jax.numpy.ones((n, n), "float32"), jax.local_devices()[0])
    f = jax.jit(lambda a: a @ a).lower(x).compile()  # compiled before the timing
    return 2 * n**3 / min(timeit.repeat(lambda: f(x).block_until_ready(), number=1, repeat=repeats))


def synced(tree):
    """The time once every array of `tree` is computed (dispatch is asynchronous): a phase's end."""
    import jax

    jax.block_until_ready(tree)
    return time.perf_counter()


def phase_metrics(updates, ticks, new_tokens):
    """An RL step's row (ppo, grpo, rloo): its updates' metrics averaged on the host (one sync), the seconds of
    each phase from ticks [start, generated, scored] to now, and the tokens sampled (through each EOS)."""
    import jax
    import numpy as np

    fetched = jax.device_get(updates)
    generate, score, update = np.diff(ticks + [time.perf_counter()])
    return {
        **{k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]},
        "charts/generate_tokens_per_sec": new_tokens / generate,
        "charts/generate_time": generate,
        "charts/score_time": score,
        "charts/update_time": update,
        "charts/generated_tokens": float(new_tokens),
    }


def compilation_cache():
    """JAX's persistent compilation cache (a resumed run, a compare.py seed, a test process reuse an identical
    earlier one's programs) in $JAX_COMPILATION_CACHE_DIR (`off`: none), else ~/.cache/posttrain-jax; programs
    compiled in under $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS (0.5 s) are not stored. -> dir or None."""
    import jax

    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "posttrain-jax"
    )
    path = None if path == "off" else path
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 0.5)),
    )
    return path
