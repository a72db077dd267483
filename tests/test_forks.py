"""Forking a script, the two ways the README shows: copying the file, and subclassing its `Args` in a file of
your own that opens as the scripts do (plumbing.answer_help, then plumbing.launch). --help lists every flag,
inherited and new; a run with both kinds starts and records them; an option no field names is refused in one
line (exit 2) before the heavy imports; a dataclass written from scratch works too; and benchmarks/step_ab.py,
itself a subclass of throughput.py's Args, runs from its docstring's command."""

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import plumbing  # noqa: E402  (light: no JAX)
from helpers import FAST_COMPILE  # noqa: E402


def readme_fork():
    """The subclassing example of the README's "Forking a script", verbatim."""
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("## Forking a script")[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


SCRATCH_FORK = '''"""A script whose Args is a dataclass of its own."""
from dataclasses import dataclass

import plumbing

plumbing.answer_help(__name__, __file__)


@dataclass
class Args:
    steps: int = 3
    """how many steps"""
    name: str = "x"
    """a name"""


def main(args):
    print(f"steps {args.steps} name {args.name}")


if __name__ == "__main__":
    plumbing.launch(main, Args)
'''


def run(args, cwd, timeout=300):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = FAST_COMPILE  # one device: the fork's run is about its flags (one step: compiled fast)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )


def flags_of(args_class):
    return {"--" + f.name.replace("_", "-") for f in dataclasses.fields(args_class)}


TINY_RUN = [
    "--model",
    "tiny",
    "--max-steps",
    "1",
    "--batch-size",
    "8",
    "--max-length",
    "64",
    "--eval-dataset",
    "",
]


def first_loss(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return json.loads(f.readline())["train/loss"]


def test_a_subclassed_args_and_a_copied_script(tmp_path):
    """The README's fork: --help lists sft's flags and --my-bonus in its own section, a misspelt flag gets a
    hint, and a run records the new flag and trains with it (the first logged loss, the pre-update forward's,
    is 1.5 × the plain script's: a copy of sft.py run alongside, whose --help is sft's)."""
    import sft

    (tmp_path / "mysft.py").write_text(readme_fork())
    shutil.copy(os.path.join(ROOT, "sft.py"), tmp_path / "mycopy.py")
    out = run(["mysft.py", "--help"], tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    listed = set(re.findall(r"^  (--[\w-]+)", out.stdout, re.M))
    assert listed == flags_of(sft.Args) | {"--my-bonus"}, listed ^ (flags_of(sft.Args) | {"--my-bonus"})
    assert "a new coefficient of this fork" in out.stdout and "my idea:" in out.stdout
    bad = run(["mysft.py", "--my-bonsu", "1"], tmp_path, timeout=60)
    assert bad.returncode == 2 and "perhaps you meant --my-bonus" in bad.stderr, bad.stderr
    out = run(["mycopy.py", "--help"], tmp_path, timeout=60)
    assert out.returncode == 0 and set(re.findall(r"^  (--[\w-]+)", out.stdout, re.M)) == flags_of(sft.Args)
    out = run(
        ["mysft.py", *TINY_RUN, "--my-bonus", "0.5", "--output-dir", "fork", "--num-samples", "0"], tmp_path
    )
    assert out.returncode == 0, out.stderr[-2000:]
    recorded = json.loads((tmp_path / "fork" / "args.json").read_text())
    assert recorded["my_bonus"] == 0.5 and recorded["max_steps"] == 1
    out = run(["mycopy.py", *TINY_RUN, "--output-dir", "copy", "--num-samples", "2"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    # no eval data: the closing samples come from training prompts, and say so
    first = json.loads(open(os.path.join(ROOT, "data", "sft_train.jsonl")).readline())["prompt"]
    mark = "sample (a training prompt: no eval data): "
    marked = [line[len(mark) :] for line in out.stdout.splitlines() if line.startswith(mark)]
    assert len(marked) == 2 and marked[0].startswith(repr(first) + " -> "), out.stdout
    assert first_loss(tmp_path / "fork") == pytest.approx(1.5 * first_loss(tmp_path / "copy"), rel=1e-6)


def test_a_dataclass_from_scratch(tmp_path):
    (tmp_path / "mine.py").write_text(SCRATCH_FORK)
    out = run(["mine.py", "--help"], tmp_path, timeout=60)
    assert out.returncode == 0
    assert set(re.findall(r"^  (--[\w-]+)", out.stdout, re.M)) == {"--steps", "--name"}
    out = run(["mine.py", "--steps", "5", "--name", "y"], tmp_path, timeout=60)
    assert out.returncode == 0 and "steps 5 name y" in out.stdout, out.stderr


def test_a_base_the_source_cannot_show_is_left_to_tyro(tmp_path):
    """A base imported under another name cannot be read from source: the fast path steps aside (no refusal of
    flags it cannot see), and tyro parses the real class."""
    (tmp_path / "alias.py").write_text(
        SCRATCH_FORK.replace("class Args:", "class Args(Base):").replace(
            "from dataclasses import dataclass\n",
            "from dataclasses import dataclass\n\nfrom sft import Args as Base\n",
        )
    )
    assert plumbing._fields(str(tmp_path / "alias.py"), "Args") is None
    out = run(["alias.py", "--steps", "4", "--model", "tiny"], tmp_path, timeout=120)
    assert out.returncode == 0 and "steps 4 name x" in out.stdout, out.stderr


def test_step_ab_runs_from_its_docstring_command():
    """benchmarks/step_ab.py (class Args(throughput.Args)) from the command in its docstring, at a smaller
    width and length, one timed round: both sides time, one JSON line last."""
    doc = open(os.path.join(ROOT, "benchmarks", "step_ab.py")).read().split('"""')[1]
    command = re.search(
        r"python (benchmarks/step_ab\.py .*?)\n(?!\s+--)", doc.replace("\\\n", ""), re.S
    ).group(1)
    argv = command.split()
    assert argv[:3] == ["benchmarks/step_ab.py", "--algo", "dpo"], argv
    small = {
        "--arch": "hidden_dim=64,vocabulary_size=512,intermediate_dim=128,head_dim=16",
        "--max-length": "32",
    }
    argv = [small.get(argv[i - 1], a) for i, a in enumerate(argv)]
    out = run([*argv, "--steps", "1", "--warmup", "1", "--num-layers", "1"], ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row, out.stdout


# A copy's own term, added where a fork adds one: around the one loss function that the training step and the
# evaluation both call (compute_loss), placed before the copy's `if __name__ == "__main__":` line
NEW_TERM = '''
_dpo_loss_of_the_original = compute_loss


def compute_loss(logps, args, num_chosen_tokens):
    """The original loss + 0.05 × the mean chosen NLL (a fork's idea)."""
    loss, metrics = _dpo_loss_of_the_original(logps, args, num_chosen_tokens)
    return loss + 0.05 * logps["nll"].mean(), metrics


'''


def test_a_copy_that_adds_a_loss_term_evaluates_with_it_and_names_itself(tmp_path):
    """dpo.py copied to mydpo.py with a term added to its loss: at step 0 (policy == reference) dpo.py's eval/loss
    is ln 2 and the copy's is ln 2 + the term, which it trains with too (train/loss of the first batch, the
    pre-update forward's); the copy's args.json, progress bar and summary call it mydpo, not dpo."""
    source = open(os.path.join(ROOT, "dpo.py")).read()
    guard = 'if __name__ == "__main__":'
    (tmp_path / "mydpo.py").write_text(source.replace(guard, NEW_TERM.lstrip() + guard))
    shutil.copy(os.path.join(ROOT, "dpo.py"), tmp_path / "dpo.py")
    flags = ["--model", "tiny", "--max-steps", "1", "--batch-size", "8", "--max-length", "64"]
    rows = {}
    for script in ("dpo", "mydpo"):
        out = run([f"{script}.py", *flags, "--output-dir", script, "--log-every", "1"], tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        with open(tmp_path / script / "metrics.jsonl") as f:
            rows[script] = [json.loads(line) for line in f]
        assert json.loads((tmp_path / script / "args.json").read_text())["script"] == script
        assert f"{script}: 100%" in out.stderr and f"outputs in {script}" in out.stdout
    plain, fork = ({r["step"]: r for r in rows[s] if "eval/loss" in r} for s in ("dpo", "mydpo"))
    assert plain[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert fork[0]["eval/loss"] > plain[0]["eval/loss"] + 0.05  # the chosen NLL is several nats a pair
    assert fork[0]["eval/nll_loss"] == pytest.approx(plain[0]["eval/nll_loss"], rel=1e-6)  # the same model
    first = [next(r for r in rows[s] if "train/loss" in r) for s in ("dpo", "mydpo")]
    assert first[1]["train/loss"] > first[0]["train/loss"] + 0.05
