"""Faults a real run meets: SIGKILL (resume must end exactly where an uninterrupted
run ends), SIGTERM (preemption: checkpoint and exit 0), an occupied --output-dir,
a non-finite loss, and a run split over two processes."""

import os
import signal
import subprocess
import sys

import pytest

from helpers import (
    ROOT,
    assert_same_rows,
    env_with_devices,
    metrics,
    run_two_processes,
    usage_error,
    wait_for,
)

FAST = [
    "--model",
    "tiny",
    "--batch-size",
    "16",
    "--log-every",
    "5",
    "--eval-dataset",
    "",
    "--num-samples",
    "0",
    "--seed",
    "3",
]


def cmd(script, *args):
    return [sys.executable, os.path.join(ROOT, script), *FAST, *args]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """20 steps, written with --overwrite over a stale run's metrics.jsonl (a step-99 row): the refusal of
    an occupied dir and the overwrite are checked on this run, not on one of their own
    (test_occupied_output_dir_is_refused_then_overwritten)."""
    out = str(tmp_path_factory.mktemp("rel") / "clean")
    os.makedirs(out)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write('{"step": 99}\n')
    subprocess.run(
        cmd("sft.py", "--max-steps", "20", "--save-every", "5", "--output-dir", out, "--overwrite"),
        check=True,
        capture_output=True,
        env=env_with_devices(1),
    )
    return out


