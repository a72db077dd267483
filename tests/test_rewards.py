"""Reward functions as ppo.py, grpo.py and evaluate.py call them (common.Scorer): TRL's contract
f(prompts, completions, **kwargs) with the dataset's columns, the two-argument form, None scores,
chat completions, and the errors a misbehaving function gets; the bundled checkers (data/toy.py's
accuracy, data/gsm8k.py) on hand-written rows. No model: the Scorer is called on texts."""

import json
import os
import sys

import numpy as np
import pytest

import common
from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "data"))
import gsm8k  # noqa: E402
import toy  # noqa: E402

GEMMA = common.CHAT_TEMPLATES["gemma"]


def scored(fns, prompts, texts, rows, weights=(), end=None):
    """(total scores on the host, parts) of a Scorer of `fns` on 8 completions (one per device)."""
    scorer = common.Scorer(common.make_mesh(), fns, weights)
    ids = [[5, 6, 1][: 1 + i % 3] for i in range(len(texts))]
    total, parts = scorer(prompts, texts, None, rows, ids, end)
    return common.to_host(total), parts


def test_trl_contract_passes_columns_aligned_with_the_completions():
    """2 prompts × G = 4: each prompt's `answer` (and any other column) repeated per completion, by
    keyword; completion_ids as lists of ints; the two-argument form gets (prompt texts, texts)."""
    seen = {}

    def trl(prompts, completions, answer, completion_ids, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, ids=completion_ids, **kwargs)
        return [float(c == a) for c, a in zip(completions, answer)]

    def old(prompts, responses):
        seen["old"] = (prompts, responses)
        return [0.5] * len(prompts)

    rows = [{"prompt": "Sort: 2 1", "answer": " 1 2", "level": 1}] * 4 + [
        {"prompt": "Sort: 3", "answer": " 3"}
    ] * 4
    prompts = [r["prompt"] for r in rows]
    texts = [" 1 2", " 2 1", " 1 2", "x", " 3", " 3", "", " 3 3"]
    total, parts = scored([trl, old], prompts, texts, rows, weights=(1.0, 2.0))
    assert seen["prompts"] == prompts and seen["completions"] == texts
    assert seen["answer"] == [" 1 2"] * 4 + [" 3"] * 4
    assert seen["level"] == [1] * 4 + [None] * 4  # a column some rows lack: None there
    assert seen["ids"] == [[5], [5, 6], [5, 6, 1], [5], [5, 6], [5, 6, 1], [5], [5, 6]]
    assert seen["old"] == (prompts, texts)
    np.testing.assert_array_equal(parts["trl"], [1, 0, 1, 0, 1, 1, 0, 0])
    np.testing.assert_allclose(total, [2, 1, 2, 1, 2, 2, 1, 1])  # 1 × trl + 2 × 0.5


