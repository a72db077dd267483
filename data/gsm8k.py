"""A reward function for GSM8K-format data (openai/gsm8k, config `main`): each row's `answer`
ends in `#### N`; a completion is right when the last number in it equals N.

    python grpo.py --model gemma2_2b_it --dataset gsm8k_train.jsonl \
        --reward-fn data/gsm8k.py:accuracy

where gsm8k_train.jsonl holds GSM8K's rows with the question as `prompt`,
{"prompt": "Natalia sold ...", "answer": "... #### 72"}. This file writes it (network: the Hugging Face Hub):

    python data/gsm8k.py --out gsm8k_train.jsonl   # --split test, --source a local clone of the repo
"""

import json
import os
import re
import sys
from dataclasses import dataclass

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


@dataclass
class Args:
    out: str = "gsm8k_train.jsonl"
    """the .jsonl file to write"""
    split: str = "train"
    """GSM8K's split: train or test"""
    source: str = "openai/gsm8k"
    """a Hugging Face dataset id, or a local clone of its repo (configuration `main`)"""


def main(args):
    """Write one split of GSM8K as `prompt` (its question) + `answer` rows; an unreachable Hub, a missing split:
    one line, exit 2 (common.read_rows)."""
    import common

    rows = common.read_rows(args.source, "--source", "main", args.split)
    with open(args.out, "w") as f:
        for row, _ in rows:
            f.write(json.dumps({"prompt": row["question"], "answer": row["answer"]}) + "\n")
    print(f"{len(rows)} rows of {args.source} ({args.split}) -> {args.out}")


if __name__ == "__main__":
    sys.path.insert(
        0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    )  # the repository's modules
    import plumbing

    plumbing.launch(main, Args)
