"""Generate the bundled toy datasets and train the `tiny` tokenizer.

    python data/generate.py            # rewrites data/*.jsonl and data/tiny_tokenizer.model

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
"""

import json
import os
import random

import sentencepiece as spm

HERE = os.path.dirname(os.path.abspath(__file__))
MIN_LEN, MAX_LEN = 3, 6
SIZES = {"train": 4000, "eval": 200, "test": 500}


def make_prompt(rng):
    digits = [rng.randrange(10) for _ in range(rng.randint(MIN_LEN, MAX_LEN))]
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


def write(name, rows):
    with open(os.path.join(HERE, name), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main():
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
        write(f"sft_messages_{split}.jsonl", [
            {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": fmt(a).strip()}]}
            for p, a in zip(ps, answers)])
        prefs = [{"prompt": p, "chosen": fmt(a), "rejected": fmt(corrupt(rng, a))} for p, a in zip(ps, answers)]
        write(f"prefs_{split}.jsonl", prefs)
        write(f"kto_{split}.jsonl", [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
                                     for k in ("chosen", "rejected") for r in prefs])
        write(f"prompts_{split}.jsonl", [{"prompt": p, "answer": fmt(a)} for p, a in zip(ps, answers)])
    test_rng, seen, test = random.Random(1), set(prompts["eval"]) | set(prompts["train"]), set()
    while len(test) < SIZES["test"]:
        p = make_prompt(test_rng)
        if p not in seen:
            test.add(p)
    write("prompts_test.jsonl", [{"prompt": p, "answer": fmt(sorted(int(d) for d in p.split()[1:]))}
                                 for p in sorted(test)])

    # Tokenizer: Gemma's special-token layout (pad=0, eos=1, bos=2, unk=3) plus its
    # chat-turn markers, digits split into single tokens, byte fallback for anything else.
    corpus = os.path.join(HERE, "tokenizer_corpus.txt")
    with open(corpus, "w") as f:
        for p in prompts["train"]:
            f.write(p + "\n" + fmt(sorted(int(d) for d in p.split()[1:])) + "\n")
        f.write("user model system assistant The quick brown fox jumps over the lazy dog.\n" * 50)
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=os.path.join(HERE, "tiny_tokenizer"), vocab_size=320,
        model_type="bpe", pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
        split_digits=True, byte_fallback=True, hard_vocab_limit=False, minloglevel=2)
    os.remove(corpus)
    os.remove(os.path.join(HERE, "tiny_tokenizer.vocab"))


if __name__ == "__main__":
    main()
