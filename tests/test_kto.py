"""kto.py beyond its loss (test_losses.py): TRL's unpaired rows and preference pairs unpaired, the
mismatched pairs, bad rows refused before any compute, one step with the reference precomputed and
accumulated == online, log rows that weight each step by its examples (plumbing.Run's `counted`), and
the script through its CLI on `tiny` with its docstring's values: it learns the toy task, and SIGTERM
then --resume logs the rows of the uninterrupted run."""

import json
import os
import shlex

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import common
import kto
from helpers import (
    ROOT,
    assert_same_rows,
    learning_env,
    metrics as read_metrics,
    preempt_then_resume,
    usage_error,
)

GEMMA = common.CHAT_TEMPLATES["gemma"]
EVAL = os.path.join(ROOT, "data", "kto_eval.jsonl")


# ---------------------------------------------------------------------------
# Data: rows, unpairing, mismatched pairs, refusals
# ---------------------------------------------------------------------------
def test_unpaired_rows_and_preference_pairs_unpaired_as_trl():
    row = {"prompt": "Sort: 2 1", "completion": " 1 2", "label": True}
    assert common.unpaired_example(row, "f:1", GEMMA) == ("Sort: 2 1", " 1 2", True)
    user = {"role": "user", "content": "Sort: 2 1"}
    chat = {"prompt": [user], "completion": [{"role": "assistant", "content": "2 1"}], "label": False}
    assert common.unpaired_example(chat, "f:1", GEMMA) == (  # as preference_triple renders a chat pair
        "<start_of_turn>user\nSort: 2 1<end_of_turn>\n<start_of_turn>model\n",
        "2 1<end_of_turn>",
        False,
    )
    # Preference pairs: every chosen (desirable), then every rejected, as TRL's unpair_preference_dataset;
    # the bundled kto_eval.jsonl is exactly that unpairing of prefs_eval.jsonl.
    pairs = kto.read_examples(os.path.join(ROOT, "data", "prefs_eval.jsonl"), GEMMA)
    assert pairs == kto.read_examples(EVAL, GEMMA)
    with open(os.path.join(ROOT, "data", "prefs_eval.jsonl")) as f:
        first = json.loads(f.readline())
    assert len(pairs) == 400 and sum(label for *_, label in pairs) == 200
    assert pairs[0] == (first["prompt"], first["chosen"], True) and pairs[200] == (
        first["prompt"],
        first["rejected"],
        False,
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (
            '{"prompt": "a", "completion": "b", "label": true}\n{"prompt": "a", "completion": "b"}\n',
            "bad.jsonl:2: missing field 'label'",
        ),
        (
            '{"prompt": "a", "completion": "b", "label": 1}\n',
            "bad.jsonl:1: field 'label' must be true or false, got 1",
        ),
        (
            '{"prompt": "a", "completion": "b", "label": "true"}\n',
            "bad.jsonl:1: field 'label' must be true or false",
        ),
        ('{"completion": "b", "label": true}\n', "bad.jsonl:1: missing field 'prompt'"),
        (
            '{"prompt": "a", "completion": " ", "label": false}\n',
            "bad.jsonl:1: field 'completion' must be a non-empty",
        ),
        (
            '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n',
            "bad.jsonl:2: missing field 'rejected'",
        ),
    ],
)
def test_bad_rows_are_refused_naming_file_and_line(tmp_path, content, message):
    """In this process: the UsageError main raises (exit 2 through the CLI) before the model loads."""
    (tmp_path / "bad.jsonl").write_text(content)
    out = tmp_path / "out"
    assert message in usage_error(kto, "--dataset", str(tmp_path / "bad.jsonl"), "--output-dir", str(out))
    assert not out.exists()


@pytest.fixture(scope="module")
def tokenizer():
    return common.keras_hub.models.GemmaTokenizer(proto=common.TINY_TOKENIZER)