def test_sigkill_then_resume_equals_uninterrupted(uninterrupted, tmp_path):
    out = str(tmp_path / "killed")
    args = cmd("sft.py", "--max-steps", "20", "--save-every", "5", "--output-dir", out)
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env_with_devices(1)
    )
    wait_for(os.path.join(out, "checkpoints", "10"), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_on_disk = sorted(int(s) for s in os.listdir(os.path.join(out, "checkpoints")) if s.isdigit())
    assert steps_on_disk and steps_on_disk[-1] < 20
    done = subprocess.run(args + ["--resume"], capture_output=True, text=True, env=env_with_devices(1))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from step {steps_on_disk[-1]}" in done.stdout
    # Same data order, same losses, no duplicated or missing rows.
    assert_same_rows(metrics(uninterrupted), metrics(out))
    assert sorted(os.listdir(os.path.join(uninterrupted, "checkpoints")), key=int) == [
        "10",
        "15",
        "20",
    ]  # 3 kept


def test_sigterm_checkpoints_and_exits_0(tmp_path):
    out = str(tmp_path / "preempted")
    proc = subprocess.Popen(
        cmd("sft.py", "--max-steps", "1000", "--output-dir", out),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env_with_devices(1),
    )
    wait_for(os.path.join(out, "args.json"), proc)  # written once the first step has run
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    line = [s for s in stdout.splitlines() if s.startswith("SIGTERM: checkpoint saved")]
    assert line and line[0].endswith(
        f"; continue with: python {os.path.join(ROOT, 'sft.py')} --resume --output-dir {out}"
    )
    step = int(line[0].split("step ")[1].split(";")[0])
    assert os.listdir(os.path.join(out, "checkpoints")) == [str(step)]
    assert metrics(out)[-1]["step"] == step  # the partial interval is logged, not lost


def test_occupied_output_dir_is_refused_then_overwritten(uninterrupted):
    import sft  # in-process: the exit-2 line itself is test_lifecycle.py's test_occupied_dir_exits_2_in_one_line

    before = open(os.path.join(uninterrupted, "metrics.jsonl")).read()
    assert "already holds" in usage_error(
        sft, *cmd("sft.py", "--max-steps", "5", "--output-dir", uninterrupted)[2:]
    )
    assert open(os.path.join(uninterrupted, "metrics.jsonl")).read() == before  # untouched
    # --overwrite (the fixture's run, over a stale step-99 row): the old rows are gone, the new run's alone
    assert [r["step"] for r in metrics(uninterrupted)] == [5, 10, 15, 20]


def test_nonfinite_loss_stops_naming_the_step_or_is_skipped(tmp_path):
    out = str(tmp_path / "nan")
    proc = subprocess.run(
        cmd(
            "sft.py",
            "--max-steps",
            "10",
            "--save-every",
            "1",
            "--learning-rate",
            "1e30",
            "--warmup-steps",
            "1",
            "--output-dir",
            out,
        ),
        capture_output=True,
        text=True,
        env=env_with_devices(1),
    )
    assert proc.returncode == 1 and "non-finite train/loss at step " in proc.stderr
    bad = int(proc.stderr.split("at step ")[1].split(";")[0])
    kept = sorted(int(s) for s in os.listdir(os.path.join(out, "checkpoints")))
    assert kept and kept[-1] == bad - 1  # the last good state is the newest checkpoint
    out = str(tmp_path / "skip")
    subprocess.run(
        cmd(
            "sft.py",
            "--max-steps",
            "10",
            "--learning-rate",
            "1e30",
            "--warmup-steps",
            "1",
            "--skip-nonfinite",
            "--output-dir",
            out,
        ),
        check=True,
        capture_output=True,
        env=env_with_devices(1),
    )
    assert sum(r["train/skipped_nonfinite"] for r in metrics(out)) >= 1


def test_two_processes_match_one(tmp_path):
    """dpo.py with evaluation and --precompute-ref on 2 processes × 2 devices logs the rows of the same
    run on 1 process × 4 devices (each process still holds several devices; 8 simulated devices in a process
    cost more CPU time to compile and run): training, the reference pass and eval each give every process its
    own slice of a global batch (common.per_example passed the whole batch to each on 76cc5f6: rows
    off by up to 2.1×). 24 eval pairs at batch 16: the second batch wraps around and is trimmed."""
    # optimised code (not helpers.FAST_COMPILE): under it the reduction order differs more between the
    # layouts, and step 2's near-zero margins disagree beyond rel 1e-5
    for name, n in (("train", 48), ("eval", 24)):  # small files: each process tokenizes and precomputes all
        with open(os.path.join(ROOT, "data", f"prefs_{name}.jsonl")) as f:
            (tmp_path / f"{name}.jsonl").write_text("".join(f.readlines()[:n]))
    flags = [
        sys.executable,
        os.path.join(ROOT, "dpo.py"),
        "--model",
        "tiny",
        "--max-steps",
        "3",
        "--log-every",
        "1",
        "--batch-size",
        "16",
        "--learning-rate",
        "3e-4",
        "--max-length",
        "128",
        "--precompute-ref",
        "--dataset",
        str(tmp_path / "train.jsonl"),
        "--eval-dataset",
        str(tmp_path / "eval.jsonl"),
        "--eval-every",
        "3",
    ]
    one = str(tmp_path / "one")
    optimised = lambda n: env_with_devices(n, fast_compile=False)
    subprocess.run(flags + ["--output-dir", one], check=True, capture_output=True, env=optimised(4))
    two = str(tmp_path / "two")
    run_two_processes(flags, two, optimised(2))
    rows, rows_two = metrics(one), metrics(two)
    assert [r["step"] for r in rows if "eval/loss" in r] == [0, 3] and "rewards/margins" in rows[1]
    # Step 1 runs the initial policy, which is the reference: its rewards are float noise around 0
    # (±1e-7; the accuracy of a tie is noise too). Every other value agrees to float32 reduction order.
    for row in (rows[1], rows_two[1]):
        noise = {k: row.pop(k) for k in list(row) if k.startswith("rewards/")}
        assert all(abs(v) < 1e-6 for k, v in noise.items() if k != "rewards/accuracies"), noise
    # abs 1e-5: step 2's rewards/margins are near 0, sums of float32 terms reduced in another order on two
    # processes (measured 1e-6 apart), beyond any rel tolerance of so small a value
    assert_same_rows(rows, rows_two, rel=1e-5, abs=1e-5)
    assert os.path.exists(os.path.join(two, "model", "model.weights.h5"))  # gathered and saved by process 0


def test_two_processes_sft_with_eval_and_samples_exit_0(tmp_path):
    """sft.py with evaluation and its closing samples on 2 processes × 2 devices logs the rows of 1 process × 4,
    and both processes exit 0 (run_two_processes asserts it). Process 1 used to die with "the JAX distributed
    service detected fatal errors" once process 0 had ended and closed the coordination service, and it sampled
    from weights it no longer held whole (common.save_model kept the gathered copy on process 0 only)."""
    for name, n in (("train", 64), ("eval", 16)):
        with open(os.path.join(ROOT, "data", f"sft_{name}.jsonl")) as f:
            (tmp_path / f"{name}.jsonl").write_text("".join(f.readlines()[:n]))
    flags = [
        sys.executable,
        os.path.join(ROOT, "sft.py"),
        "--model",
        "tiny",
        "--max-steps",
        "3",
        "--log-every",
        "1",
        "--batch-size",
        "16",
        "--learning-rate",
        "3e-4",
        "--max-length",
        "64",
        "--eval-every",
        "2",
        "--num-samples",
        "2",
        "--dataset",
        str(tmp_path / "train.jsonl"),
        "--eval-dataset",
        str(tmp_path / "eval.jsonl"),
    ]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    subprocess.run(flags + ["--output-dir", one], check=True, capture_output=True, env=env_with_devices(4))
    run_two_processes(flags, two, env_with_devices(2))
    rows = metrics(one)
    assert [r["step"] for r in rows if "eval/loss" in r] == [0, 2, 3]
    assert_same_rows(rows, metrics(two))
    assert os.path.exists(os.path.join(two, "model", "model.weights.h5"))


@pytest.mark.parametrize(
    "content, where",
    [
        (
            '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n',
            "pairs.jsonl:2:",
        ),
        ('{"prompt": 7, "chosen": "b", "rejected": "c"}\n', "pairs.jsonl:1:"),
        ('{"prompt": "a", "chosen": "b", "rejected": "c"}\nnot json\n', "pairs.jsonl:2: invalid JSON"),
        ("", "pairs.jsonl: no examples"),
        ('{"prompt": "a", "chosen": "", "rejected": "c"}\n', "pairs.jsonl:1:"),
    ],
    ids=["missing-rejected", "non-string-prompt", "not-json", "empty-file", "empty-chosen"],
)
def test_malformed_preference_rows_are_refused(tmp_path, content, where):
    import dpo  # in this process (the exit-2 line itself: test_sft, test_preference)

    (tmp_path / "pairs.jsonl").write_text(content)
    out = str(tmp_path / "out")
    assert where in usage_error(
        dpo, "--model", "tiny", "--dataset", str(tmp_path / "pairs.jsonl"), "--output-dir", out
    )
    assert not os.path.exists(out)
