"""The run shell: plumbing every script shares and no one needs to read to learn an algorithm.

  1. The boundary  UsageError, RunComplete, Preempted, RunFailed (NonFiniteLoss); answer_help (--help from the
                   script's source, before its heavy imports); cli (tyro, errors in one line); launch (main
                   under the one boundary that turns those exceptions into exit codes 2, 0, 0, 1)
  2. Shared flags  SharedArgs: the flags every script has (each script's Args extends it)
  3. The run       Run: output dir, --resume/--overwrite, --max-steps from --num-epochs, args.json, metrics.jsonl
                   + TensorBoard (+ W&B), progress, tokens/s and MFU, the non-finite stop, eval and checkpoint
                   cadence, SIGTERM/SIGINT, the final model, a summary line
  4. Remat         enable_remat (a switch per decoder block), Remat (--remat auto: by compiled memory)
  5. Accounting    count_params, peak_flops (docs/design.md, "FLOPs"); synced, phase_metrics (RL phase times);
                   compilation_cache (JAX's persistent cache, on by default)
  6. Hub errors    hub_error: a Kaggle / Hugging Face failure as one line saying what to do
  7. Reward fns    reward_fn_signature (TRL's form or the two-argument one), call_reward_fn (its scores, or a
                   UsageError naming it), described
jax, numpy, keras and common are imported inside the functions that use them: `import plumbing` is instant,
and `python dpo.py --help` answers before the script's own imports."""

import ast
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import textwrap
import time
import types
from typing import Literal

HERE = os.path.dirname(os.path.abspath(__file__))


# --- 1. The boundary: the only place the process ends ---
class UsageError(Exception):
    """Bad input (flag, file, model name): one line on stderr, exit code 2."""


class RunComplete(Exception):
    """--resume on a run that already reached --max-steps: the message on stdout, exit code 0."""


class Preempted(Exception):
    """SIGTERM/SIGINT arrived and the state was checkpointed: the message on stdout, exit code 0."""


class RunFailed(Exception):
    """The work itself failed (not the input): the message on stderr, exit code 1."""


class NonFiniteLoss(RunFailed):
    """train/loss became NaN or inf: the message on stderr, exit code 1 (the checkpoints stay)."""


def _end(code, message=None, stream=None):
    """Print `message` and end the process: the exits of `answer_help` and `launch`, nowhere else.
    os._exit skips interpreter teardown, which can wait on JAX's or orbax's threads after an error."""
    if message is not None:
        with contextlib.suppress(BrokenPipeError):  # `--help | head`
            print(message, file=stream or sys.stdout)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def answer_help(module_name, path):
    """`python <script> --help`: print the help read from the script's `Args` source and exit 0,
    before the script's heavy imports (keras-hub takes seconds). Does nothing on `import <script>`."""
    if module_name == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
        text = help_from_source(path)
        if text is not None:
            _end(0, text)