def test_mismatched_pairs_and_truncation(tokenizer):
    """Each example's second sequence: its own prompt with another example's completion; the borrowing
    runs once through every example (TRL's rotation by one); a long prompt is cut the same for both."""
    examples = [(f"Sort: {i} {i + 1}", f" {i + 1}" * (1 + i % 3), i % 2 == 0) for i in range(7)]
    rows, counts = kto.tokenize_dataset(examples, tokenizer, 64, "f.jsonl", seed=3)
    assert counts == {"examples": 7, "desirable": 4, "undesirable": 3, "truncated": 0, "dropped": 0}
    ids = lambda text: [int(t) for t in tokenizer.tokenize(text)]
    bos, eos = tokenizer.start_token_id, tokenizer.end_token_id
    lender = []  # lender[i]: the example whose completion example i's mismatched pair borrows
    for i, ((own, mismatched), label) in enumerate(rows):
        prompt, completion = ids(examples[i][0]), ids(examples[i][1])
        assert label == examples[i][2] and own[0].tolist() == [bos, *prompt, *completion, eos]
        assert own[1].tolist() == [False] * (1 + len(prompt)) + [True] * (len(completion) + 1)
        assert mismatched[0][: 1 + len(prompt)].tolist() == [bos, *prompt] and mismatched[0][-1] == eos
        lender.append([ids(e[1]) for e in examples].index(mismatched[0][1 + len(prompt) : -1].tolist()))
        assert mismatched[1].sum() == len(ids(examples[lender[i]][1])) + 1  # its completion + EOS
    assert sorted(lender) == list(range(7)) and all(lender[i] != i for i in range(7))
    i, cycle = 0, []  # one cycle through all seven
    while i not in cycle:
        cycle.append(i)
        i = lender[i]
    assert len(cycle) == 7
    # --loss-type apo_zero_unpaired: no mismatched pairs
    assert all(len(seqs) == 1 for seqs, _ in kto.tokenize_dataset(examples, tokenizer, 64, "f", 3, False)[0])
    long = [("Sort: 2 1 " * 20, " 1 2", True), ("Sort: 3", " 3 3 3", False)]
    rows, counts = kto.tokenize_dataset(long, tokenizer, 16, "f.jsonl", seed=0)
    assert counts["truncated"] == 1 and len(rows[0][0][0][0]) <= 16 and len(rows[0][0][1][0]) <= 16
    assert (
        rows[0][0][0][0][:-4].tolist() == rows[0][0][1][0][: len(rows[0][0][0][0]) - 4].tolist()
    )  # same cut
    with pytest.raises(common.UsageError, match="f.jsonl: every example is longer than --max-length 3"):
        kto.tokenize_dataset(long, tokenizer, 3, "f.jsonl", seed=0)


# ---------------------------------------------------------------------------
# One step, in process (tiny with LoRA rank 4 on 8 simulated devices: `prefs` in conftest.py)
# ---------------------------------------------------------------------------
def test_step_precomputed_and_accumulated_equals_online(prefs):
    """One update with an online reference on 16 examples == one with precomputed reference log-probs
    (the mismatched pairs' too) over 2 micro-batches of 8, the first all desirable, the second all
    undesirable: z₀ is the whole batch's and the metrics are the whole batch's, not per micro-batch."""
    import optax

    _, model, _ = prefs
    backbone = model.backbone
    examples = kto.read_examples(EVAL, GEMMA)
    rows, _ = kto.tokenize_dataset(
        examples[:8] + examples[200:208], model.preprocessor.tokenizer, 512, EVAL, 0
    )
    data = kto.pad_examples(rows, 32)
    params, frozen = common.split_variables(backbone)
    rng = np.random.default_rng(1)  # the reference: a LoRA perturbation of the base, which is the policy
    ref = [
        p + 0.3 * rng.standard_normal(p.shape).astype(np.float32) if v.path.endswith("lora_kernel_b") else p
        for v, p in zip(backbone.trainable_variables, params)
    ]
    optimizer, args = optax.sgd(0.1), kto.Args(beta=0.5, desirable_weight=1.5)
    step = jax.jit(lambda s, f, b, r: kto.train_step(backbone, optimizer, args, s, f, b, r))
    (online, _), m1 = step(
        (params, optimizer.init(params)), frozen, {k: v[None] for k, v in data.items()}, ref
    )
    ref_logps = jax.jit(lambda p, f, b: kto.concatenated_forward(backbone, p, f, b))(ref, frozen, data)
    pre = {**data, "ref_completion_logps": np.asarray(ref_logps[0]), "ref_KL_logps": np.asarray(ref_logps[1])}
    pre = {k: v.reshape(2, 8, *v.shape[1:]) for k, v in pre.items()}  # [A=2, 8, ...]
    (accumulated, _), m2 = step((params, optimizer.init(params)), frozen, pre, None)
    assert float(m1["kl"]) > 0 and float(m1["rewards/margins"]) != 0 and float(m1["train/grad_norm"]) > 0
    assert float(m1["count/chosen"]) == 8 and float(m1["count/rejected"]) == 8
    for k in m1:
        assert float(m2[k]) == pytest.approx(float(m1[k]), rel=1e-4, abs=1e-6), k
    for a, b in zip(online, accumulated):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert any(np.abs(np.asarray(a) - np.asarray(p)).max() > 1e-4 for a, p in zip(online, params))  # it moved