def test_chat_completions_are_messages_cut_at_the_end_of_turn():
    """A chat prompt reaches TRL-form functions as its message list, each completion as one assistant
    message without the template's `<end_of_turn>` (nor what follows it); the two-argument form gets
    the rendered prompt and the cut text."""
    seen = {}

    def exact(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [float(c[0]["content"] == a) for c, a in zip(completions, answer)]

    def old(prompts, responses):
        seen["old"] = responses
        return [0.0] * len(responses)

    chat = [{"role": "user", "content": "Sort: 2 1"}]
    rows = [{"prompt": chat, "answer": "1 2"}] * 8
    rendered = common.render(chat, GEMMA) + GEMMA[1]
    texts = ["1 2<end_of_turn>", "1 2<end_of_turn>\n<start_of_turn>user", "1 2", "2 1<end_of_turn>"] * 2
    total, parts = scored([exact, old], [rendered] * 8, texts, rows, end=common.turn_end(GEMMA))
    assert seen["prompts"] == [chat] * 8
    assert seen["completions"][:4] == [
        [{"role": "assistant", "content": c}] for c in ("1 2", "1 2", "1 2", "2 1")
    ]
    assert seen["old"][:4] == ["1 2", "1 2", "1 2", "2 1"]
    np.testing.assert_array_equal(total, [1, 1, 1, 0] * 2)
    assert [common.turn_end(common.CHAT_TEMPLATES[k]) for k in ("gemma", "llama3", "mistral", "chatml")] == [
        "<end_of_turn>",
        "<|eot_id|>",
        None,
        "<|im_end|>",
    ]


def test_none_is_left_out_of_the_weighted_sum():
    """TRL's "this function does not apply": a sample's None drops that function from its sum; a
    sample every function returns None for is an error naming it."""

    def math(completions, **kwargs):
        return [1.0 if c.isdigit() else None for c in completions]

    def style(completions, **kwargs):
        return [None if c.isdigit() else 0.25 for c in completions]

    rows = [{"prompt": "p"}] * 8
    texts = ["1", "a", "2", "b", "3", "c", "4", "d"]
    total, parts = scored([math, style], ["p"] * 8, texts, rows, weights=(2.0, 4.0))
    np.testing.assert_allclose(total, [2.0, 1.0] * 4)  # 2 × 1, or 4 × 0.25
    assert np.isnan(parts["math"][1::2]).all() and np.isnan(parts["style"][::2]).all()
    with pytest.raises(
        common.UsageError,
        match=r"every reward function returned None or NaN for completion 1 .*"
        r": math \(.*test_rewards.py:\d+\) returned None; at least one",
    ):
        scored([math], ["p"] * 8, texts, rows)


def test_a_nan_counts_as_none_as_trl_nansum_does_and_is_named(capsys):
    """TRL puts a function's own NaN into its nansum like a None: left out of the sum and of the function's
    mean; said once per function on stderr (NaN, its name). Every function NaN or None: exit 2 naming each."""

    def half(completions, **kwargs):
        return [float("nan") if i % 2 else 1.0 for i in range(len(completions))]

    def other(completions, **kwargs):
        return [0.25 if i % 2 else None for i in range(len(completions))]

    rows, texts = [{"prompt": "p"}] * 8, ["x"] * 8
    total, parts = scored([half, other], ["p"] * 8, texts, rows, weights=(2.0, 4.0))
    np.testing.assert_allclose(total, [2 * 1.0, 4 * 0.25] * 4)  # never 2 × NaN, never 0 for the NaN
    assert np.nanmean(parts["half"]) == 1.0  # grpo.py's rewards/half/mean: the 4 scores that apply
    err = capsys.readouterr().err
    assert "reward function half (" in err and "returned NaN for 4 of 8 completions: taken as None" in err

    def never(completions, **kwargs):
        return [None] * len(completions)

    with pytest.raises(
        common.UsageError,
        match=r"None or NaN for completion 1 .*: half \(.*\) returned NaN, "
        r"never \(.*\) returned None; at least one must score",
    ):
        scored([half, never], ["p"] * 8, texts, rows)


def test_same_named_functions_keep_one_score_each_by_position():
    """data/toy.py:accuracy and data/gsm8k.py:accuracy: two metric names by module, weights by position.
    '8 8 9' for `Sort: 8 6 8 9 7` is wrong for the sort checker (0 of 5 places) but ends in the answer's
    last number, 9, which is all GSM8K's checker reads (1.0)."""
    fns = [
        common.load_reward_fn(os.path.join(ROOT, "data", f)) for f in ("toy.py:accuracy", "gsm8k.py:accuracy")
    ]
    assert common.reward_names(fns) == ["toy.accuracy", "gsm8k.accuracy"]
    assert common.reward_names(fns[:1] * 2 + [gsm8k.number]) == ["toy.accuracy_1", "toy.accuracy_2", "number"]
    rows = [{"prompt": "Sort: 8 6 8 9 7", "answer": " 6 7 8 8 9"}] * 8
    texts = [" 8 8 9", " 6 7 8 8 9"] * 4
    total, parts = scored(fns, ["Sort: 8 6 8 9 7"] * 8, texts, rows, weights=(1.0, 0.0))
    assert list(parts) == ["toy.accuracy", "gsm8k.accuracy"]
    np.testing.assert_array_equal(total, [1.0 * 0 + 0.0 * 1, 1.0 * 1 + 0.0 * 1] * 4)  # the toy checker's
    total, _ = scored(fns, ["Sort: 8 6 8 9 7"] * 8, texts, rows, weights=(0.0, 1.0))
    np.testing.assert_array_equal(total, [1.0, 1.0] * 4)  # GSM8K's


@pytest.mark.parametrize(
    "body, message",
    [
        # a KeyError: with the columns the rows have (what it could have read)
        (
            "raise KeyError('solution')",
            r"raised KeyError: 'solution' \(at .*bad.py:2; the rows' columns: prompt\)",
        ),
        ("return [1.0] * (len(completions) - 1)", r"returned 7 scores for 8 completions"),
        ("return 'good'", r"returned 'good': expected one float \(or None\) per completion"),
        ("return [{'score': 1}] * len(completions)", r"returned \"\[\{'score': 1\}, .*: expected one float"),
    ],
)
def test_a_misbehaving_function_is_a_usage_error_naming_it(tmp_path, body, message):
    path = tmp_path / "bad.py"
    path.write_text(f"def judge(prompts, completions, **kwargs):\n    {body}\n")
    judge = common.load_reward_fn(f"{path}:judge")
    with pytest.raises(common.UsageError, match=f"reward function judge \\({path}:1\\) {message}"):
        scored([judge], ["p"] * 8, ["x"] * 8, [{"prompt": "p"}] * 8)


def test_weights_that_do_not_match_the_functions_are_refused():
    """--reward-weights: one weight per --reward-fn (grpo, rloo, grpo_tools, evaluate: common.load_scorer), else
    one line before anything loads; none: all 1."""
    fn = os.path.join(ROOT, "data", "toy.py") + ":batch_score"
    with pytest.raises(common.UsageError, match="--reward-weights: 2 weights for 1 --reward-fn functions"):
        common.load_scorer(None, reward_fns=(fn,), weights=(1.0, 2.0))
    scorer = common.load_scorer(common.make_mesh(None), reward_fns=(fn, fn))
    assert [w for _, w, _, _ in scorer.fns] == [1.0, 1.0]


def test_columns_a_function_needs_are_checked_against_the_dataset():
    """Before any model loads (grpo.py, ppo.py and evaluate.py call check_columns after reading the
    data): a required parameter that is neither an input nor a column is refused, naming both."""

    def accuracy(prompts, completions, solution, hint=None, **kwargs):
        return [0.0] * len(completions)

    scorer = common.Scorer(common.make_mesh(), [accuracy])
    scorer.check_columns([{"prompt": "p", "solution": "1"}])  # `hint` has a default: not required
    with pytest.raises(
        common.UsageError,
        match=r"reward function accuracy \(.*test_rewards.py:\d+\) takes "
        r"'solution', which is not a column of --dataset \(its columns: "
        r"answer, prompt\)",
    ):
        scorer.check_columns([{"prompt": "p", "answer": "1"}])
    common.Scorer(common.make_mesh(), [toy.batch_score]).check_columns([{"prompt": "p"}])  # two-argument form


def test_toy_accuracy_reads_the_answer_column_and_equals_the_task_score():
    rows = [{"prompt": "Sort: 7 2 9 2", "answer": " 2 2 7 9"}] * 3
    completions = [" 2 2 7 9", " 2 7 2 9", [{"role": "assistant", "content": "2 2 7"}]]
    assert toy.accuracy(completions, [r["answer"] for r in rows]) == [1.0, 2 / 4, 3 / 4]  # places right / 4
    texts = [" 2 2 7 9", " 2 7 2 9", "2 2 7"]
    assert toy.accuracy(texts, [r["answer"] for r in rows]) == toy.batch_score(
        [r["prompt"] for r in rows], texts
    )
    with open(os.path.join(ROOT, "data", "prompts_eval.jsonl")) as f:
        for row in map(json.loads, f):
            assert row["answer"] == toy.answer(row["prompt"])  # the bundled column is the sorted list


def test_gsm8k_reward_on_rows_in_its_format():
    """GSM8K's `answer` ends in `#### N`; the completion's last number is compared (commas, `$`, a
    trailing full stop and a `.0` do not matter)."""
    answers = [
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72",
        "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n#### 10",
        "It costs 1,000 + 200 = <<1000+200=1200>>1200 dollars.\n#### 1,200",
        "The answer is negative.\n#### -3",
    ]
    completions = [
        "She sold 48 + 24 = 72 clips.",
        "So she earned $10.",
        "The total is 1,200.0 dollars.",
        [{"role": "assistant", "content": "-3 degrees, not 3"}],
    ]
    assert gsm8k.accuracy(completions, answers) == [1.0, 1.0, 1.0, 0.0]  # the last number of the 4th is 3
    assert gsm8k.accuracy(["72 or 71", "I do not know", "10"], answers[:3]) == [0.0, 0.0, 0.0]
    assert [gsm8k.reference(a) for a in answers] == [72.0, 10.0, 1200.0, -3.0]