def launch(main, args_class):
    """main(the parsed Args) under the boundary: UsageError -> `error: ...` on stderr, exit 2;
    RunComplete and Preempted -> their line on stdout, exit 0; RunFailed (NonFiniteLoss) -> stderr, exit 1.
    Until a Run's loop starts, SIGINT/SIGTERM end the process at once (nothing to save yet)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    try:
        args = cli(args_class)
        compilation_cache()
        main(args)
    except UsageError as e:
        _end(2, f"error: {e}", sys.stderr)
    except (RunComplete, Preempted) as e:
        _end(0, str(e))
    except RunFailed as e:
        _end(1, f"error: {e}", sys.stderr)


def cli(args_class, argv=None):
    """tyro.cli(Args) on argv (None: sys.argv), with tyro's boxed parse errors (bad choice, bad
    number…) as one UsageError."""
    import io
    import tyro
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return tyro.cli(args_class, args=argv)
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


def _fields(path, name):
    """(class `name`'s AST, its fields [(section, name, flag, doc, default)], the module's AST) of the
    file at `path`, read without importing it; a `# comment` between fields opens a section."""
    source = open(path).read()
    tree = ast.parse(source)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    names = {"os": os, "common": types.SimpleNamespace(HERE=HERE), "plumbing": sys.modules[__name__]}
    lines, fields, section, previous = source.splitlines(), [], None, getattr(cls, "lineno", 0)
    for i, node in enumerate(cls.body if cls else []):
        if not isinstance(node, ast.AnnAssign):
            continue
        section = next((x.strip("# ").rstrip() for x in lines[previous:node.lineno - 1][::-1]
                        if x.strip().startswith("#")), section)
        previous, nxt = node.end_lineno, cls.body[i + 1] if i + 1 < len(cls.body) else None
        doc = nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) else ""
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
            default = os.path.relpath(default, HERE) if str(default).startswith(HERE) else default  # data/…
        except Exception:
            default = ast.unparse(node.value)
        fields.append((section, node.target.id, flag, doc, default))
    return cls, fields, tree


def help_from_source(path, width=100):
    """--help of the script at `path` from its `class Args` source (no import, so it is instant): the
    shared flags (SharedArgs) with the script's defaults, and its own flags in their sections (a new
    section before the outputs'); each flag with its choices, doc and default. None without Args."""
    cls, own, tree = _fields(path, "Args")
    if cls is None:
        return None
    shared = _fields(__file__, "SharedArgs")[1] if any("SharedArgs" in ast.unparse(b) for b in cls.bases) else []
    mine, sections = {f[1]: f for f in own}, {}
    for f in [(f[0],) + mine.pop(f[1], f)[1:] for f in shared] + list(mine.values()):
        sections.setdefault(f[0], []).append(f)
    last = ("logging and outputs", "multi-host (TPU pods and clusters are detected without these)")
    out = [f"usage: {os.path.basename(path)} [OPTIONS]", "", ast.get_docstring(tree) or ""]
    for section in sorted(sections, key=lambda s: s in last):
        out += ["", f"{section}:"]
        for _, _, flag, doc, default in sections[section]:
            text = " ".join(doc.split()) + f" (default: {default if default != '' else repr(default)})"
            out += [f"  {flag}"] + textwrap.wrap(text, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(out)


# --- 2. The flags every script shares (the Run reads these fields, and nothing else of Args) ---
@dataclasses.dataclass
class SharedArgs:
    # model
    model: str = "tiny"
    """alias (gemma_2b, …), KerasHub preset, kaggle:// or hf:// handle, local preset / HF dir, or `tiny`"""
    chat_template: Literal["gemma", "llama3", "mistral", "chatml"] | None = None
    """how chats (message lists) are rendered; None: --model's family's (Gemma: gemma, Llama 3: llama3,
    Mistral: mistral, Qwen: chatml)"""
    dtype: Literal["bfloat16", "float32"] | None = None
    """compute dtype; weights and optimizer state stay float32. None: bfloat16 on TPU/GPU, float32 on CPU"""
    lora_rank: int = 0
    """0 = full fine-tuning; >0 = KerasHub LoRA of this rank on the backbone"""
    mesh: str | None = None
    """device mesh, e.g. `data=4,model=2`; None: every device on `data`"""
    remat: Literal["auto", "on", "off"] = "auto"
    """recompute each decoder block's activations in the backward pass (memory for ~1/3 more FLOPs);
    auto: on only if the step compiled without it would not fit the device's memory (never on CPU)"""
    # data
    dataset: str = ""
    """training data: .jsonl/.json/.parquet, or a Hugging Face dataset id / saved dir"""
    # optimisation
    max_steps: int | None = None
    """optimizer updates; None: ceil(--num-epochs × rows of --dataset / rows per step), resolved before training"""
    num_epochs: float = 3.0
    """passes over --dataset that set --max-steps when it is None (TRL's num_train_epochs: 3)"""
    batch_size: int = 8
    """examples per update, global over devices (and accumulation) (TRL: 8 per device)"""
    learning_rate: float = 1e-6
    """peak AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay, on matrices only (not norms or biases) (TRL: 0.0)"""
    max_grad_norm: float = 1.0
    """global gradient-norm clip"""
    seed: int = 0
    """seeds init (tiny), data order and sampling"""
    # logging and outputs
    output_dir: str | None = None
    """None: runs/{script}__{model}__{seed}__{time}"""
    save_every: int = 0
    """checkpoint every N steps (0: only on SIGTERM/SIGINT); the newest 3 are kept"""
    resume: bool = False
    """continue from the newest complete checkpoint in --output-dir"""
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


# --- 3. The run's lifecycle ---
RUN_FILES = ("args.json", "metrics.jsonl", "checkpoints", "model", "model_hf")


def default_output_dir(script, model, seed):
    tag = os.path.basename(os.path.normpath(model))
    return os.path.join("runs", f"{script}__{tag}__{seed}__{time.strftime('%Y%m%d-%H%M%S')}")


def checkpoint_steps(output_dir):
    """Steps of the complete checkpoints (orbax renames a step's directory into place once written)."""
    path = os.path.join(output_dir, "checkpoints")
    return sorted(int(d) for d in os.listdir(path) if d.isdigit()) if os.path.isdir(path) else []


def check_flags(**flags):
    """flags: name=(value, lowest allowed, whether the lowest itself is refused); None values pass."""
    for name, (value, low, strict) in flags.items():
        if value is not None and (value <= low if strict else value < low):
            raise UsageError(f"--{name.replace('_', '-')} {value}: must be {'>' if strict else '>='} {low}")


class Run:
    """One training run's life, so that each script's loop shows only its algorithm:

        run = plumbing.Run("dpo", args, log_every=.., eval_every=..)  # flags and --output-dir checked
        max_steps = run.resolve_max_steps(len(train_rows))             # --max-steps, or --num-epochs'
        state, _ = run.resume(state)        # the newest checkpoint with --resume, else as given
        for step in run.steps(flops_per_token, schedule):   # progress bar
            state, metrics = step_fn(state, ...)
            run.log(metrics, real, padded)  # on device; one host sync per log_every; real-token tokens/s
            if run.eval_due():
                run.log_eval(evaluate(state[0]))
            run.checkpoint(state)           # every --save-every steps, and after SIGTERM/SIGINT (raises Preempted)
        run.finish(lambda path: common.save_model(model, state[0], path))

    Making it starts jax.distributed when several processes take part, makes the mesh (run.mesh) and
    checks the shared flags and --output-dir; it writes nothing and installs no signal handler.
    Reads only SharedArgs' fields of `args` and the keywords given; never changes `args`: what it
    resolves (output_dir, dtype, max_steps, and what main passes to `record`) is an attribute and goes
    into args.json beside the flags. Nothing is written until the first step has run (its run.log);
    from then on the first SIGINT/SIGTERM checkpoints at the next step boundary and raises Preempted,
    and a second one ends the process at once. model/ is renamed into place only once complete.
    """

    def __init__(self, script, args, *, log_every=1, eval_every=0, grad_accum_steps=1, warmup_steps=0,
                 export_hf=False, skip_nonfinite=None):
        import common
        common.init_distributed(args.coordinator_address, args.num_processes, args.process_id)
        check_flags(learning_rate=(args.learning_rate, 0, True), batch_size=(args.batch_size, 1, False),
                    max_steps=(args.max_steps, 0, False), num_epochs=(args.num_epochs, 0, True),
                    weight_decay=(args.weight_decay, 0, False), save_every=(args.save_every, 0, False),
                    log_every=(log_every, 1, False), eval_every=(eval_every, 0, False),
                    grad_accum_steps=(grad_accum_steps, 1, False), warmup_steps=(warmup_steps, 0, False))
        if export_hf:
            common.check_export_hf(args.model)
        if args.track:
            import importlib.util
            if importlib.util.find_spec("wandb") is None:
                raise UsageError("--track logs to Weights & Biases, which is not installed: pip install wandb")
        self.script, self.args, self.log_every, self.eval_every = script, args, log_every, eval_every
        self.export_hf, self.skip_nonfinite = export_hf, skip_nonfinite
        self.dtype = args.dtype or common.default_dtype()
        self.dir = args.output_dir or default_output_dir(script, args.model, args.seed)
        self.model_dir, self.max_steps, self.resolved = os.path.join(self.dir, "model"), args.max_steps, {}
        self.mesh = common.make_mesh(args.mesh)
        self.main = common.jax.process_index() == 0  # process 0 writes the outputs
        if args.batch_size % (self.mesh.shape["data"] * grad_accum_steps):
            accum = f" × --grad-accum-steps ({grad_accum_steps})" if grad_accum_steps > 1 else ""
            raise UsageError(f"--batch-size {args.batch_size} must divide by data axis ({self.mesh.shape['data']}){accum}")
        self._done, self._no_checkpoint = None, None  # --resume: steps of a finished run; why it cannot resume
        self.start = self.step = self._check_output_dir()
        self.stop_signal, self.last_train, self.last_eval = None, {}, {}
        self._pending, self._tokens, self._flops, self._paused, self._eval_started = [], 0, 0.0, 0.0, None
        self._padded, self._shapes = 0, set()
        self._opened, self._buffered, self._manager, self._started = False, [], None, time.perf_counter()
        self._handlers = {}  # SIGINT/SIGTERM's handlers before the loop, restored by close()

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
            self._check_resumable()  # with --max-steps None: in resolve_max_steps, once it is derived
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

    def _check_resumable(self):
        """--resume on a complete run: RunComplete; with no checkpoint to continue from: UsageError."""
        if self.max_steps is not None and self._done is not None and self.max_steps <= self._done:
            raise RunComplete(f"{self.dir}: this run is complete ({self._done} steps, model/ saved); "
                              "nothing to resume")
        if self.max_steps is not None and self._no_checkpoint:
            raise UsageError(self._no_checkpoint)

    def resolve_max_steps(self, num_rows, rows_per_step=None):
        """--max-steps, or (when None) ceil(--num-epochs × num_rows / rows_per_step), rows_per_step
        defaulting to --batch-size; recorded in args.json, so --resume derives the same."""
        if self.max_steps is None:
            per_step = rows_per_step or self.args.batch_size
            self.max_steps = max(1, math.ceil(self.args.num_epochs * num_rows / per_step))
            if self.main:
                print(f"--max-steps {self.max_steps}: {self.args.num_epochs:g} epochs of {num_rows} rows, "
                      f"{per_step} a step")
        self._check_resumable()
        return self.max_steps

    def record(self, **values):
        """Values main resolved (e.g. remat=<Remat>) for args.json, written after the first step;
        a value that is not JSON (a Remat) is recorded as its str (the resolved mode)."""
        self.resolved.update(values)

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
        self._handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        if not self.main:
            return
        if self.args.overwrite and not self.args.resume and os.path.isdir(self.dir):
            for f in os.listdir(self.dir):
                if f in RUN_FILES or f.startswith("events.out.tfevents"):
                    path = os.path.join(self.dir, f)
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        os.makedirs(self.dir, exist_ok=True)
        record = {**vars(self.args), "output_dir": self.dir, "dtype": self.dtype, "max_steps": self.max_steps,
                  **self.resolved}
        with open(os.path.join(self.dir, "args.json.tmp"), "w") as f:
            json.dump(record, f, indent=2, default=str)
        os.replace(os.path.join(self.dir, "args.json.tmp"), os.path.join(self.dir, "args.json"))
        path = os.path.join(self.dir, "metrics.jsonl")
        if self.args.resume and os.path.exists(path):  # drop rows logged past the checkpoint
            with open(path) as f:
                kept = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= self.start]
            with open(path, "w") as f:
                f.writelines(kept)
        from tensorboardX import SummaryWriter
        self._metrics, self._tb, self._wandb = open(path, "a"), SummaryWriter(self.dir), None
        if self.args.track:
            import wandb
            self._wandb = wandb.init(config=record, name=os.path.basename(self.dir))
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

    def resume(self, state, meta=None):
        """(state, meta) of the newest checkpoint with --resume (shaped and sharded like `state`:
        a pytree of arrays), else as given. The data position is the step itself."""
        if not self.start:
            return state, meta
        import jax
        ocp, manager = self._checkpoints()
        restored = manager.restore(self.start, args=ocp.args.Composite(meta=ocp.args.JsonRestore(),
            state=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, state))))
        print(f"resumed from step {self.start}")
        return restored.state, restored.meta

    def _checkpoints(self):
        """(orbax, its manager), made on first use: orbax, the JAX standard, writes each process's
        shards, a step appears only once complete, and the newest 3 are kept."""
        import orbax.checkpoint as ocp
        options = ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=False)
        self._manager = self._manager or ocp.CheckpointManager(os.path.abspath(os.path.join(self.dir, "checkpoints")),
                                                               options=options)
        return ocp, self._manager

    def steps(self, flops_per_token=0, learning_rate=None, show=(), summed=()):
        """Step indices from the start (or the resumed step) to max_steps, with a progress bar.

        flops_per_token: for charts/mfu (docs/design.md, "FLOPs"); learning_rate: the schedule, for
        charts/learning_rate; show: metrics on the progress bar; summed: metrics logged as a count
        per interval rather than a mean.
        """
        from tqdm import tqdm
        assert self.max_steps is not None, "call run.resolve_max_steps before the loop"
        self._flops_per_token, self._lr, self._show, self._summed = flops_per_token, learning_rate, show, summed
        self._peak, self._t0, self._paused = peak_flops(), time.perf_counter(), 0.0
        self._bar = tqdm(total=self.max_steps, initial=self.start, desc=self.script, dynamic_ncols=True,
                         disable=not self.main)
        for step in range(self.start, self.max_steps):
            self.step = step + 1  # updates done once this step's body has run
            yield step  # the body's run.log opens the outputs after the first step
            self._bar.update(1)
        self._bar.close()

    def log(self, metrics, tokens=0, padded=None, flops=None):
        """Keep one step's metrics (device arrays: no host sync) and the real (non-pad) tokens it
        trained on, which tokens/s and MFU count (flops: when not tokens × flops_per_token);
        padded: the tokens of its padded batch, for charts/padding_fraction and charts/compilations
        (the distinct batch shapes so far: the step compiles once per shape). Every log_every steps
        and at the last, fetch them in one sync, raise NonFiniteLoss on a non-finite train/loss
        (unless skip_nonfinite), and log their means."""
        self._open()  # the first step is compiled and dispatched: from here on a signal checkpoints
        self._pending.append(metrics)
        self._tokens += tokens
        if padded:
            self._padded += padded
            self._shapes.add(padded)  # a fixed --batch-size: one padded size per length bucket
        self._flops += tokens * self._flops_per_token if flops is None else flops
        if self.step % self.log_every == 0 or self.step == self.max_steps:
            self._flush()

    def _flush(self):
        import jax
        import numpy as np
        if not self._pending:
            return
        fetched = jax.device_get(self._pending)
        elapsed = time.perf_counter() - self._t0 - self._paused  # after the fetch: dispatch is async
        first = self.step - len(fetched) + 1
        bad = [first + i for i, m in enumerate(fetched) if not np.isfinite(m.get("train/loss", 0.0))]
        if bad and not self.skip_nonfinite:
            self.close()
            raise NonFiniteLoss(f"non-finite train/loss at step {bad[0]}; the newest checkpoint is the last good "
                                "state (rerun with --resume and a lower --learning-rate"
                                + (", or --skip-nonfinite)" if self.skip_nonfinite is not None else ")"))
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
        """True every eval_every steps and at the last (eval time is kept out of tokens/s)."""
        due = bool(self.eval_every) and (self.step % self.eval_every == 0 or self.step == self.max_steps)
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
        save `state` (a pytree of arrays) + meta (JSON) + the step; after a signal, raise Preempted."""
        stopping = self.stop_signal  # read once: a signal arriving later is handled at the next step
        every = self.args.save_every
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
            raise Preempted(f"{stopping}: checkpoint saved at step {self.step}; continue with --resume")

    def finish(self, save):
        """save(path) writes the final model into model.tmp/, renamed to model/ once complete
        (then model_hf/ with export_hf); then one summary line (last train and eval metrics, outputs)."""
        import common
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
            if self.export_hf:
                common.export_hf(self.model_dir, os.path.join(self.dir, "model_hf"))
        self.close()
        shown = {k: self.last_train[k] for k in ("train/loss", *self._show) if k in self.last_train}
        shown.update(list(self.last_eval.items())[:2])
        took = time.perf_counter() - self._started
        print(f"done: {self.max_steps} steps in {took // 60:.0f}m{took % 60:02.0f}s; "
              + ", ".join(f"{k} {v:.4g}" for k, v in shown.items())
              + f"; outputs in {self.dir} (model/{', model_hf/' if self.export_hf else ''}"
              + ", metrics.jsonl, args.json)", flush=True)

    def close(self):
        """Close the logs; SIGINT/SIGTERM do again what they did before the loop (main called twice in
        a notebook or a test: Ctrl-C interrupts as usual once a run has ended)."""
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        if self._opened and self.main:
            self._metrics.close()
            self._tb.close()
            if self._wandb:
                self._wandb.finish()


# --- 4. Remat: activation checkpointing per decoder block, --remat {auto,on,off} ---
def enable_remat(backbone, on=True):
    """Activation checkpointing per decoder block: each block's activations are recomputed
    in the backward pass, so only the block inputs [B, T, D] stay alive between forward and
    backward (about +1/3 FLOPs; what makes Gemma-2B DPO fit 16 GiB chips). Calls with a KV
    cache (generation) are left alone: they have no backward pass. `backbone.remat_on`, read
    when a step is traced, switches it (Remat's auto). Returns the backbone."""
    import jax
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
    import jax
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


class Remat:
    """--remat for `backbones`: "off" leaves them untouched; otherwise each decoder block gets a
    jax.checkpoint switch (enable_remat) that `jit` sets: on / off as asked; auto: off where the
    device sets no memory limit (CPU: remat is pure cost), else decided at the step's first call,
    by compiling it ahead of time without remat. str(remat) is the resolved mode (args.json)."""

    def __init__(self, mode, *backbones):
        self.requested, self.mode, self.backbones = mode, None if mode == "auto" else mode, []
        for backbone in backbones:
            self.add(backbone)

    def add(self, backbone):
        """Put one more backbone (e.g. PPO's value model) under the same switch."""
        if self.requested != "off":
            self.backbones.append(enable_remat(backbone, self.requested == "on"))
        return backbone

    def __str__(self):
        return self.mode or self.requested

    def _resolve(self, mode, why, fn, jit_kwargs):
        import jax
        self.mode = mode
        for backbone in self.backbones:
            backbone.remat_on = mode == "on"
        if why and jax.process_index() == 0:
            from tqdm import tqdm
            tqdm.write(f"remat: auto -> {mode} ({why})")  # above the progress bar the first step runs under
        return jax.jit(fn, **jit_kwargs)  # a new callable: traced afresh, with the switch as now set

    def jit(self, fn, length=None, **jit_kwargs):
        """jax.jit(fn, **jit_kwargs) with the remat mode applied. auto, on a device with a memory
        limit: at the first call fn is compiled ahead of time without remat for that call's argument
        shapes and shardings, the batch (third argument, leaves [A, B, T, ...]) at `length` tokens (the
        run's longest), and remat is turned on when the compiled peak per device (argument + output +
        temp − alias) exceeds 90% of the limit: the 10% covers what the analysis leaves out (allocator
        fragmentation, the runtime's own buffers, the next batch and eval arrays beside the step).
        Costs one extra compile (CPU-measured in benchmarks/RESULTS.md "Step performance")."""
        import functools
        import jax
        fn, limit, resolved = functools.partial(fn), device_memory_limit(), []
        if self.requested != "auto" or limit is None:
            why = self.requested == "auto" and f"{jax.devices()[0].platform}: no device memory limit"
            return self._resolve("off" if self.requested == "auto" else self.requested, why, fn, jit_kwargs)

        def step(*a):
            if not resolved:
                spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), a)
                at = lambda s: s.update(shape=s.shape[:2] + (length,) + s.shape[3:]) if length and s.ndim >= 3 else s
                t, spec = time.perf_counter(), (*spec[:2], jax.tree.map(at, spec[2]), *spec[3:])
                m = self._resolve("off", None, fn, jit_kwargs).lower(*spec).compile().memory_analysis()
                peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
                why = (f"compiled peak {peak / 2**30:.2f} GiB of {limit / 2**30:.2f} GiB per device; "
                       f"checked in {time.perf_counter() - t:.1f} s")
                resolved.append(self._resolve("on" if peak > 0.9 * limit else "off", why, fn, jit_kwargs))
            return resolved[0](*a)
        return step


