"""The run's lifecycle (plumbing.Run and plumbing.launch) as a user meets it, through sft.py: --resume
on runs that cannot or need not continue, flags and files checked before the model loads, Ctrl-C
during start-up and twice, fast grouped --help, a plain `import`, and what a run records and prints
at its end. Refusals are checked in this process (the exception main raises); one subprocess per
kind of exit checks what the boundary makes of it (one line, the exit code)."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, learning_env, one_device_env, run_script, usage_error

FAST = [
    "--model",
    "tiny",
    "--batch-size",
    "8",
    "--log-every",
    "2",
    "--eval-dataset",
    "",
    "--num-samples",
    "0",
]
SCRIPTS = (
    "sft.py",
    "dpo.py",
    "simpo.py",
    "orpo.py",
    "kto.py",
    "reward.py",
    "ppo.py",
    "grpo.py",
    "rloo.py",
    "distill.py",
    "evaluate.py",
    "compare.py",
)


def sft(*flags):
    return run_script("sft.py", *FAST, *flags, env=one_device_env())


def sft_refusal(*flags):
    """The UsageError sft.main raises, in this process, for these flags (on top of FAST)."""
    import sft as script  # here: JAX is imported after conftest set XLA_FLAGS

    return usage_error(script, *FAST, *flags)


def snapshot(path):
    """{relative path: (size, mtime)} of every file under `path`: 'nothing touched' means equal."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, path)] = (os.path.getsize(p), os.stat(p).st_mtime_ns)
    return out


