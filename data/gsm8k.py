"""A reward function for GSM8K-format data (openai/gsm8k, config `main`): each row's `answer`
ends in `#### N`; a completion is right when the last number in it equals N.

    python grpo.py --model gemma2_2b_it --dataset gsm8k_train.jsonl \
        --reward-fn data/gsm8k.py:accuracy

where gsm8k_train.jsonl holds GSM8K's rows with the question as `prompt`, e.g. from
`datasets.load_dataset("openai/gsm8k", "main", split="train")` renamed and saved with
`.to_json(path)`: {"prompt": "Natalia sold ...", "answer": "... #### 72"}.
"""

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def number(text):
    """The last number in `text` as a float (commas, `$` and a trailing `.` ignored), or None."""
    found = NUMBER.findall(text.replace("$", ""))
    return float(found[-1].replace(",", "")) if found else None


def reference(answer):
    """N of GSM8K's `... #### N`."""
    return number(answer.split("####")[-1])


def accuracy(completions, answer, **kwargs):
    """1.0 where the completion's last number is the reference answer, else 0.0 (TRL's form)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(number(t) is not None and number(t) == reference(a)) for t, a in zip(texts, answer)]