# --- 5. Accounting: FLOPs, peak, phase times; the compilation cache ---
# Dense bf16 peak FLOP/s per chip, from the vendors' datasheets.
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
              "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12,
              "H100": 989e12, "H200": 989e12, "A100": 312e12}
_measured_peak = {}


def count_params(backbone):
    """N for FLOP accounting (docs/design.md, "FLOPs"): every weight used in a matmul. A tied
    embedding is also the output matmul (Gemma, Qwen); an untied one (Llama 3, Mistral) is a
    lookup, and its output matrix is the matmul."""
    import numpy as np
    embedding = backbone.token_embedding
    lookup = embedding.embeddings if not embedding.tie_weights else None
    return int(sum(np.prod(v.shape) for v in backbone.weights if "lora" not in v.path and v is not lookup))


def peak_flops():
    """Peak FLOP/s of all devices together: the table above per chip, or on CPU (and
    unknown kinds) a measured float32 matmul. Simulated CPU devices share the host's
    cores, so on CPU the host peak counts once per process, not once per device."""
    import jax
    kind = jax.devices()[0].device_kind
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return flops * jax.device_count()
    if kind not in _measured_peak:
        _measured_peak[kind] = matmul_flops_per_sec()
    return _measured_peak[kind] * jax.process_count()