def one_line_exit_2(proc):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 4-step run without a checkpoint (--save-every 0), on a host that says, as a lone TPU VM
    does, TPU_WORKER_HOSTNAMES=localhost: one host, so it starts alone (common.init_distributed)."""
    out = str(tmp_path_factory.mktemp("life") / "done")
    env = {**one_device_env(), "TPU_WORKER_HOSTNAMES": "localhost"}
    proc = run_script("sft.py", *FAST, "--max-steps", "4", "--save-every", "0", "--output-dir", out, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, proc


def test_finished_run_records_resolved_args_and_prints_a_summary(finished):
    out, proc = finished
    with open(os.path.join(out, "args.json")) as f:
        saved = json.load(f)
    assert saved["output_dir"] == out and saved["dtype"] == "float32"  # resolved, not null
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("done: 4 steps in ") and "train/loss " in last and f"outputs in {out}" in last
    assert not os.path.exists(os.path.join(out, "model.tmp"))


def test_resume_without_checkpoint_is_refused_and_touches_nothing(finished, tmp_path):
    out, _ = finished
    before = snapshot(out)
    line = sft_refusal("--max-steps", "8", "--output-dir", out, "--resume")
    assert out in line and "no checkpoint" in line
    assert snapshot(out) == before
    empty = str(tmp_path / "nothing")
    assert "no checkpoint" in sft_refusal("--max-steps", "8", "--output-dir", empty, "--resume")
    assert not os.path.exists(empty)


def test_resume_of_a_complete_run_says_so_and_touches_nothing(finished):
    import plumbing
    import sft as script

    out, _ = finished
    before = snapshot(out)
    with pytest.raises(plumbing.RunComplete, match="complete"):  # through the CLI: exit 0 (below)
        script.main(plumbing.cli(script.Args, [*FAST, "--max-steps", "4", "--output-dir", out, "--resume"]))
    assert snapshot(out) == before


def test_occupied_dir_exits_2_in_one_line(finished):
    out, _ = finished  # the one subprocess of this kind: the boundary's one line and exit code 2
    line = one_line_exit_2(sft("--max-steps", "4", "--output-dir", out))
    assert "already holds a finished run" in line and "--overwrite" in line and "--resume" not in line


def test_flags_and_files_are_checked_before_the_model_loads(tmp_path):
    # A --model dir that would fail to load: each error below must come first (before any load).
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    out = str(tmp_path / "out")
    cases = [
        (["--dataset", "/nonexistent.jsonl"], "--dataset /nonexistent.jsonl: no such file"),
        (["--eval-dataset", "/nope/eval.jsonl"], "--eval-dataset /nope/eval.jsonl: no such file"),
        (["--learning-rate", "-1"], "--learning-rate -1.0: must be > 0"),
        (["--learning-rate", "0"], "--learning-rate 0.0: must be > 0"),
        (["--weight-decay", "-0.1"], "--weight-decay -0.1: must be >= 0"),
        (["--dtype", "fp16"], "--dtype"),
    ]
    data = [
        "--dataset",
        "data/sft_train.jsonl",
        "--eval-dataset",
        "data/sft_eval.jsonl",
    ]  # given: not defaults
    for flags, message in cases:
        assert message in sft_refusal("--model", str(broken), *data, *flags, "--output-dir", out), flags
        assert not os.path.exists(out)


def test_files_as_trl_users_write_them_and_the_places_that_cannot_be_read_or_written(tmp_path):
    """A .json holding JSON Lines (`Dataset.to_json` writes them) reads as JSON Lines; bytes that are not
    UTF-8 and an --output-dir that is a file (or under one) stop with one line naming the place, before
    the model loads (Hub ids and saved folders: tests/test_datasets.py)."""
    import common

    rows = [{"text": "a"}, {"text": "b \u2028 c"}]
    (tmp_path / "lines.json").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    (tmp_path / "array.json").write_text(json.dumps(rows))
    for name in ("lines.json", "array.json"):
        assert common.read_rows(str(tmp_path / name)) == [(rows[0], 1), (rows[1], 2)]
    raw = b'{"text": "a"}\n{"text": "caf\xe9"}\n'  # Latin-1, not UTF-8
    (tmp_path / "latin1.jsonl").write_bytes(raw)
    message = sft_refusal("--dataset", str(tmp_path / "latin1.jsonl"), "--output-dir", str(tmp_path / "out"))
    offset = raw.index(b"\xe9")
    assert f"latin1.jsonl:2: not UTF-8 text (byte offset {offset}: " in message
    (tmp_path / "file").write_text("")
    for out in (tmp_path / "file", tmp_path / "file" / "run"):
        assert sft_refusal("--output-dir", str(out)) == f"--output-dir {out}: {tmp_path / 'file'} is a file"


def test_track_without_wandb_is_refused_writing_nothing(tmp_path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    out = str(tmp_path / "out")
    assert "pip install wandb" in sft_refusal("--max-steps", "2", "--track", "--output-dir", out)
    assert not os.path.exists(out)  # so a plain rerun is not refused


def test_import_has_no_side_effects():
    """`import dpo` (a notebook, a test) with --help in sys.argv prints nothing, exits nothing and
    leaves sys.excepthook and the signal handlers alone."""
    code = (
        "import signal, sys; sys.argv = ['notebook', '--help']; hook = sys.excepthook; "
        "handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]; "
        "import dpo, sft, simpo, orpo, kto, reward, ppo, grpo, rloo, distill, evaluate, compare; "
        "assert sys.excepthook is hook; "
        "assert handlers == [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=one_device_env()
    )
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr[-2000:]


def start(out, *flags):
    env = {**learning_env(), "PYTHONUNBUFFERED": "1"}  # its evals must run fast
    return subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "sft.py"), *FAST, "--output-dir", out, *flags],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def read_until(proc, prefix, timeout=300):
    """Lines of the process's stdout up to the first that starts with `prefix`."""
    start_time = time.time()
    for line in proc.stdout:
        if line.lstrip("\n").startswith(prefix):
            return line
        assert time.time() - start_time < timeout
    raise AssertionError(f"no line starting with {prefix!r}; exit code {proc.wait()}")


def test_ctrl_c_during_start_up_exits_at_once_writing_nothing(tmp_path):
    out = str(tmp_path / "startup")
    proc = start(out, "--max-steps", "50")
    read_until(proc, "data:")  # the model is loaded; the first step (compilation) is next
    t = time.time()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGINT and time.time() - t < 5
    assert not os.path.exists(out)  # nothing half-written: outputs appear after the first step


