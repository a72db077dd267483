"""sft.py through its CLI: its outputs (docs/design.md, Outputs), learning on the toy task, bad input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT, check_exported_tokenizer, learning_env, metrics as read_metrics, usage_error

sys.path.insert(0, os.path.join(ROOT, "data"))
import toy  # noqa: E402


CHAT = [{"role": "user", "content": "Sort: 2 1"}, {"role": "assistant", "content": "1 2"}]
# A chat row that follows a good one, and what the refusal says (`tiny`: Gemma's template, no system role)
BAD_CHATS = [
    (
        {"messages": [{"role": "tool", "content": "7"}, *CHAT]},  # TRL's tool turn: not rendered here
        "bad.jsonl:2: field 'messages', turn 1: unknown role 'tool' (expected 'system', 'user' or 'assistant')",
    ),
    (
        {"messages": [CHAT[0], {"role": "asistant", "content": "1 2"}]},
        "bad.jsonl:2: field 'messages', turn 2: unknown role 'asistant'",
    ),
    ({"messages": CHAT[:1]}, "bad.jsonl:2: no assistant turn with text in 'messages': nothing to train on"),
    (
        {"messages": [CHAT[0], {"role": "assistant", "content": " "}]},
        "bad.jsonl:2: no assistant turn with text in 'messages'",
    ),
    (
        {"prompt": CHAT[:1], "completion": [{"role": "assistant", "content": ""}]},
        "bad.jsonl:2: no assistant turn with text in 'completion': nothing to train on",
    ),
    (
        {"messages": [*CHAT, {"role": "system", "content": "Be brief."}]},  # no user turn after it to open
        "bad.jsonl:2: field 'messages': a system turn must come first, then a user turn",
    ),
]


def run(*args, check=True, env=None):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "sft.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def exact_match(model, n=100):
    with open(os.path.join(ROOT, "data", "sft_eval.jsonl")) as f:
        rows = [json.loads(line) for line in f][:n]
    outs = model.generate([r["prompt"] for r in rows], max_length=32, strip_prompt=True)
    return np.mean([toy.score(r["prompt"], o) == 1.0 for r, o in zip(rows, outs)])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sft") / "run")
    # the defaults are TRL's, for real models; `tiny` from scratch: exact match 0.32 at step 150 (0.20 at 100)
    tiny = [
        "--batch-size",
        "32",
        "--learning-rate",
        "2e-3",
        "--warmup-steps",
        "10",
        "--lr-scheduler-type",
        "cosine_with_min_lr",
    ]  # the schedule these numbers were measured with
    done = run(
        "--model",
        "tiny",
        "--max-steps",
        "150",
        *tiny,
        "--eval-every",
        "75",
        "--export-hf",
        "--output-dir",
        out,
        env=learning_env(),
    )
    assert "(model/, model_hf/, metrics.jsonl" in done.stdout
    return out


def test_outputs(trained):
    files = os.listdir(trained)
    assert {"args.json", "metrics.jsonl", "model"} <= set(files)
    assert any(f.startswith("events.out.tfevents") for f in files)
    with open(os.path.join(trained, "args.json")) as f:
        assert json.load(f)["max_steps"] == 150
    rows = read_metrics(trained)
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(10, 151, 10))
    assert {"charts/learning_rate", "charts/tokens_per_sec", "charts/mfu"} <= set(train[-1])
    assert 0 < train[-1]["charts/mfu"] <= 1
    assert {"config.json", "model.weights.h5", "tokenizer.json"} <= set(
        os.listdir(os.path.join(trained, "model"))
    )


def test_export_hf(trained):
    """--export-hf: model_hf/ is a transformers checkpoint (`architectures` in its config.json)
    that KerasHub's Hugging Face converter loads with model/'s logits and tokenizer; its tokenizer.json
    gives the bundled tokenizer's ids (transformers' Gemma class read tokenizer.model as Gemma's own
    spec: "Sort" became "So" + "rt"), with the Gemma chat template and ordinary file modes."""
    import common  # noqa: F401  (sets the Keras backend)
    import keras_hub

    hf = os.path.join(trained, "model_hf")
    assert not os.path.exists(hf + ".tmp")
    assert sorted(os.listdir(hf)) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["GemmaForCausalLM"] and config["model_type"] == "gemma"
    saved, exported = (keras_hub.models.CausalLM.from_preset(d) for d in (os.path.join(trained, "model"), hf))
    assert type(exported.backbone).__name__ == "GemmaBackbone"
    ids = np.array([[2, 265, 283, 279, 286, 279, 293, 0]], np.int32)
    inputs = {"token_ids": ids, "padding_mask": ids != 0}
    np.testing.assert_allclose(np.asarray(exported(inputs)), np.asarray(saved(inputs)), rtol=1e-5, atol=1e-5)
    text = "Sort: 3 1 2"
    assert list(exported.preprocessor.tokenizer.tokenize(text)) == list(
        saved.preprocessor.tokenizer.tokenize(text)
    )
    check_exported_tokenizer(hf, saved.preprocessor.tokenizer, "gemma")


def test_learns_toy_task(trained):
    import common  # noqa: F401  (sets the Keras backend)
    import keras_hub

    rows = read_metrics(trained)
    train = [r["train/loss"] for r in rows if "train/loss" in r]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert train[-1] < 0.8 * train[0]  # the 20% of the issue, with a wide margin in practice
    assert [r["step"] for r in rows if "eval/loss" in r] == [0, 75, 150]
    assert evals[-1] < 0.25 * evals[0]  # held-out loss falls clearly
    before = exact_match(common.load_model("tiny", common.make_mesh(), seed=0))
    after = exact_match(keras_hub.models.CausalLM.from_preset(os.path.join(trained, "model")))
    assert before == 0.0 and after >= 0.25, (before, after)


def test_saved_model_continues_as_model_flag_with_messages(trained, tmp_path):
    out = str(tmp_path / "again")
    with open(os.path.join(ROOT, "data", "sft_messages_eval.jsonl")) as f:
        (tmp_path / "eval.jsonl").write_text(
            "".join(f.readlines()[:16])
        )  # two batches: the path, not the value
    proc = run(
        "--model",
        os.path.join(trained, "model"),
        "--max-steps",
        "2",
        "--log-every",
        "1",
        "--dataset",
        os.path.join(ROOT, "data", "sft_messages_train.jsonl"),
        "--eval-dataset",
        str(tmp_path / "eval.jsonl"),
        "--batch-size",
        "8",
        "--output-dir",
        out,
        "--num-samples",
        "1",
    )
    assert "sample:" in proc.stdout
    assert len([r for r in read_metrics(out) if "train/loss" in r]) == 2


def test_print_example_shows_rows_as_trained_and_runs_nothing(tmp_path, capsys):
    """--print-example 1: the chat as the template renders it, the answer (and its turn end) marked trained,
    every token id with its piece (`*`: in the loss), the EOS last; no output dir, no step."""
    import plumbing
    import sft

    sft.main(
        plumbing.cli(
            sft.Args,
            [
                "--print-example",
                "1",
                "--dataset",
                os.path.join(ROOT, "data", "sft_messages_train.jsonl"),
                "--output-dir",
                str(tmp_path / "out"),
            ],
        )
    )
    out = capsys.readouterr().out
    first = json.loads(open(os.path.join(ROOT, "data", "sft_messages_train.jsonl")).readline())["messages"]
    assert (
        f"<start_of_turn>user\n{first[0]['content']}<end_of_turn>\n<start_of_turn>model\n"
        f"[[{first[1]['content']}<end_of_turn>]]" in out
    )
    assert (
        out.count("--- row ") == 1
        and "2:'<bos>' " in out
        and out.rstrip().endswith("5*:'<end_of_turn>' 1*:'<eos>'")
    )
    assert not (tmp_path / "out").exists()


def test_a_sample_continues_the_whole_chat_earlier_answers_included():
    """The closing `sample:` lines prompt with a chat up to its last answer, as it was trained (the earlier
    answers in their turns), not with the user turns alone."""
    import common
    import sft

    chat = [
        {"role": "user", "content": "Sort: 3 1"},
        {"role": "assistant", "content": "1 3"},
        {"role": "user", "content": "Sort: 2 1"},
        {"role": "assistant", "content": "1 2"},
    ]
    segments = common.sft_segments({"messages": chat}, "x.jsonl:1", common.CHAT_TEMPLATES["gemma"])
    assert sft.sample_prompt(segments) == (
        "<start_of_turn>user\nSort: 3 1<end_of_turn>\n<start_of_turn>model\n"
        "1 3<end_of_turn>\n<start_of_turn>user\nSort: 2 1<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert sft.sample_prompt([("Sort: 2 1", False), (" 1 2", True)]) == "Sort: 2 1"  # prompt + completion
    assert sft.sample_prompt([("1 2 3", True)]) == ""  # `text`: a sample from nothing


@pytest.mark.parametrize(
    "content, message",
    [
        (
            '{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": "b"}\n{"prompt": "a",\n',
            "bad.jsonl:3: invalid JSON",
        ),
        (
            '{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": ""}\n',
            "bad.jsonl:2: field 'completion' must be a non-empty string",
        ),
        ('{"prompt": "a", "completion": "b"}\n{"question": "a"}\n', "bad.jsonl:2: need 'text'"),
        (  # preference rows, explicit or implicit prompt, strings or chats: said so, and which scripts take them
            '{"prompt": "a", "chosen": "b", "rejected": "c"}\n',
            "bad.jsonl:1: this row holds 'chosen'/'rejected', i.e. preference data: train on it with dpo.py, "
            "simpo.py, orpo.py or reward.py",
        ),
        (
            json.dumps({"chosen": CHAT, "rejected": CHAT[:1]}) + "\n",
            "bad.jsonl:1: this row holds 'chosen'/'rejected', i.e. preference data",
        ),
        (  # KTO's unpaired rows (a boolean label): said so, not trained on as demonstrations
            '{"prompt": "a", "completion": "b", "label": true}\n{"prompt": "a", "completion": "c", "label": false}\n',
            "bad.jsonl:1: this row looks like KTO's unpaired data (prompt, completion, label): kto.py trains on "
            "it; sft.py would imitate the undesirable (label false) completions too",
        ),
        ("", "bad.jsonl: no examples"),
        *[(f"{json.dumps({'messages': CHAT})}\n{json.dumps(row)}\n", message) for row, message in BAD_CHATS],
    ],
)
def test_bad_dataset_is_refused_naming_file_and_line(tmp_path, content, message):
    import sft  # here: JAX is imported after conftest set XLA_FLAGS

    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    assert message in usage_error(
        sft, "--dataset", str(bad), "--max-steps", "1", "--output-dir", str(tmp_path / "out")
    )
    assert not os.path.exists(tmp_path / "out")  # nothing written, no compute spent


def test_conversational_prompt_completion_trains_on_the_completion_only(tmp_path):
    """TRL's conversational prompt/completion row (message lists): the same tokens as that chat in `messages`
    form, the system turn included; the loss on the completion's answer (+ EOS) only, where `messages`
    trains on every answer."""
    import keras_hub
    import common
    import sft

    turn = lambda role, text: {"role": role, "content": text}  # noqa: E731
    prompt = [turn("system", "Answer briefly."), *CHAT, turn("user", "Sort: 3 1")]
    path = tmp_path / "chats.jsonl"
    path.write_text(
        json.dumps({"prompt": prompt, "completion": [turn("assistant", "1 3")]})
        + "\n"
        + json.dumps({"messages": [*prompt, turn("assistant", "1 3")]})
        + "\n"
    )
    tokenizer = keras_hub.models.GemmaTokenizer(proto=common.TINY_TOKENIZER)
    rows = common.read_dataset(str(path), "sft", common.CHAT_TEMPLATES["gemma"])
    (ids, mask), (chat_ids, chat_mask) = sft.tokenize_dataset(rows, tokenizer, 256, True, str(path))[0]
    tokens = lambda text: [int(i) for i in tokenizer.tokenize(text)]  # noqa: E731
    assert "".join(t for t, _ in rows[0]).startswith("<start_of_turn>user\nAnswer briefly.\n\nSort: 2 1<end")
    assert list(ids) == list(chat_ids)
    assert list(ids[mask]) == tokens("1 3<end_of_turn>") + [tokenizer.end_token_id]
    assert list(chat_ids[chat_mask]) == (
        tokens("1 2<end_of_turn>") + tokens("1 3<end_of_turn>") + [tokenizer.end_token_id]
    )


def test_bad_dataset_exits_2_in_one_line(tmp_path):
    """The boundary's side, once: a UsageError from the data is one line on stderr and exit code 2."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"question": "a"}\n')
    proc = run("--dataset", str(bad), "--output-dir", str(tmp_path / "out"), check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: {bad}:2: need 'text', 'prompt'+'completion' or 'messages' (got ['question'])"
    ], proc.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model", "gemma_3b_typo"], "unknown --model 'gemma_3b_typo'"),
        (["--model", "gemma3_1b_itt"], "unknown --model 'gemma3_1b_itt': did you mean gemma3_1b_it, "),
        (["--mesh", "data=3"], "--mesh 'data=3' has 3 devices, but 8 are present"),
        (["--batch-size", "12"], "--batch-size 12 must divide"),
    ],
)
def test_bad_flags_are_refused(tmp_path, flags, message):
    import sft

    assert message in usage_error(sft, *flags, "--output-dir", str(tmp_path / "out"))


