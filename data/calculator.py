"""The calculator task (grpo_tools.py's bundled task, docs/grpo_tools.md): multiply two numbers.

    prompt:  [{"role": "user", "content": "37 * 58"}]      answer: "2146"

Half the products are of two one-digit numbers (a table `tiny` can learn by heart), half of two two-digit
numbers (which it cannot: too many to memorise, and no long multiplication in 16 tokens). `calculator` is the
tool (`--tools data/calculator.py:calculator`); `correct` scores the final answer (TRL's reward-function form:
the completion as its messages, the `answer` column), and `useful_call` marks the completions that got the
answer right through a call that worked (a metric: --reward-weights 1 0 logs it without rewarding it).
"""

import ast
import operator
import re

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and *.

    Args:
        expression: the expression, e.g. "37 * 58"
    """

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not an integer expression: {expression!r}")

    return str(value(ast.parse(expression.strip(), mode="eval").body))


def final_text(completion):
    """The text of the last answer: a chat completion's last assistant message, or the string itself."""
    if isinstance(completion, str):
        return completion
    return next((m["content"] for m in reversed(completion) if m["role"] == "assistant"), "")


def answered(text):
    """The integer a final answer gives: its last number (None without one)."""
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def correct(completions, answer, **kwargs):
    """1.0 where the final answer's last number is the product, else 0.0."""
    return [float(answered(final_text(c)) == int(a)) for c, a in zip(completions, answer)]


def useful_call(completions, answer, **kwargs):
    """1.0 where the completion called a tool, the call worked (its result is not an error) and the final
    answer is right; else 0.0."""
    out = []
    for c, a in zip(completions, answer):
        results = [m["content"] for m in c if m["role"] == "tool"] if isinstance(c, list) else []
        worked = bool(results) and not any(r.startswith("{'error'") for r in results)
        out.append(float(worked and answered(final_text(c)) == int(a)))
    return out


# Metrics by the size of the numbers (--reward-weights 0: logged, not rewarded): None where a prompt is of
# the other size, so that rewards/<fn>/mean averages over that size's prompts alone (TRL's nanmean)
def two_digit(prompt):
    """Whether a prompt (its chat, or text) multiplies two-digit numbers."""
    text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
    return int(re.findall(r"\d+", text)[0]) >= 10


def called(completion):
    return isinstance(completion, list) and any(m["role"] == "tool" for m in completion)


def correct_two_digit(prompts, completions, answer, **kwargs):
    """`correct` on the two-digit products (None on the others)."""
    return [s if two_digit(p) else None for p, s in zip(prompts, correct(completions, answer))]


def correct_one_digit(prompts, completions, answer, **kwargs):
    """`correct` on the one-digit products (None on the others)."""
    return [s if not two_digit(p) else None for p, s in zip(prompts, correct(completions, answer))]


def calls_two_digit(prompts, completions, **kwargs):
    """1.0 where a completion called a tool, on the two-digit products (None on the others)."""
    return [float(called(c)) if two_digit(p) else None for p, c in zip(prompts, completions)]


def calls_one_digit(prompts, completions, **kwargs):
    """1.0 where a completion called a tool, on the one-digit products (None on the others)."""
    return [float(called(c)) if not two_digit(p) else None for p, c in zip(prompts, completions)]
