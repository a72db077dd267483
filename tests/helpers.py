"""Utilities the test files share for running scripts as subprocesses and comparing their
metrics: a plain module (not a test file, no fixtures), imported as `from helpers import ...`
(conftest.py puts tests/ on sys.path). Test files import from here, never from each other."""

import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Measurements of the process, not of the run: they differ between two runs of the same steps (wall
# clock; compilations: a resumed process compiles afresh), so row comparisons drop them.
TIMING = (
    "charts/tokens_per_sec",
    "charts/mfu",
    "charts/generate_tokens_per_sec",
    "charts/generate_time",
    "charts/score_time",
    "charts/update_time",
    "charts/compilations",
)


# XLA:CPU flags that trade run speed for compile speed, which conftest.py sets for the test process and
# every script it starts: most test runs are a few steps, and compiling is most of their time (dpo.py,
# 3 steps, 2 devices: 28 s -> 20 s). Steady-state steps run about 2.7x slower under them, so the runs of
# tens of steps that prove learning use learning_env() instead.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# The 8 simulated devices meet in a rendezvous at every collective; XLA:CPU aborts the process when one
# device's thread is over 40 s late, which a worker starved by the others on 2 cores can be ("Fatal Python
# error: Aborted", no test output). A late thread is slowness, not a bug, here: wait 10 min instead.
PATIENT_COLLECTIVES = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def env_with_devices(n, fast_compile=True):
    """The environment of a subprocess that sees `n` CPU devices instead of 8 simulated ones."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    flags = flags if fast_compile else flags.replace(FAST_COMPILE, "")
    env["XLA_FLAGS"] = " ".join(f"{flags} --xla_force_host_platform_device_count={n}".split())
    return env


def one_device_env():
    """The environment of a subprocess that sees one CPU device instead of 8 simulated ones."""
    return env_with_devices(1)


def learning_env():
    """One device, fully optimised code: for runs where steady-state speed outweighs compiling (the
    tens of steps that prove learning, compare.py's stages and evaluation, long evals). 8 simulated
    devices on 2 cores take 2.5x as long; the sharded path is tested elsewhere."""
    return env_with_devices(1, fast_compile=False)


def run_script(script, *flags, env=None, timeout=900):
    """`python <script> <flags>` from the repository root; -> the CompletedProcess (text output)."""
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, script), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def usage_error(module, *flags):
    """`module.main` (an imported script) on these command-line flags, in this process: the message
    of the UsageError it must raise before any compute. Through the CLI, plumbing.launch prints it
    as `error: <message>` and exits 2 (each failure class keeps one subprocess test of that)."""
    import plumbing

    with pytest.raises(plumbing.UsageError) as e:
        module.main(plumbing.cli(module.Args, list(flags)))
    return str(e.value)


def metrics(output_dir):
    """The rows of `<output_dir>/metrics.jsonl`."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def assert_same_rows(a, b, rel=1e-5, abs=1e-7):
    """Same steps, same keys, same values to `rel` or `abs` (timing metrics left out)."""
    a, b = without_timing(a), without_timing(b)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert rb[k] == pytest.approx(ra[k], rel=rel, abs=abs), (ra["step"], k)


def wait_for(path, proc, timeout=300):
    """Polls until `path` exists; fails if `proc` ends first or `timeout` seconds pass."""
    start = time.time()
    while not os.path.exists(path):
        assert proc.poll() is None, "run ended before reaching the point to interrupt it"
        assert time.time() - start < timeout
        time.sleep(0.2)


def run_two_processes(argv, output_dir, env, timeout=300):
    """`argv` on 2 processes (jax.distributed on localhost, a fresh coordinator port) writing `output_dir`;
    asserts both exit 0. A pair that times out is killed, reported as a warning with each process's stderr
    tail, and run once more from scratch: a hang was seen once (a 2-worker suite, 600 s; not reproduced in 9
    runs alone or beside the other two-process test). Wrong rows, an error or a second timeout still fail."""
    for attempt in (1, 2):
        address = coordinator_address()
        procs = [
            subprocess.Popen(
                argv
                + [
                    "--output-dir",
                    output_dir,
                    "--coordinator-address",
                    address,
                    "--num-processes",
                    "2",
                    "--process-id",
                    str(i),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for i in range(2)
        ]
        try:
            errs = [p.communicate(timeout=timeout)[1] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            tails = " | ".join(
                f"process {i}: {(p.communicate()[1] or '')[-1500:]}" for i, p in enumerate(procs)
            )
            if attempt == 2:
                pytest.fail(f"two processes timed out twice after {timeout} s; {tails}")
            warnings.warn(f"two processes timed out after {timeout} s; running them once more. {tails}")
            shutil.rmtree(output_dir, ignore_errors=True)
            continue
        for p, err in zip(procs, errs):
            assert p.returncode == 0, err[-3000:]
        return


def coordinator_address():
    """localhost:<a free port> for jax.distributed's coordinator."""
    port = socket.socket()
    port.bind(("localhost", 0))
    address = f"localhost:{port.getsockname()[1]}"
    port.close()
    return address


def preempt_then_resume(script, flags, first_checkpoint, tmp_path, env=None):
    """Runs `flags` uninterrupted and (concurrently) a copy that gets SIGTERM once checkpoint
    `first_checkpoint` exists, then resumes the copy with the command its message gives (`--resume --output-dir`
    alone: the run's flags come from its args.json); -> (clean rows, resumed rows, stop step, the clean run's
    stdout), the rows without timing metrics. The clean run is <tmp_path>/clean: other tests of the same
    flags check it too, instead of training their own."""
    clean, cut = str(tmp_path / "clean"), str(tmp_path / "cut")
    argv = lambda out: [sys.executable, os.path.join(ROOT, script), *flags, "--output-dir", out]
    env = env or one_device_env()
    runs = [
        subprocess.Popen(
            argv(out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for out in (clean, cut)
    ]
    start = time.time()
    while not os.path.exists(os.path.join(cut, "checkpoints", str(first_checkpoint))):
        assert runs[1].poll() is None, "run ended before it could be interrupted"
        assert time.time() - start < 600
        time.sleep(0.1)
    runs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=600) for p in runs]
    assert [p.returncode for p in runs] == [0, 0], outs[1][1][-2000:] + outs[0][1][-2000:]
    line = [s for s in outs[1][0].splitlines() if s.startswith("SIGTERM: checkpoint saved at step ")]
    command = f"continue with: python {os.path.join(ROOT, script)} --resume --output-dir {cut}"
    assert line and line[0].endswith(command), outs[1][0][-2000:]
    stopped = int(line[0].split("step ")[1].split(";")[0])
    assert not os.path.exists(os.path.join(cut, "model"))  # stopped early, nothing final written
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), "--resume", "--output-dir", cut],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resumed from step {stopped}" in res.stdout
    return without_timing(metrics(clean)), without_timing(metrics(cut)), stopped, outs[0][0]


# Texts an exported tokenizer.json must encode to the project's ids: ASCII, digits, runs of spaces, accents,
# CJK, an emoji, forms NFKC folds (ﬁ, full-width, circled), newlines, tabs, CRLF, each template's markers.
TOKENIZER_TEXTS = [
    "Sort: 3 1 2",
    "Sort",
    " 0 1 2 6 6 9",
    "digits 0123456789 and 3.14159, 42!",
    "  two  spaces, leading and trailing  ",
    "naïve café, Ünïcödé — 日本語 🙂",
    "ﬁne Ｆｕｌｌ ①",
    "line one\nline two\n\n\ttab\r\nend\n",
    "<start_of_turn>user\nSort: 2 1<end_of_turn>\n",
    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<|im_start|>user\nhi<|im_end|>\n",
    "[INST] hi [/INST]ok",
    "<|turn>model\n<|channel>thought\n<channel|>ok<turn|>\n",
    "",
]


def check_exported_tokenizer(hf_dir, tokenizer, template):
    """model_hf/ (--export-hf) serves as trained: its tokenizer.json, read by the `tokenizers` library alone,
    gives `tokenizer`'s (KerasHub's) ids and text for TOKENIZER_TEXTS, adding the scripts' start token;
    tokenizer_config.json names that token and carries the Jinja of the chat template `template` (a
    common.CHAT_TEMPLATES name); every file has the ordinary mode (0644 under umask 022)."""
    import interop
    from tokenizers import Tokenizer

    exported = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    for text in TOKENIZER_TEXTS:
        ids = [int(i) for i in tokenizer.tokenize(text)]
        assert exported.encode(text, add_special_tokens=False).ids == ids, text
        assert exported.encode(text).ids == [tokenizer.start_token_id] + ids, text
        text_back = tokenizer.detokenize(ids) if ids else ""
        assert exported.decode(ids, skip_special_tokens=False) == text_back, text
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        config = json.load(f)
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # not a class that rebuilds tokenizer.json
    assert config["bos_token"] == tokenizer.id_to_token(tokenizer.start_token_id)
    assert config["chat_template"] == interop.HF_CHAT_TEMPLATES[template]
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(hf_dir):
        assert os.stat(os.path.join(hf_dir, name)).st_mode & 0o777 == 0o666 & ~umask, name


def short_delta_rule_chunks(size=8):
    """KerasHub's Qwen 3.5 gated delta rule in chunks of `size` tokens in this process, not its fixed 64. Its
    chunked form unrolls a Python loop over a chunk's rows and another over the chunks, so compiling costs
    grow with the chunk (test_families.py: one step of each script on Qwen 3.5, 62 CPU-s -> 27 s; eager ops
    in the cached-forward test, 38 s -> 16 s). The rule is the same at any size (its result too, up to
    rounding), and prompts of 9+ tokens then span several chunks, the state carried between them included.
    Call it after `common` is imported (keras_hub before common pulls TensorFlow in)."""
    from keras_hub.src.models.qwen3_5 import qwen3_5_gated_delta_net as net

    rule = getattr(net._chunk_gated_delta_rule, "func", net._chunk_gated_delta_rule)  # idempotent
    net._chunk_gated_delta_rule = functools.partial(rule, chunk_size=size)


# Tokenizers of each kind, built offline from the toy data (test_families.py, test_moe.py)
def corpus():
    """The toy texts (prompts, completions) and every chat template's words: what the tokenizers learn."""
    lines = []
    for name in ("sft_train.jsonl", "sft_eval.jsonl"):
        with open(os.path.join(ROOT, "data", name)) as f:
            lines += [t for row in map(json.loads, f) for t in (row["prompt"], row["completion"])]
    return lines + ["user model assistant system INST Sort: the quick brown fox"] * 20


def byte_bpe(specials):
    """(vocabulary, merges) of a byte-level BPE (as Llama 3's and Qwen's tokenizer.json) whose
    special tokens are `specials`, each one id."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        corpus(),
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    merges = json.loads(tok.to_str())["model"]["merges"]
    return tok.get_vocab(), [m if isinstance(m, str) else " ".join(m) for m in merges]