def test_second_ctrl_c_exits_at_once(tmp_path):
    # A long eval after every step: the first Ctrl-C arrives while there is still work to do
    # before the step boundary where it would checkpoint; the second must not wait for it.
    out = str(tmp_path / "twice")
    proc = start(
        out,
        "--max-steps",
        "50",
        "--eval-every",
        "1",
        "--eval-dataset",
        os.path.join(ROOT, "data", "sft_train.jsonl"),
    )
    read_until(proc, "step 1:")  # the eval after step 1: signals now checkpoint
    proc.send_signal(signal.SIGINT)
    assert "again to quit at once" in read_until(proc, "SIGINT:")
    t = time.time()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGINT and time.time() - t < 5
    assert not os.path.exists(os.path.join(out, "checkpoints"))  # it did not wait to save


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_fast_grouped_and_lists_choices(script):
    t = time.time()
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=one_device_env(),
    )
    took = time.time() - t
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert took < 3, took
    text = proc.stdout
    flags = [line for line in text.splitlines() if line.startswith("  --")]
    assert flags and text.count("(default:") == len(flags)  # each default printed once
    groups = [line for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert len(groups) >= 2, text  # the sections named by the comments in Args
    if "--dtype" in text:
        assert "--dtype {bfloat16,float32}" in text
    choices = {
        "ppo.py": ["--kl-estimator {k1,k3}"],
        "grpo.py": ["--loss-type {", "--scale-rewards {"],
        "dpo.py": ["--loss-type {sigmoid,ipo,hinge}"],
        "kto.py": ["--loss-type {kto,apo_zero_unpaired}"],
    }
    for flag in choices.get(script, []):
        assert flag in text, flag
    for line in text.splitlines():
        assert line.count("(default:") <= 1 and "(default: None) (default" not in line
    # the defaults are for real pretrained models: TRL's learning rate (SimPO: its paper's recipe)
    trl_rate = {
        "sft.py": "2e-05",
        "dpo.py": "1e-06",
        "simpo.py": "6e-07",
        "orpo.py": "1e-06",
        "kto.py": "1e-06",
        "reward.py": "0.0001",
        "ppo.py": "3e-06",
        "grpo.py": "1e-06",
        "rloo.py": "1e-06",
        "distill.py": "1e-06",
    }
    if script in trl_rate:
        rate = text.split("  --learning-rate FLOAT\n")[1].split("  --")[0]
        assert f"(default: {trl_rate[script]})" in rate, rate
        steps = text.split("  --max-steps INT\n")[1].split("  --")[0]
        assert "(default: None)" in steps and "  --num-epochs FLOAT" in text, steps


def test_max_steps_none_derives_from_epochs_and_is_recorded(tmp_path):
    """--max-steps None: ceil(num_epochs × rows / rows a step), fixed before training, kept in args.json;
    --resume on that finished run derives the same number and finds it complete."""
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "data", "sft_train.jsonl"))][:5]
    (tmp_path / "five.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "run")
    flags = ["--dataset", str(tmp_path / "five.jsonl"), "--num-epochs", "2", "--output-dir", out]
    proc = sft(*flags)  # batch 8 (FAST): ceil(2 × 5 / 8) = 2 steps
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(os.path.join(out, "args.json")) as f:
        assert json.load(f)["max_steps"] == 2
    assert "--max-steps 2: 2 epochs of 5 rows, 8 a step" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("done: 2 steps in ")
    again = sft(*flags, "--resume")
    assert again.returncode == 0 and "this run is complete (2 steps" in again.stdout, again.stderr[-2000:]
    # GRPO: a step takes batch_size / num_generations prompts: ceil(1.5 × 5 / (16 / 4)) = 2
    import grpo  # here: JAX is imported after conftest set XLA_FLAGS
    import plumbing

    args = grpo.Args(
        dataset=str(tmp_path / "five.jsonl"),
        batch_size=16,
        num_generations=4,
        num_epochs=1.5,
        output_dir=str(tmp_path / "g"),
    )
    run = plumbing.Run("grpo", args)  # flags and output dir only: no model, no compute
    assert run.resolve_max_steps(5, args.batch_size // args.num_generations) == 2
    assert args.max_steps is None  # resolved values are the Run's; args are never changed


def test_resume_knows_what_it_resumes(tmp_path):
    """A resume whose run-defining flags (or script) differ from args.json's is refused, listing each
    difference, touching nothing; --max-steps extends a finished run from its final state (the last step
    is checkpointed where the run is --save-every long) and args.json keeps the first part's record, each
    resume appending its own; a finished run whose newest checkpoint is older than its model/ is refused."""
    import dpo
    import plumbing
    import sft as script

    assert plumbing.SharedArgs().save_every == 500  # TRL's save_steps: a crash keeps work by default
    out = str(tmp_path / "run")
    flags = [*FAST, "--save-every", "2", "--warmup-ratio", "0.5", "--output-dir", out]
    script.main(plumbing.cli(script.Args, [*flags, "--max-steps", "3"]))
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2", "3"]  # 3: the last step
    with open(os.path.join(out, "args.json")) as f:
        first = json.load(f)
    assert first["script"] == "sft" and first["max_steps"] == 3
    assert (
        first["num_warmup_steps"] == 2 and first["warmup_steps"] == 0
    )  # ceil(0.5 × 3) resolved; the flag as given
    before = snapshot(out)
    line = usage_error(
        script, *flags, "--max-steps", "5", "--learning-rate", "1e-3", "--batch-size", "16", "--resume"
    )
    assert (
        "is another run" in line
        and "--learning-rate 2e-05 -> 0.001" in line
        and "--batch-size 8 -> 16" in line
    )
    assert "--max-steps" not in line.split("(")[0]  # it may change
    line = usage_error(dpo, "--model", "tiny", "--max-steps", "5", "--output-dir", out, "--resume")
    assert "the script 'sft' -> 'dpo'" in line  # not "this run is complete"
    assert snapshot(out) == before

    script.main(
        plumbing.cli(
            script.Args,
            [*flags, "--max-steps", "5", "--resume", "--log-every", "1", "--save-total-limit", "0"],
        )
    )
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2", "3", "4", "5"]  # 0: every one kept
    from helpers import metrics

    assert [r["step"] for r in metrics(out)] == [2, 3, 4, 5]  # from step 3's state: log-every 2, then 1
    with open(os.path.join(out, "args.json")) as f:
        record = json.load(f)
    assert {k: v for k, v in record.items() if k != "resumes"} == first
    (resumed,) = record["resumes"]
    assert resumed["resumed_at_step"] == 3 and resumed["max_steps"] == 5 and resumed["log_every"] == 1
    assert (
        first["schedule_steps"] == resumed["schedule_steps"] == 3
    )  # the schedule the run was built on, kept
    rate = {r["step"]: r["charts/learning_rate"] for r in metrics(out)}
    assert (
        rate[3] == rate[4] == rate[5] == pytest.approx(2e-5)
    )  # the last update's, held (spread over 5: 1e-5)

    shutil.rmtree(os.path.join(out, "checkpoints", "5"))  # as a run saved before its last step
    before = snapshot(out)
    line = usage_error(script, *flags, "--max-steps", "7", "--resume")
    assert "newest checkpoint" in line and "(step 4) is older than its finished model/ (step 5)" in line
    assert f"start a new run from --model {out}/model" in line
    assert snapshot(out) == before


def test_an_extended_run_keeps_its_schedule_unless_asked(tmp_path, capsys):
    """--resume --max-steps 80 on a finished 60-step run (its outputs as Run finds them; no model, no step):
    the schedule still spans 60 steps, and says so; --resume-schedule stretch spreads it over 80."""
    import plumbing
    import sft

    out = tmp_path / "run"
    run = plumbing.Run("sft", plumbing.cli(sft.Args, [*FAST, "--max-steps", "60", "--output-dir", str(out)]))
    assert run.resolve_max_steps(100) == 60 and run.schedule_steps == 60
    (out / "checkpoints" / "60").mkdir(parents=True)
    (out / "model").mkdir()
    (out / "args.json").write_text(json.dumps(run._record(), default=str))
    for how, spans in (("keep", 60), ("stretch", 80)):
        flags = [*FAST, "--max-steps", "80", "--output-dir", str(out), "--resume", "--resume-schedule", how]
        run = plumbing.Run("sft", plumbing.cli(sft.Args, flags))
        assert run.resolve_max_steps(100) == 80 and run.schedule_steps == spans
    assert (
        capsys.readouterr().out.count(
            "the learning-rate schedule stays the run's, over 60 steps, then its "
            "last rate (--resume-schedule stretch: over all steps"
        )
        == 1
    )


@pytest.mark.parametrize("script", [s.removesuffix(".py") for s in SCRIPTS])
def test_every_trl_flag_hint_names_a_flag_the_script_takes(script):
    """Each TRL name, typed as TRL spells it, to each script: the hint names one of that script's own flags,
    or says it has no counterpart there, never a flag the script would then refuse (cli's hint for one,
    parsed; check_options, what cli calls, for every name)."""
    import importlib
    import plumbing

    args_class = importlib.import_module(script).Args
    ours = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(args_class)}
    for trl in plumbing.TRL_FLAGS:
        typed = "--" + trl.replace("-", "_")
        if typed.replace("_", "-") in ours:
            continue  # the script has TRL's flag itself (evaluate.py's --max-new-tokens)
        with pytest.raises(plumbing.UsageError) as e:
            plumbing.check_options([typed, "1"], ours, f"{script}.py")
        hint = str(e.value).removeprefix(f"Unrecognized options: {typed}; ")
        named = re.match(rf"{typed} is (--[a-z-]+)", hint)
        assert (
            (named and named[1] in ours)
            or hint == f"{typed} has no counterpart in {script}.py (see --help)"
            or hint.startswith(f"{typed} is absent")
        ), (script, hint)
    with pytest.raises(plumbing.UsageError) as e:
        plumbing.cli(args_class, ["--logging_steps", "5"])
    assert str(e.value).startswith("Unrecognized options: --logging_steps; --logging_steps ")
    if "--log-every" in ours:
        assert plumbing.cli(args_class, ["--log-every", "5"]).log_every == 5


def test_the_last_line_is_not_glued_to_the_progress_bar():
    """An error (or the preemption line) ending a run mid-loop starts a line of its own: the bar, drawn with
    no newline, is closed first; eval lines go above the bar (tqdm.write, as Run.log_eval writes them)."""
    code = (
        "import sys, tqdm, plumbing; bar = tqdm.tqdm(total=3, desc='sft'); bar.update(1); "
        "tqdm.tqdm.write('step 1: eval/loss 1.0', sys.stderr); plumbing._end(2, 'error: bad', sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = proc.stderr.replace("\r", "\n").splitlines()
    assert proc.returncode == 2 and lines[-1] == "error: bad" and "step 1: eval/loss 1.0" in lines
    assert lines[-2].startswith("sft:  33%")  # the bar, closed where it stood


def test_an_unknown_option_is_answered_before_the_heavy_imports(tmp_path):
    """A parse error of an option the script does not have is answered from its source, as --help is: with
    a `jax` that cannot be imported first on the path, the one line (TRL's name, or the closest flag) still
    comes, exit 2 (tyro's own answer came after 3 s of imports)."""
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text("raise ImportError('jax imported')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    for script, flags, line in (
        (
            "grpo.py",
            ["--logging_steps", "5"],
            "error: Unrecognized options: --logging_steps; --logging_steps "
            "has no counterpart in grpo.py (see --help)",
        ),
        (
            "sft.py",
            ["--logging_steps=5", "--max-steps", "3"],
            "error: Unrecognized options: --logging_steps; --logging_steps is --log-every here",
        ),
        (
            "dpo.py",
            ["--learning-rat", "1e-5"],
            "error: Unrecognized options: --learning-rat; perhaps you meant --learning-rate",
        ),
    ):
        proc = subprocess.run(
            [sys.executable, os.path.join(ROOT, script), *flags],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (2, line, ""), script


def test_flags_as_trl_names_them_and_the_toy_task_are_answered(tmp_path):
    """TRL's own flag names get this project's in the one line, a typo tyro's guess; a model other than
    `tiny` (or one trained from it) is refused the bundled toy data and reward unless they are given."""
    import dpo
    import evaluate
    import grpo
    import plumbing

    with pytest.raises(plumbing.UsageError, match="--num-train-epochs is --num-epochs here"):
        plumbing.cli(dpo.Args, ["--num-train-epochs", "1"])
    with pytest.raises(plumbing.UsageError, match="--per-device-train-batch-size is --batch-size"):
        plumbing.cli(grpo.Args, ["--per-device-train-batch-size=4"])
    with pytest.raises(plumbing.UsageError, match="--max_completion_length is --response-length here"):
        plumbing.cli(grpo.Args, ["--max_completion_length", "64"])  # TRL's own spelling, with _
    assert (
        plumbing.cli(dpo.Args, ["--learning_rate", "1e-5", "--lr_scheduler_type", "cosine"]).learning_rate
        == 1e-5
    )
    with pytest.raises(plumbing.UsageError, match="perhaps you meant --learning-rate"):
        plumbing.cli(dpo.Args, ["--learning-rat", "1e-5"])
    with pytest.raises(
        plumbing.UsageError,
        match=r"gemma_2b would use the bundled toy task \(data/\): pass "
        r"--dataset DATA; DATA: a .jsonl",
    ):
        plumbing.cli(dpo.Args, ["--model", "gemma_2b"])
    with pytest.raises(plumbing.UsageError, match="toy task .*: pass --reward-fn path.py:function$"):
        plumbing.cli(grpo.Args, ["--model", "gemma2_2b_it", "--dataset", "my_gsm8k.jsonl"])  # no DATA clause
    with pytest.raises(plumbing.UsageError, match="toy task .*: pass --prompts DATA, --reward-fn"):
        plumbing.cli(evaluate.Args, ["--model", "qwen3_8b"])
    with pytest.raises(plumbing.UsageError, match="unknown --model 'gemma_3b_typo'"):
        plumbing.cli(dpo.Args, ["--model", "gemma_3b_typo"])
    with pytest.raises(
        plumbing.UsageError,
        match=r"^--model google/gemma-3-1b-it: no such folder \(the nearest that exists: .*\); as a Hugging "
        "Face Hub repo id it is --model hf://google/gemma-3-1b-it$",
    ):
        plumbing.cli(grpo.Args, ["--model", "google/gemma-3-1b-it"])  # TRL's form: the hub id, bare
    assert plumbing.cli(grpo.Args, ["--model", "gemma_2b", "--dataset", "x.jsonl", "--reward-model", "rm"])
    assert (
        plumbing.cli(
            dpo.Args, ["--model", "gemma_2b", "--dataset", "data/prefs_train.jsonl", "--eval-dataset", ""]
        ).eval_dataset
        == ""
    )
    trained = (
        tmp_path / "model" / "assets" / "tokenizer"
    )  # a model/ trained from tiny: the toy task is its own
    trained.mkdir(parents=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    shutil.copy(os.path.join(ROOT, "data", "tiny_tokenizer.model"), trained / "vocabulary.spm")
    assert plumbing.cli(dpo.Args, ["--model", str(tmp_path / "model")]).dataset == dpo.Args().dataset


def test_a_run_is_named_by_its_scripts_file(tmp_path, monkeypatch):
    """Run(__file__, ...): the script's file names the run (a fork's its own: args.json's `script`, the progress
    bar), and without --output-dir it goes to runs/<file's stem>__<model>__<seed>__<time>, under the folder
    the command runs in."""
    import plumbing
    import sft

    monkeypatch.chdir(tmp_path)
    run = plumbing.Run(os.path.join(ROOT, "forks", "mysft.py"), sft.Args(seed=3))
    assert run.script == "mysft" and run.dir.startswith(os.path.join("runs", "mysft__tiny__3__")), run.dir


def test_resume_takes_the_runs_flags_from_args_json(tmp_path, capsys):
    """`--resume --output-dir DIR` alone: the run's own flags (args.json) are the defaults, so it needs nothing
    else (as TRL's resume_from_checkpoint); a flag given beside them is named in one line with the value it
    replaces; --remat is not taken (args.json holds the mode a run chose). Without a run there: the script's
    own defaults, and no such line."""
    import plumbing
    import sft

    out = tmp_path / "run"
    out.mkdir()
    recorded = {"script": "sft", "model": "tiny", "batch_size": 16, "learning_rate": 1e-3, "max_steps": 3}
    (out / "args.json").write_text(json.dumps({**recorded, "remat": "off/2", "dataset": "mine.jsonl"}))
    args = plumbing.cli(sft.Args, ["--resume", "--output-dir", str(out), "--max-steps", "5"])
    assert (args.batch_size, args.learning_rate, args.max_steps, args.dataset) == (16, 1e-3, 5, "mine.jsonl")
    assert args.remat == "auto" and args.resume
    assert capsys.readouterr().out.splitlines() == [
        f"--resume: the run's flags from {out}/args.json; changed here: --max-steps 5 (was 3)"
    ]
    args = plumbing.cli(sft.Args, ["--resume", "--output-dir", str(tmp_path / "none")])
    assert args.batch_size == sft.Args().batch_size and capsys.readouterr().out == ""