def test_log_rows_weight_each_step_by_its_examples(tmp_path):
    """Three steps in one --log-every interval: only desirable examples, a mix, only undesirable. The row's
    rewards/chosen is the mean over the interval's desirable examples (a plain mean of the steps would
    count the last step's 0); its margin weights each step by its desirable × undesirable pairs."""
    import plumbing

    labels = [[True] * 3, [True, False, False], [False] * 2]
    rng = np.random.default_rng(0)
    logps = [rng.uniform(-30, -5, len(x)) for x in labels]
    rewards = [rng.uniform(-3, 3, len(x)) for x in labels]  # r = logps − ref_logps
    batches = [
        kto.kto_loss(jnp.array(lp), jnp.array(lp - r), jnp.zeros(2), jnp.zeros(2), jnp.array(y), beta=0.5)[1]
        for lp, r, y in zip(logps, rewards, labels)
    ]
    run = plumbing.Run("kto", kto.Args(max_steps=3, output_dir=str(tmp_path)), log_every=3)
    for step in run.steps(counted=kto.COUNTED):
        run.log({"train/loss": jnp.float32(0.5), **batches[step]})
    run.close()
    (row,) = read_metrics(tmp_path)
    r, y, lp = (np.concatenate(x) for x in (rewards, labels, logps))
    assert row["rewards/chosen"] == pytest.approx(0.5 * r[y].mean(), rel=1e-5)
    assert row["rewards/rejected"] == pytest.approx(0.5 * r[~y].mean(), rel=1e-5)
    assert row["logps/chosen"] == pytest.approx(lp[y].mean(), rel=1e-5)
    assert row["rewards/margins"] == pytest.approx(
        float(batches[1]["rewards/margins"]), rel=1e-5
    )  # 1 × 2 pairs
    assert row["count/chosen"] == pytest.approx(4 / 3)  # a plain mean: examples a step


# ---------------------------------------------------------------------------
# Through the CLI: the docstring's tiny command learns; SIGTERM then --resume equals the clean run
# ---------------------------------------------------------------------------
def docstring_flags(steps):
    """The `tiny` command of kto.py's docstring, with --max-steps `steps`."""
    flags = shlex.split(
        kto.__doc__.split("python kto.py --model tiny")[1].split('"""')[0].replace("\\\n", " ")
    )
    flags[flags.index("--max-steps") + 1] = str(steps)
    return ["--model", "tiny", *flags]


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """20 of the docstring command's 40 steps, every step logged, evaluated at 0 and 20; beside it the
    same run stopped by SIGTERM after its step-10 checkpoint and resumed."""
    tmp_path = tmp_path_factory.mktemp("kto")
    flags = docstring_flags(20) + ["--log-every", "1", "--eval-every", "20", "--save-every", "10"]
    return tmp_path / "clean", preempt_then_resume("kto.py", flags, 10, tmp_path, env=learning_env())


def test_learns_the_toy_task(learned):
    """Held-out: the implicit reward of correct sorts rises above that of wrong ones (eval/rewards/margins)
    and the loss falls; the first step's metrics are the initial model's (policy == reference)."""
    out, (rows, _, _, _) = learned
    evals = [r for r in rows if "eval/loss" in r]
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in evals] == [0, 20] and [r["step"] for r in train] == list(range(1, 21))
    before, after = evals
    assert before["eval/loss"] == pytest.approx(0.5, abs=1e-6) and before["eval/rewards/margins"] == 0.0
    assert after["eval/rewards/margins"] > 0.1, (before, after)  # 0.19 measured
    assert after["eval/loss"] < before["eval/loss"] - 0.01
    assert train[0]["train/loss"] == pytest.approx(0.5, abs=1e-5) and train[0]["kl"] == 0.0
    early, late = (np.mean([r["rewards/margins"] for r in train[i : i + 10]]) for i in (0, 10))
    assert late > early, (early, late)


def test_outputs(learned):
    out, (_, _, _, stdout) = learned
    assert {"args.json", "metrics.jsonl", "model"} <= set(os.listdir(out))
    with open(os.path.join(out, "args.json")) as f:
        assert json.load(f)["loss_type"] == "kto"
    rows = read_metrics(out)
    names = {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "kl",
        "count/chosen",
        "count/rejected",
    }
    assert names | {"train/loss", "charts/learning_rate", "charts/tokens_per_sec", "charts/mfu"} <= set(
        rows[-2]
    )
    assert {f"eval/{k}" for k in names | {"loss"}} <= set(rows[-1]) and 0 < rows[-2]["charts/mfu"] <= 1
    assert "data: 8000 examples (4000 desirable, 4000 undesirable; 0 prompt-truncated" in stdout
    assert {"config.json", "model.weights.h5", "tokenizer.json"} <= set(os.listdir(out / "model"))


def test_sigterm_then_resume_equals_uninterrupted(learned):
    _, (clean, resumed, stopped, _) = learned
    assert 10 <= stopped < 20
    assert_same_rows(clean, resumed)
