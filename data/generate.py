"""Generate the bundled toy datasets and train the `tiny` tokenizer.

    python data/generate.py            # rewrites data/*.jsonl, data/compare/*.jsonl and data/tiny_tokenizer.model
    python data/generate.py compare    # rewrites data/compare/*.jsonl only (the tokenizer stays as it is)
    python data/generate.py calculator # rewrites data/calculator/*.jsonl only

Deterministic (fixed seed). Files:
  sft_{train,eval}.jsonl           prompt + completion
  sft_messages_{train,eval}.jsonl  the same as chat `messages`
  prefs_{train,eval}.jsonl         prompt, chosen (correct), rejected (subtly wrong)
  kto_{train,eval}.jsonl           the same pairs unpaired as TRL's unpair_preference_dataset does: prompt,
                                   completion, label; every chosen (label true), then every rejected (false)
  prompts_{train,eval}.jsonl       prompt + answer (PPO / GRPO / evaluation; toy.py's accuracy reads `answer`)
  prompts_test.jsonl               the same: compare.py's reported numbers (the eval split picks settings)
Eval prompts never occur in any train split; test prompts occur in neither (own RNG, drawn after the
others, so the train and eval files are the same as before the test split existed).

data/compare/ holds compare.py's task (docs/compare.md, "The comparison task"): the same sorting, checked by
toy.py's score, but with signals that differ. Its own RNG (seed 2), so the files above never change with it:
  sft_{train,eval}.jsonl   demonstrations; in train about 30% carry one mistake, always the same one (a hurried
                           annotator's habit: in a share HABIT of the lists with a repeated digit, it is written
                           once); eval is correct
  prefs_{train,eval}.jsonl two answers of that annotator, each also slipping (a swapped pair, a changed or a
                           dropped digit) with probability SLIP, ranked by the checker: chosen scores higher
                           (ties drawn again)
  kto_{train,eval}.jsonl   the pairs unpaired, as above
  chosen_{train,eval}.jsonl  each pair's chosen answer as a demonstration (prompt + completion): compare.py's
                           sft-chosen control, the preference rows' information without the contrast
  prompts_{train,eval,test}.jsonl  prompt + answer: the RL prompts, the sweep's split, the reported split

data/calculator/ holds grpo_tools.py's task (docs/grpo_tools.md; checker and tool: calculator.py): chat prompts
"a * b", half of two one-digit numbers, half of two two-digit numbers; its own RNG (seed 3):
  sft_train.jsonl          CALCULATOR_DEMOS demonstrations as chat `messages` (the first 4,000 of them are the
                           prompts of prompts_train.jsonl): on a share TOOL_SHARE of them (80% of the two-digit
                           products, 30% of the one-digit ones, each drawn at random) the answer calls the calculator in the gemma template's tool format
                           (grpo_tools.py's FORMATS["gemma"]: the call, the result in a user turn), then answers;
                           the others answer at once
  prompts_{train,eval,test}.jsonl  prompt (a one-turn chat) + answer; eval and test hold no two-digit product
                           of train (the one-digit table has only 81 products: every split holds them)
  prompts_fresh.jsonl      500 more, drawn last, half of each size: no two-digit product of any split above
"""

import json
import os
import random

import sys

from toy import score

HERE = os.path.dirname(os.path.abspath(__file__))
MIN_LEN, MAX_LEN = 3, 6
SIZES = {"train": 4000, "eval": 200, "test": 500}
COMPARE_LEN = (3, 5)  # digits a list in the comparison task
CALCULATOR_SIZES = {"train": 4000, "eval": 200, "test": 500, "fresh": 500}
# calculator demonstrations (sft_train.jsonl): more than the RL prompts, so that a model cannot answer them from
# memory and learns to copy the calculator (docs/grpo_tools.md, change 5: 4,000 gave starts that rarely copied)
CALCULATOR_DEMOS = 16000
# share of the calculator demonstrations that call the tool, by the size of the numbers: most of the products
# the model cannot know, some of those it can (docs/grpo_tools.md: 0.3 of both copied too rarely)
TOOL_SHARE = {"one-digit": 0.3, "two-digit": 0.8}
HABIT = 0.6  # share of the lists with a repeated digit whose demonstration writes that digit once
SLIP = 0.5  # share of each answer of a preference pair with one random mistake besides (before ranking)


def make_prompt(rng, lengths=(MIN_LEN, MAX_LEN)):
    digits = [rng.randrange(10) for _ in range(rng.randint(*lengths))]
    return "Sort: " + " ".join(map(str, digits))


def fmt(digits):
    return " " + " ".join(map(str, digits))


