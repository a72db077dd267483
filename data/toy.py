"""The toy task: sort a short list of digits.

    prompt:      "Sort: 7 2 9 2"
    completion:  " 2 2 7 9"

The answer is checkable, so every algorithm can be scored offline.
`score(prompt, response)` is the task metric; `batch_score(prompts, responses)`
has the two-argument `--reward-fn` form (lists in, list of floats out), and
`accuracy(completions, answer, **kwargs)` TRL's form, checking against the
prompt files' `answer` column (the same score: the answer is the sorted list).
"""

import re

PROMPT_PREFIX = "Sort:"


def parse_digits(text):
    """Digits of a space-separated list, ignoring anything that is not a digit."""
    return [int(d) for d in re.findall(r"\d", text)]


def answer(prompt):
    """The correct completion for a prompt (leading space, as in the data)."""
    return " " + " ".join(str(d) for d in sorted(parse_digits(prompt)))


def score(prompt, response):
    """1.0 for the exact sorted list; otherwise the fraction of positions right.

    Positions are compared against the sorted list; the denominator is the longer
    of the two lists, so missing or extra digits cost as much as wrong ones.
    Anything after the list (e.g. text past the answer) is ignored only if it has
    no digits. The result lies in [0, 1].
    """
    target = sorted(parse_digits(prompt))
    got = parse_digits(response)
    if got == target:
        return 1.0
    denom = max(len(target), len(got), 1)
    return sum(a == b for a, b in zip(target, got)) / denom


def batch_score(prompts, responses):
    """`--reward-fn` signature: one float per (prompt, response)."""
    return [score(p, r) for p, r in zip(prompts, responses)]


def accuracy(completions, answer, **kwargs):
    """TRL's reward-function form: `answer` is the dataset column, one per completion (a prompt's
    repeated for each of its completions); a chat completion is [{"role": "assistant", "content": ...}]."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [score(a, t) for a, t in zip(answer, texts)]  # score() reads the digits of its first argument