def matmul_flops_per_sec(n=1024, repeats=5):
    """FLOP/s of a float32 n × n matmul on this process's first device, best of `repeats` (measured now)."""
    import jax
    import numpy as np
    x = jax.device_put(np.ones((n, n), np.float32), jax.local_devices()[0])
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times)


def synced(tree):
    """The time once every array of `tree` is computed (dispatch is asynchronous): a phase's end."""
    import jax
    jax.block_until_ready(tree)
    return time.perf_counter()


def phase_metrics(updates, ticks, new_tokens):
    """An RL step's row (ppo, grpo): its updates' metrics averaged on the host (one sync), and the
    seconds of each phase from ticks [start, generated, scored] to now: generate, score, update."""
    import jax
    import numpy as np
    fetched = jax.device_get(updates)
    generate, score, update = np.diff(ticks + [time.perf_counter()])
    return {**{k: float(np.mean([m[k] for m in fetched])) for k in fetched[0]},
            "charts/generate_tokens_per_sec": new_tokens / generate, "charts/generate_time": generate,
            "charts/score_time": score, "charts/update_time": update}


def compilation_cache():
    """JAX's persistent compilation cache, so a resumed run, a compare.py seed and a test process reuse
    the compiled programs of an identical earlier one. Directory: $JAX_COMPILATION_CACHE_DIR (JAX's own
    variable), else ~/.cache/posttrain-jax; JAX_COMPILATION_CACHE_DIR=off turns it off. Programs that
    compile in under 0.5 s are not stored (JAX's default threshold is 1 s). Returns the directory or None."""
    import jax
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "posttrain-jax")
    if path == "off":
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


# --- 6. Hub errors: what to do when a model cannot be fetched, in one line ---
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


# --- 7. Reward functions: calling the user's code (common.Scorer), and its failures in one line ---
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


def call_reward_fn(fn, n, *args, **kwargs):
    """fn(*args, **kwargs) -> [n] float64 scores, NaN where it returned None; a UsageError naming fn
    when it raises or returns anything else."""
    import traceback
    import numpy as np
    try:
        out = fn(*args, **kwargs)
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]  # the innermost frame: where in its code
        raise UsageError(f"reward function {described(fn)} raised {type(e).__name__}: {e} "
                         f"(at {where.filename}:{where.lineno})") from None
    try:
        values = np.array([np.nan if v is None else float(v) for v in out], np.float64)
    except (TypeError, ValueError):
        raise UsageError(f"reward function {described(fn)} returned {str(out)[:80]!r}: expected one float "
                         f"(or None) per completion") from None
    if values.shape != (n,):
        raise UsageError(f"reward function {described(fn)} returned {len(values)} scores for {n} completions")
    return values