def corrupt(rng, correct):
    """A subtly wrong answer: swap two neighbours, change one digit, or drop one."""
    wrong = list(correct)
    while wrong == correct:
        kind = rng.choice(["swap", "change", "drop"])
        if kind == "swap":
            i = rng.randrange(len(wrong) - 1)
            wrong[i], wrong[i + 1] = wrong[i + 1], wrong[i]
        elif kind == "change":
            wrong[rng.randrange(len(wrong))] = rng.randrange(10)
        else:
            del wrong[rng.randrange(len(wrong))]
    return wrong


def annotate(rng, correct, habit, slip):
    """A hurried annotator's answer: a list with a repeated digit gets that digit once with probability
    `habit` (the same mistake every time: imitation learns it); otherwise, with probability `slip`, one
    random mistake (corrupt); else the sorted list."""
    repeated = [d for i, d in enumerate(correct) if d in correct[:i]]
    if repeated and rng.random() < habit:
        wrong = list(correct)
        wrong.remove(rng.choice(repeated))
        return wrong
    return corrupt(rng, correct) if rng.random() < slip else list(correct)


def ranked_pair(rng, prompt, correct):
    """Two annotator answers ranked by the checker -> (chosen, rejected), chosen the higher score; a tie
    (both right, or equally wrong) is drawn again, so every pair carries a preference."""
    while True:
        a, b = annotate(rng, correct, HABIT, SLIP), annotate(rng, correct, HABIT, SLIP)
        sa, sb = score(prompt, fmt(a)), score(prompt, fmt(b))
        if sa != sb:
            return (a, b) if sa > sb else (b, a)