def test_eval_loss_covers_every_example_even_fewer_than_a_batch(tmp_path):
    """5 eval rows, --batch-size 8: eval/loss at step 0 is the initial model's token-mean NLL over all
    5 rows' completion tokens (+ EOS), recomputed here in float64 from whole logits (the sft.py of
    76cc5f6 took full batches only and logged 0.0; with 100 rows at batch 32 it dropped 4)."""
    import common
    import jax
    import sft
    import plumbing

    rows = [json.loads(line) for line in open(os.path.join(ROOT, "data", "sft_eval.jsonl"))][:5]
    (tmp_path / "five.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "run")
    sft.main(
        plumbing.cli(
            sft.Args,
            [
                "--model",
                "tiny",
                "--max-steps",
                "1",
                "--batch-size",
                "8",
                "--eval-dataset",
                str(tmp_path / "five.jsonl"),
                "--eval-every",
                "1",
                "--num-samples",
                "0",
                "--output-dir",
                out,
            ],
        )
    )
    logged = read_metrics(out)[0]
    assert logged["step"] == 0
    model = common.load_model(
        "tiny", jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model")), "float32"
    )
    tokenizer, nll, count = model.preprocessor.tokenizer, 0.0, 0
    for r in rows:
        prompt, completion = (list(tokenizer.tokenize(r[k])) for k in ("prompt", "completion"))
        ids = np.array(
            [[tokenizer.start_token_id] + prompt + completion + [tokenizer.end_token_id]], np.int32
        )
        hidden = model.backbone({"token_ids": ids, "padding_mask": np.ones_like(ids, bool)})
        z = np.asarray(common.logits(model.backbone, hidden), np.float64)[0]  # [T, V]
        logp = z - z.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        targets = np.arange(1 + len(prompt), ids.shape[1])  # completion tokens and EOS, each predicted by t-1
        nll -= logp[targets - 1, ids[0, targets]].sum()
        count += len(targets)
    assert logged["eval/loss"] == pytest.approx(nll / count, rel=1e-5)