def write(name, rows):
    os.makedirs(os.path.dirname(os.path.join(HERE, name)), exist_ok=True)
    with open(os.path.join(HERE, name), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def splits(rng, lengths, sizes):
    """{split: prompts}: eval drawn first, then train avoiding it, then test avoiding both; eval and test
    have no repeats and are sorted, train keeps its order (and may repeat a prompt, as the toy's does)."""
    out = {}
    seen = set()  # the prompts of the splits drawn so far
    for split in ("eval", "train", "test"):
        ps = []
        while len(ps) < sizes[split]:
            p = make_prompt(rng, lengths)
            if p not in seen and (split == "train" or p not in ps):
                ps.append(p)
        out[split] = ps if split == "train" else sorted(ps)
        seen |= set(ps)
    return out


def compare_task():
    """data/compare/: the comparison task (module docstring)."""
    rng = random.Random(2)
    prompts = splits(rng, COMPARE_LEN, SIZES)
    for split in ("train", "eval"):
        ps = prompts[split]
        answers = [sorted(int(d) for d in p.split()[1:]) for p in ps]
        habit = HABIT if split == "train" else 0.0
        write(
            f"compare/sft_{split}.jsonl",
            [{"prompt": p, "completion": fmt(annotate(rng, a, habit, 0.0))} for p, a in zip(ps, answers)],
        )
        pairs = [ranked_pair(rng, p, a) for p, a in zip(ps, answers)]
        prefs = [{"prompt": p, "chosen": fmt(c), "rejected": fmt(r)} for p, (c, r) in zip(ps, pairs)]
        write(f"compare/prefs_{split}.jsonl", prefs)
        write(
            f"compare/chosen_{split}.jsonl",
            [{"prompt": r["prompt"], "completion": r["chosen"]} for r in prefs],
        )
        write(
            f"compare/kto_{split}.jsonl",
            [
                {"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
                for k in ("chosen", "rejected")
                for r in prefs
            ],
        )
    for split, ps in prompts.items():
        write(
            f"compare/prompts_{split}.jsonl",
            [{"prompt": p, "answer": fmt(sorted(int(d) for d in p.split()[1:]))} for p in ps],
        )


def product_prompt(rng):
    """(a, b): two one-digit numbers, or (half of the time) two two-digit numbers."""
    low, high = (1, 9) if rng.random() < 0.5 else (10, 99)
    return rng.randint(low, high), rng.randint(low, high)


def calculator_task():
    """data/calculator/: grpo_tools.py's task (module docstring)."""
    rng = random.Random(3)
    seen = set()  # the two-digit products of the splits drawn so far
    for split in ("eval", "test", "train"):
        pairs = []
        while len(pairs) < (CALCULATOR_DEMOS if split == "train" else CALCULATOR_SIZES[split]):
            a, b = product_prompt(rng)
            if a < 10 or (a, b) not in seen:  # train may repeat its own two-digit products, not theirs
                pairs.append((a, b))
        seen |= {(a, b) for a, b in pairs if a >= 10}
        rows = [
            {"prompt": [{"role": "user", "content": f"{a} * {b}"}], "answer": str(a * b)} for a, b in pairs
        ]
        write(f"calculator/prompts_{split}.jsonl", rows[: CALCULATOR_SIZES[split]])
        if split != "train":
            continue
        demos = []
        for row, (a, b) in zip(rows, pairs):
            turns = row["prompt"][:]
            if (
                rng.random() < TOOL_SHARE["two-digit" if a >= 10 else "one-digit"]
            ):  # the gemma format of grpo_tools.py (tests/test_grpo_tools.py)
                turns += [
                    {"role": "assistant", "content": f'[calculator(expression="{a} * {b}")]'},
                    {"role": "user", "content": f"```tool_output\n{a * b}\n```"},
                ]
            demos.append({"messages": turns + [{"role": "assistant", "content": str(a * b)}]})
        write("calculator/sft_train.jsonl", demos)
    # fresh: a second test split, drawn last (the files above are unchanged by it), that no recipe was chosen
    # or judged on before the tools comparison at five seeds (docs/grpo_tools.md)
    pairs, half = [], CALCULATOR_SIZES["fresh"] // 2
    count = {True: 0, False: 0}  # one-digit, two-digit products taken
    while len(pairs) < 2 * half:  # half of each size, as drawn (a two-digit product is rarely unseen by now)
        a, b = product_prompt(rng)
        if count[a < 10] < half and (a < 10 or (a, b) not in seen):
            pairs.append((a, b))
            count[a < 10] += 1
            seen.add((a, b))  # a one-digit product too: harmless, nothing after this reads it
    rows = [{"prompt": [{"role": "user", "content": f"{a} * {b}"}], "answer": str(a * b)} for a, b in pairs]
    write("calculator/prompts_fresh.jsonl", rows)


def main():
    compare_task()
    calculator_task()
    if sys.argv[1:] in (["compare"], ["calculator"]):
        return
    import sentencepiece as spm

    rng = random.Random(0)
    prompts = {"eval": set(), "train": []}
    while len(prompts["eval"]) < SIZES["eval"]:
        prompts["eval"].add(make_prompt(rng))
    prompts["eval"] = sorted(prompts["eval"])
    while len(prompts["train"]) < SIZES["train"]:
        p = make_prompt(rng)
        if p not in prompts["eval"]:
            prompts["train"].append(p)

    for split, ps in prompts.items():
        answers = [sorted(int(d) for d in p.split()[1:]) for p in ps]
        write(f"sft_{split}.jsonl", [{"prompt": p, "completion": fmt(a)} for p, a in zip(ps, answers)])
        write(
            f"sft_messages_{split}.jsonl",
            [
                {
                    "messages": [
                        {"role": "user", "content": p},
                        {"role": "assistant", "content": fmt(a).strip()},
                    ]
                }
                for p, a in zip(ps, answers)
            ],
        )
        prefs = [
            {"prompt": p, "chosen": fmt(a), "rejected": fmt(corrupt(rng, a))} for p, a in zip(ps, answers)
        ]
        write(f"prefs_{split}.jsonl", prefs)
        write(
            f"kto_{split}.jsonl",
            [
                {"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
                for k in ("chosen", "rejected")
                for r in prefs
            ],
        )
        write(f"prompts_{split}.jsonl", [{"prompt": p, "answer": fmt(a)} for p, a in zip(ps, answers)])
    test_rng = random.Random(1)  # its own RNG, drawn after the others: the files above stay the same
    seen = set(prompts["eval"]) | set(prompts["train"])
    test = set()
    while len(test) < SIZES["test"]:
        p = make_prompt(test_rng)
        if p not in seen:
            test.add(p)
    write(
        "prompts_test.jsonl",
        [{"prompt": p, "answer": fmt(sorted(int(d) for d in p.split()[1:]))} for p in sorted(test)],
    )

    # Tokenizer: Gemma's special-token layout (pad=0, eos=1, bos=2, unk=3) plus its
    # chat-turn markers, digits split into single tokens, byte fallback for anything else.
    corpus = os.path.join(HERE, "tokenizer_corpus.txt")
    with open(corpus, "w") as f:
        for p in prompts["train"]:
            f.write(p + "\n" + fmt(sorted(int(d) for d in p.split()[1:])) + "\n")
        f.write("user model system assistant The quick brown fox jumps over the lazy dog.\n" * 50)
    spm.SentencePieceTrainer.train(
        input=corpus,
        model_prefix=os.path.join(HERE, "tiny_tokenizer"),
        vocab_size=320,
        model_type="bpe",
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        split_digits=True,
        byte_fallback=True,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    os.remove(corpus)
    os.remove(os.path.join(HERE, "tiny_tokenizer.vocab"))


if __name__ == "__main__":
    main()
