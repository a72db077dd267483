r"""GRPO with tools: the policy calls Python functions mid-completion, over several turns (TRL's GRPOTrainer(tools=…)).

Shao et al. 2024 (DeepSeekMath), with DAPO's (Yu et al. 2025) and Dr. GRPO's (Liu et al. 2025) aggregations; the
tools, their chat format and the multi-turn sampler. A whole file: the loss, advantages and update are grpo.py's,
copied (tests/test_layout.py pins each copy to grpo.py's), so that a fork of this file needs no other algorithm.
    python grpo_tools.py --model runs/sft…/model --dataset tasks.jsonl --tools my_tools.py:search my_tools.py:lookup \
        --reward-fn my_checks.py:correct --max-tool-calls 4
Offline, the calculator task (data/calculator.py) from an SFT start (docs/grpo_tools.md has that command):
    python grpo_tools.py --model runs/sft…/model --max-steps 100 --batch-size 64 --learning-rate 1e-4 \
        --max-prompt-length 64 --response-length 96 --lr-scheduler-type constant_with_warmup
"""

import functools
import inspect
import json
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple, get_origin, get_type_hints

import plumbing  # the run shell: shared flags, Run, the exit boundary (instant to import)

# `python grpo_tools.py --help`: from Args' source, before the imports below
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (mesh, models, data files, the scorer)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


@dataclass
class Args(plumbing.RolloutArgs):
    """The shared flags (plumbing.RolloutArgs: model, dtype, mesh, prompts, lengths, outputs, …) plus GRPO's
    and the tools'; the bundled calculator task by default."""

    # data
    dataset: str = os.path.join(common.HERE, "data", "calculator", "prompts_train.jsonl")
    """prompts as chats (`prompt`: a message list, the tools described in its system turn as the template
    does) and the columns the reward functions read: .jsonl/.json/.parquet or a Hugging Face dataset"""
    eval_dataset: str = os.path.join(common.HERE, "data", "calculator", "prompts_eval.jsonl")
    """held-out prompts answered greedily, tools and all, before the first step and after the last (and
    every --eval-every steps); "" for none; another --dataset without one named: none"""
    eval_every: int = 0
    """evaluate every N steps as well (0: at the start and the end only)"""
    # rewards
    reward_fn: tuple[str, ...] = (
        os.path.join(common.HERE, "data", "calculator.py") + ":correct",
        os.path.join(common.HERE, "data", "calculator.py") + ":useful_call",
    )
    """one or more `path.py:function`, TRL's f(prompts, completions, **columns): `completions` are each
    completion's messages (assistant turns with their tool_calls, tool results), as TRL passes them"""
    reward_weights: tuple[float, ...] = (1.0, 0.0)
    """weight of each --reward-fn in the summed reward (the bundled useful_call: 0, a metric only)"""
    reward_model: str | None = None
    """reward.py's `model/` dir: its score on the last real token is the reward"""
    # rollouts
    num_generations: int = 8
    """G: completions sampled per prompt (one group); --batch-size counts completions: B/G prompts a step"""
    stop_token: tuple[str, ...] = ()
    """more tokens a completion ends at (a token's text or id), besides EOS and the chat's turn end"""
    # tools
    tools: tuple[str, ...] = (os.path.join(common.HERE, "data", "calculator.py") + ":calculator",)
    """`path.py:function` each (TRL's tools=[…]): described to the model by its signature and docstring;
    `--tools` with none: the same GRPO without tools (a call is then just text)"""
    max_tool_calls: int | None = None
    """tool turns per completion, each running every call of one model turn (TRL's max_tool_calling_iterations,
    default None: until a turn calls nothing or --response-length is spent)"""
    tool_timeout: float = 10.0
    """seconds a call may run; past them it is stopped and the model gets an error result"""
    # optimisation
    num_iterations: int = 1
    """μ: optimisation passes over each generation batch (>1 keeps the rollout log-probs as π_old)"""
    num_mini_batches: int = 1
    """mini-batches per pass (each a whole number of groups is not required: advantages are fixed first)"""
    # algorithm
    beta: float = 0.0
    """β: weight of the k3 KL to the reference (TRL: 0.0, DeepSeekMath: 0.04); 0: no reference model"""
    epsilon: float = 0.2
    """ε: ratio clip, lower side (and upper side unless --epsilon-high is given)"""
    epsilon_high: float | None = None
    """ε_high: upper ratio clip (DAPO's clip-higher: 0.28)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """advantage scale: `group` (÷ group std, GRPO), `batch` (÷ batch std), `none` (Dr. GRPO: no division)"""
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = "dapo"
    """aggregation of the per-token loss, docs/grpo.md (5): `dapo` ÷ the batch's tokens, `grpo` sequence means'
    mean, `dr_grpo` ÷ B × response_length (grpo.py's other objectives: one function each there to copy)"""
    mask_truncated_completions: bool = False
    """leave completions that never stopped out of the loss (DAPO's overlong filtering)"""
    accept_reward: float | None = None
    """rejection-sampling fine-tuning instead of Â (RFT, Yuan et al. 2023; RAFT): Â 1 for a completion whose
    reward reaches it, the rest out of the loss: SFT on the accepted transcripts' own tokens; None: GRPO"""
    # logging and outputs
    export_hf: bool = False
    """also write the final model as a Hugging Face checkpoint, tokenizer and chat template in <output-dir>/model_hf/"""


# ---- Tools: loaded by path, described by their signatures, run on the host with a time limit
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool_schema(fn, flag="--tools"):
    """{"type": "function", "function": {name, description, parameters}}: what transformers' get_json_schema
    makes of fn (the docstring's text before `Args:` and its `name: text` lines, the type hints; parameters
    without a default are required) and chat templates render; a UsageError without docstring or hints."""
    summary, _, documented = (inspect.getdoc(fn) or "").partition("\nArgs:")
    if not summary.strip():
        raise common.UsageError(f"{flag} {common.described(fn)}: no docstring, the model's description of it")
    hints = get_type_hints(fn)
    notes = dict(re.findall(r"^\s*(\w+)(?:\s*\(.*?\))?:\s*(.+)$", documented.split("\nReturns:")[0], re.M))
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.name not in hints:
            raise common.UsageError(f"{flag} {common.described(fn)}: parameter {p.name!r} has no type hint")
        kind = JSON_TYPES.get(get_origin(hints[p.name]) or hints[p.name], "string")
        properties[p.name] = {"type": kind, **({"description": notes[p.name]} if p.name in notes else {})}
        required += [p.name] if p.default is p.empty else []
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": summary.strip(),
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


class ToolTimeout(BaseException):
    """Raised into a call past --tool-timeout (a BaseException: a tool's own `except Exception` lets it by)."""


def call_with_time_limit(fn, arguments, seconds):
    """fn(**arguments), stopped after `seconds`: an async fn under asyncio.wait_for; a plain one by SIGALRM
    (Unix, main thread: it interrupts Python code and sleeps, not a C call that never returns to Python)."""
    if inspect.iscoroutinefunction(fn):
        import asyncio

        try:
            return asyncio.run(asyncio.wait_for(fn(**arguments), seconds))
        except asyncio.TimeoutError:
            raise ToolTimeout(f"timed out after {seconds:g} s") from None
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        return fn(**arguments)  # no alarm off the main thread: no limit

    def expire(signum, frame):
        raise ToolTimeout(f"timed out after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(**arguments)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Toolbox:
    """The tools by name: `text, failed = toolbox(name, arguments)`. A call that raises, returns neither text
    nor a number, or runs past `timeout` seconds gives the model TRL's error result, str({"error": message}),
    and counts as failed; the first failure of each tool is reported once (stderr), with its file and line."""

    def __init__(self, fns, timeout):
        self.fns = {f.__name__: f for f in fns}
        self.schemas = [tool_schema(f) for f in fns]
        self.types = {s["function"]["name"]: s["function"]["parameters"]["properties"] for s in self.schemas}
        self.timeout = timeout
        self.reported = set()

    def __call__(self, name, arguments):
        if name not in self.fns:  # TRL's message for a name it does not know
            return self.failed(name, f"Tool {name} not found.", "was called but is not a --tools function")
        try:
            result = call_with_time_limit(self.fns[name], arguments, self.timeout)
        except (Exception, ToolTimeout) as e:
            import traceback

            where = traceback.extract_tb(e.__traceback__)[-1]  # the innermost frame: where in the tool
            said = (
                f"ran past --tool-timeout {self.timeout:g} s {e}"
                if isinstance(e, ToolTimeout)
                else f"raised {type(e).__name__}: {e}"
            )
            return self.failed(name, str(e), f"{said} (at {where.filename}:{where.lineno})")
        if not isinstance(
            result, (str, int, float)
        ):  # TRL passes str(result); here a None, list, … is caught
            return self.failed(
                name, f"returned {type(result).__name__}, not text", f"returned {result!r:.60}"
            )
        return str(result), False

    def failed(self, name, error, report):
        if name not in self.reported:
            from tqdm import tqdm  # on a line of its own, above the progress bar

            self.reported.add(name)
            tqdm.write(
                f"warning: tool {common.described(self.fns[name]) if name in self.fns else repr(name)} {report}: "
                f"the model gets {str({'error': error})!r} and the run goes on; failures are counted in "
                "tools/failure_frequency (each tool's first is reported)",
                sys.stderr,
            )
        return str({"error": error}), True


# ---- How a chat template writes tools: their description, a call read, the results (ToolFormat per template)
class ToolFormat(NamedTuple):
    system: Callable  # schemas -> the text of the system turn that describes the tools (None: the template has none)
    parse: Callable  # (a model turn's text, {tool: parameter types}) -> [(name, arguments)] ([]: no call; None: malformed)
    results: Callable  # [result texts] -> the turn that carries them back, between the model's turns


def parse_python_calls(text, types):
    """Gemma's form, `[name(key=value, …), …]` with literal values -> [(name, {key: value})]."""
    import ast

    if not re.match(r"\s*\[\s*[A-Za-z_]\w*\(", text):
        return []
    try:
        node = ast.parse(text.strip(), mode="eval").body
        return [
            (c.func.id, {k.arg: ast.literal_eval(k.value) for k in c.keywords})
            for c in node.elts
            if not c.args
        ] or None
    except (SyntaxError, ValueError, AttributeError):
        return None


def parse_xml_calls(text, types):
    """Qwen 3.5's form, <tool_call><function=name><parameter=key>value</parameter>…</function></tool_call>
    -> [(name, {key: value})], each value read by its parameter's JSON type (text as it stands)."""
    found = re.findall(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", text, re.S)
    calls = []
    for name, body in found:
        arguments = {}
        for key, value in re.findall(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", body, re.S):
            kind = types.get(name, {}).get(key, {}).get("type", "string")
            try:
                arguments[key] = value if kind == "string" else json.loads(value)
            except json.JSONDecodeError:
                arguments[key] = value
        calls.append((name, arguments))
    return calls or (None if "<tool_call>" in text else [])


# Qwen 3.5's chat template: the system turn that describes the tools, word for word (its tokenizer_config.json)
QWEN3_5_TOOLS = (
    "# Tools\n\nYou have access to the following functions:\n\n<tools>{}\n</tools>\n\nIf you choose to call a "
    "function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value "
    "for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> "
    "block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You "
    "may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT "
    "after\n- If there is no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>"
)
FORMATS = {
    # Gemma 1-3: no tool tokens and no tool role in the template. The call as Google's function-calling guide
    # prompts for it, `[name(key=value)]`, the whole model turn; the result back in a user turn, a ```tool_output
    # block as Gemma 3's tool_code examples write it. The tools' description is the prompt's to give (none added)
    "gemma": ToolFormat(
        system=lambda schemas: None,
        parse=parse_python_calls,
        results=lambda texts: (
            "<start_of_turn>user\n"
            + "\n".join(f"```tool_output\n{t}\n```" for t in texts)
            + "<end_of_turn>\n"
        ),
    ),
    # Qwen 3.5: its template's XML calls (<tool_call> … </tool_call>, then the turn end), the results as a user
    # turn of <tool_response> blocks, the tools described first in the system turn (QWEN3_5_TOOLS)
    "qwen3.5": ToolFormat(
        system=lambda schemas: QWEN3_5_TOOLS.format(
            "".join("\n" + json.dumps(s, ensure_ascii=False) for s in schemas)
        ),
        parse=parse_xml_calls,
        results=lambda texts: (
            "<|im_start|>user"
            + "".join(f"\n<tool_response>\n{t}\n</tool_response>" for t in texts)
            + "<|im_end|>\n"
        ),
    ),
}


def tool_format(template, flag="--tools"):
    """The ToolFormat of the template (CHAT_TEMPLATES' entry), a UsageError for one without."""
    name = next((k for k, v in common.CHAT_TEMPLATES.items() if v == template), None)
    if name not in FORMATS:
        raise common.UsageError(
            f"{flag}: the chat template {name or '(none)'} has no tool format here ({', '.join(FORMATS)}: "
            "pass --chat-template)"
        )
    return FORMATS[name]


def read_tool_prompts(path, template, fmt, schemas, flag="--dataset", config=None, split="train"):
    """Chat prompts (TRL's conversational rows) rendered to open the model's turn, the tools described as the
    template does (Qwen 3.5: a system turn of its own, or the start of the given one) -> (prompts, rows)."""
    rows = common.read_rows(path, flag, config, split)
    system, prompts = fmt.system(schemas), []
    for row, line in rows:
        messages = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(messages, list):
            raise common.UsageError(
                f"{path}:{line}: with --tools, 'prompt' must be a chat (a list of {{role, content}})"
            )
        if system:  # the tools' system turn, a given one's text after it
            given = messages[:1] if messages and messages[0].get("role") == "system" else []
            messages = [
                {
                    "role": "system",
                    "content": "\n\n".join([system] + [str(m["content"]).strip() for m in given]),
                }
            ] + messages[len(given) :]
        prompts.append(common.prompt_text({"prompt": messages}, f"{path}:{line}", template))
    return prompts, [row for row, _ in rows]


# ---- Data: prompt texts -> left-padded query ids [N, Q] (grpo.py's)
def tokenize_prompts(prompts, tokenizer, max_prompt_length):
    """-> (queries [N, Q] left-padded, query_mask [N, Q]), Q a multiple of 8."""
    ids = [[tokenizer.start_token_id] + list(x) for x in tokenizer.tokenize(prompts)]
    ids = [x[:1] + x[1:][-(max_prompt_length - 1) :] for x in ids]  # cut from the left, BOS kept
    q = min(max_prompt_length, 8 * math.ceil(max(len(x) for x in ids) / 8))
    queries, mask = np.zeros((len(ids), q), np.int32), np.zeros((len(ids), q), bool)
    for i, x in enumerate(ids):  # left padding: every prompt ends at column Q-1, responses start at Q
        queries[i, q - len(x) :], mask[i, q - len(x) :] = x, True
    return queries, mask


# ---- ALGO LOGIC: the multi-turn sampler. State: tokens, mask [B, S] (S = Q + R: prompt, then the turns, the
# tool results between them, and holes: positions no key may see), sampled, logqs [B, R] (the policy's own
# tokens and their log q), the KV cache, the final hidden state of position t, t, done [B] (a row's turn has ended)
def start(backbone, params, frozen, queries, query_mask, *, response_length, pad_id, group=1):
    """The prompts' prefill: left-padded queries [B, Q] -> the state, t = Q, the hidden state the first token
    is drawn from.
    group: the rows are B/group prompts, each `group` times in a row: each prefilled once (grpo.generate's)."""
    b, q = queries.shape
    mask = jnp.concatenate([query_mask, jnp.zeros((b, response_length), bool)], 1)  # [B, S]
    with common.weights(backbone, params, frozen):
        cache = common.empty_cache(backbone, b // group, q + response_length)
        hidden, cache = jax.tree.map(  # a group's prompt once, copied to its rows
            lambda x: jnp.repeat(x, group, 0),
            common.cached_forward(
                backbone, queries[::group], mask[::group], cache, 0, last=True, hidden=True
            ),
        )
    return {
        "tokens": jnp.concatenate([queries, jnp.full((b, response_length), pad_id, jnp.int32)], 1),
        "mask": mask,
        "sampled": jnp.zeros((b, response_length), bool),
        "logqs": jnp.zeros((b, response_length)),
        "cache": cache,
        "hidden": hidden[:, -1],  # [B, D]
        "t": jnp.int32(q),
        "done": jnp.zeros((b,), bool),
    }


def draw(backbone, h, key, temperature):
    """A token [B] from final hidden states h [B, D] (inside common.weights) and its log q [B]:
    q = softmax(logits / T), jax.random.categorical's draw (common.categorical: grpo.generate's); T = 0: the
    arg-max (log q 0)."""
    if temperature == 0:
        return jnp.argmax(common.logits(backbone, h), -1).astype(jnp.int32), jnp.zeros(h.shape[:1])
    return common.categorical(backbone, h, key, temperature)


def sample_turn(backbone, params, frozen, state, key, *, temperature, stop_ids, pad_id):
    """One model turn of each row not done: a token a step, fed through the model at once (its key and value
    join the cache), until every row has sampled a stop token or S is reached; a done row writes a hole (pad,
    masked) -> the state. A key split a step, as grpo.generate: its tokens for a key, in the first turn."""
    s, r = state["tokens"].shape[1], state["sampled"].shape[1]
    put = lambda x, new, at: jax.lax.dynamic_update_slice_in_dim(x, new[:, None].astype(x.dtype), at, 1)

    def step(carry):
        st, key = carry
        key, sample_key = jax.random.split(key)
        active, t = ~st["done"], st["t"]
        with common.weights(backbone, params, frozen):
            token, logq = draw(backbone, st["hidden"], sample_key, temperature)
            token = jnp.where(active, token, pad_id)
            mask = put(st["mask"], active, t)  # the token is a key for later positions where a row sampled it
            hidden, cache = common.cached_forward(backbone, token[:, None], mask, st["cache"], t, hidden=True)
        return {
            "tokens": put(st["tokens"], token, t),
            "mask": mask,
            "sampled": put(st["sampled"], active, t - (s - r)),
            "logqs": put(st["logqs"], jnp.where(active, logq, 0.0), t - (s - r)),
            "cache": cache,
            "hidden": hidden[:, -1],
            "t": t + 1,
            "done": st["done"] | jnp.isin(token, jnp.asarray(stop_ids)),
        }, key

    return jax.lax.while_loop(lambda c: (c[0]["t"] < s) & ~c[0]["done"].all(), step, (state, key))[0]


def append(backbone, params, frozen, state, ids, ids_mask):
    """Tool results into the cache: ids [B, W] (each row's bridge right-aligned, pad before it; ids_mask True on
    its tokens) go to positions t…t+W-1 in one cached forward, a prefill: the context is not recomputed. Rows
    without a bridge stay done; the others sample again from the bridge's last token's hidden state."""
    t = state["t"]
    mask = jax.lax.dynamic_update_slice_in_dim(state["mask"], ids_mask, t, 1)
    with common.weights(backbone, params, frozen):
        hidden, cache = common.cached_forward(backbone, ids, mask, state["cache"], t, last=True, hidden=True)
    return {
        **state,
        "tokens": jax.lax.dynamic_update_slice_in_dim(state["tokens"], ids, t, 1),
        "mask": mask,
        "cache": cache,
        "hidden": hidden[:, -1],
        "t": t + ids.shape[1],
        "done": ~ids_mask.any(1),
    }


class Transcript(NamedTuple):
    messages: list  # each completion's turns: TRL's assistant messages (with tool_calls) and tool messages
    failures: np.ndarray  # [B] tool calls that failed (the calls: the assistant messages' tool_calls)


def rollout(
    fns,
    params,
    frozen,
    queries,
    query_mask,
    *,
    key,
    tools,
    fmt,
    bridge,
    tokenizer,
    max_tool_calls,
    turn_end_id,
    on_data,
):
    """Multi-turn completions of host queries [B, Q]: a turn (fns["turn"]), then on the host each turn that ended at
    the template's turn end is parsed; its calls run (`tools`; none: a call is text), their results go into the cache
    (fns["append"], `bridge`: results -> text) and the rows sample again; until no row calls, --max-tool-calls
    rounds, or R is spent (a result that does not fit is dropped, as TRL drops it) -> (batch, Transcript)."""
    # differs from grpo.py's: turns with tool calls between them; the batch marks the policy's own tokens
    qb = common.bucket_length(int(query_mask.sum(1).max()), queries.shape[1])
    qs, qm = common.put_global(queries[:, -qb:], on_data), common.put_global(query_mask[:, -qb:], on_data)
    state = fns["start"](params, frozen, qs, qm)
    b, s = queries.shape[0], qb + state["sampled"].shape[1]
    begin = np.full(b, qb)  # where each row's current turn starts
    rows = np.arange(b)  # the rows whose turn is being sampled
    messages = [[] for _ in range(b)]
    failures = np.zeros(b, int)  # [B] failed tool calls
    for rounds in range(s):
        key, turn_key = jax.random.split(key)
        state = fns["turn"](params, frozen, state, turn_key)
        t = int(state["t"])
        tokens, sampled = (common.to_host(state[k]) for k in ("tokens", "sampled"))
        ids = [tokens[i, begin[i] : t][sampled[i, begin[i] - qb : t - qb]] for i in rows]  # the turn's tokens
        ended = [len(x) > 0 and x[-1] == turn_end_id for x in ids]
        texts = decode(tokenizer, [x[:-1] if e else x for x, e in zip(ids, ended)])
        room = s - 1 - t  # positions left for a bridge and at least one token after it
        bridges = {}  # row -> the ids that carry its results back
        for i, text, e in zip(rows, texts, ended):
            found = fmt.parse(text, tools.types) if tools.fns and e else []
            if found == [] or (max_tool_calls is not None and rounds >= max_tool_calls):
                messages[i].append({"role": "assistant", "content": text})
            else:
                found = found or [("(malformed)", None)]  # None: the turn opened a call it did not close
                results = [
                    tools(n, a)
                    if a is not None
                    else tools.failed(n, "could not parse the call", "was malformed")
                    for n, a in found
                ]
                failures[i] += sum(failed for _, failed in results)
                messages[i].append(
                    {
                        "role": "assistant",
                        "content": text,
                        "tool_calls": [
                            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in found
                        ],
                    }
                )
                x = list(tokenizer.tokenize(bridge([r for r, _ in results])))
                if len(x) <= room:  # else TRL drops the results: the completion ends with its call
                    messages[i] += [
                        {"role": "tool", "name": n, "content": r} for (n, _), (r, _) in zip(found, results)
                    ]
                    bridges[i] = x
        rows = list(bridges)
        if not bridges:
            break
        w = min(8 * -(-max(map(len, bridges.values())) // 8), room)  # a multiple of 8: few compilations
        ids, ids_mask = np.zeros((b, w), np.int32), np.zeros((b, w), bool)
        for i, x in bridges.items():  # right-aligned: every row's next token goes to position t + w
            ids[i, w - len(x) :] = x
            ids_mask[i, w - len(x) :] = True
        state = fns["append"](
            params, frozen, state, common.put_global(ids, on_data), common.put_global(ids_mask, on_data)
        )
        begin[rows] = t + w
    return {
        "query_responses": state["tokens"],
        "padding_mask": state["mask"],
        "response_mask": state["sampled"],  # the policy's own tokens: the loss, KL, entropy and meter's
        "sampled_mask": state["sampled"],
        "sampler_logps": state["logqs"],
    }, Transcript(messages, failures)


def decode(tokenizer, ids):
    """Token id arrays -> their texts (an empty one: "")."""
    # differs from grpo.py's: any id arrays (a turn's, before its parse), not a batch's responses
    return [
        t.decode() if isinstance(t, bytes) else str(t)
        for t in tokenizer.detokenize([list(map(int, x)) for x in ids])
    ]


# ---- ALGO LOGIC: the update's log-probs (a forward on query + response), Â, the k3 KL, the objective
def response_logps(backbone, params, frozen, token_ids, padding_mask, *, context_length, temperature):
    """log q(response token) and q's entropy, q = softmax(logits / T), [B, R] each, float32, and the forward's
    aux_loss (a mixture of experts' router loss, common.forward; 0.0 dense). Position t predicts t+1:
    response token Q+i is scored by hidden[Q+i-1]; the [B, R, V] logits come --logits-chunk positions at a
    time (common.per_token), never whole."""
    # differs from grpo.py's: no sampling filters (grpo.py's filtered_logps without them, written out)
    hidden, aux_loss = common.forward(backbone, params, frozen, token_ids, padding_mask)  # [B, T, D], scalar

    def chunk(h, y):  # [B, C, D], [B, C] -> log q [B, C], entropy [B, C]
        scaled = common.logits(backbone, h) / temperature  # [B, C, V], float32
        logz = jax.nn.logsumexp(scaled, -1)
        token_logit = jnp.take_along_axis(scaled, y[..., None], -1)[..., 0]
        return token_logit - logz, logz - jnp.sum(jax.nn.softmax(scaled, -1) * scaled, -1)

    with common.weights(backbone, params, frozen):  # the output layer's weights, from `params`
        logps, entropy = common.per_token(  # hidden [B, R, D], labels [B, R]
            backbone, chunk, (hidden[:, context_length - 1 : -1], token_ids[:, context_length:])
        )
    return logps, entropy, aux_loss


def masked_mean(x, mask):
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(mask.sum(), 1)


def mismatch(logps, sampler_logps, mask):
    """The meter: ρ = π_trainer / q_sampler on the sampled tokens (mask [B, R]), the first forward of the
    weights that sampled against the sampler's own log q: 1 to float rounding (unfiltered: the kept mass)."""
    ratio = jnp.exp(logps - sampler_logps)  # [B, R]
    real = lambda x: jnp.where(mask, x, 1.0)  # padding as a ratio of 1: out of the max and the min
    return {
        "mismatch/ratio_mean": masked_mean(ratio, mask),
        "mismatch/ratio_max": real(ratio).max(),
        "mismatch/ratio_min": real(ratio).min(),
        "mismatch/frac_outside_10pct": masked_mean(abs(ratio - 1.0) > 0.1, mask),
    }  # outside [0.9, 1.1]


def group_advantages(rewards, num_generations, scale_rewards="group", eps=1e-4):
    """Â_i = (r_i − mean(group)) / (std(group) + ε) (eq. 2), rewards [B]: B/G groups of G consecutive rows;
    std with Bessel's correction (TRL's); `batch`: ÷ all B's std, `none`: no division (Dr. GRPO) -> (Â [B],
    std [B/G]); an all-equal group gets Â = 0."""
    grouped = rewards.reshape(-1, num_generations)  # [B/G, G]
    std = grouped.std(1, ddof=1)  # [B/G]
    centred = grouped - grouped.mean(1, keepdims=True)  # [B/G, G]
    scale = {"group": std[:, None] + eps, "batch": rewards.std(ddof=1) + eps, "none": 1.0}[scale_rewards]
    return (centred / scale).reshape(-1), std


def rft_advantages(rewards, accept_reward):
    """Rejection sampling: rewards [B] -> (Â [B]: 1 where the reward reaches accept_reward, else 0; accepted
    [B] bool). With the rest out of the loss, one on-policy update (ratio 1) is SFT's token-mean NLL step on
    the accepted completions: no baseline, no negative gradient."""
    accepted = np.asarray(rewards) >= accept_reward
    return accepted.astype(np.float32), accepted


def k3_kl(logps, ref_logps):
    """Per-token KL(π ‖ π_ref) estimate k3 = π_ref/π − log(π_ref/π) − 1 (Schulman 2020; eq. 4): ≥ 0,
    unbiased on tokens sampled from π, lower variance than k1 = log π − log π_ref."""
    log_ratio = ref_logps - logps  # log(π_ref / π)
    return jnp.expm1(log_ratio) - log_ratio


def share(x, mask):
    """The share of real tokens where x holds (x [B, R]), or at sequence level (x [B, 1]) of the B
    completions."""
    return masked_mean(x, mask) if x.shape == mask.shape else jnp.mean(x)  # TRL counts all B completions


def clipped_surrogate(ratio, advantages, mask, epsilon, epsilon_high):
    """GRPO's policy term (eq. 3), PPO's pessimistic clip: −min(ρÂ, clip(ρ, 1 − ε, 1 + ε_high)Â) per token
    [B, R] (per completion [B, 1] at GSPO's sequence level: its real tokens share it) -> (the term, clip
    shares)."""
    per_token = -jnp.minimum(
        ratio * advantages, jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high) * advantages
    )
    low = (ratio < 1.0 - epsilon) & (advantages < 0)  # clipped from below: the clip only removes gradient
    high = (ratio > 1.0 + epsilon_high) & (advantages > 0)  # clipped from above
    metrics = {"clip_ratio/low_mean": share(low, mask), "clip_ratio/high_mean": share(high, mask)}
    return per_token, {**metrics, "clip_ratio": share(low | high, mask)}


def sequence_mean(per_token, mask):
    """GRPO's aggregation (eq. 5): each completion's mean over its real tokens, then the mean over
    completions."""
    return jnp.mean(jnp.where(mask, per_token, 0.0).sum(1) / jnp.maximum(mask.sum(1), 1))


def grpo_loss(
    logps, old_logps, ref_logps, advantages, mask, *, epsilon, epsilon_high, beta, loss_type="grpo"
):
    """GRPO's objective (Shao et al. 2024) -> (loss, metrics): on each real token of completion i, the clipped
    surrogate of ρ = π_θ/π_old times Â_i (eq. 3) plus β × the k3 estimate of KL(π_θ ‖ π_ref) (eq. 4),
    aggregated by loss_type (AGGREGATIONS: eq. 5, DAPO's, Dr. GRPO's). logps, old_logps, ref_logps
    (None: β 0), mask [B, R]; advantages [B]."""
    # differs from grpo.py's: the paper's policy term and three aggregations only (grpo.py's CISPO, SAPO, VESPO,
    # LUSPO, GSPO's sequence level and the entropy options are each one function there)
    log_ratio = jnp.where(mask, logps - old_logps, 0.0)  # log ρ [B, R]; padding may hold anything
    # one update a batch: π_old = sg(π_θ), ratio 1; Â [B, 1]: every token of a completion shares it
    per_token, metrics = clipped_surrogate(
        jnp.exp(log_ratio), advantages[:, None], mask, epsilon, epsilon_high
    )
    if beta:  # on every real token
        kl = k3_kl(logps, ref_logps)  # [B, R]
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl, mask)
    return AGGREGATIONS.get(loss_type, token_mean)(per_token, mask), metrics


def token_mean(per_token, mask):
    """DAPO (Yu et al. 2025, eq. 5): every real token of the batch weighs the same (BNPO, CISPO, VESPO too)."""
    return jnp.where(mask, per_token, 0.0).sum() / jnp.maximum(mask.sum(), 1)


AGGREGATIONS = {  # per-token losses [B, R] -> the loss; masked tokens never count; the rest (dapo): token_mean
    "grpo": sequence_mean,
    "dr_grpo": lambda x, mask: jnp.where(mask, x, 0.0).sum() / mask.size,  # Dr. GRPO (Liu et al. 2025): ÷ B·R
}


def rollout_logps(backbone, params, ref_params, frozen, batch, *, context_length, temperature):
    """π_old's and π_ref's log-probs of a finished generation batch, of logits / T; an entry is left out where
    its params are None."""
    # differs from grpo.py's: no sampling filters, so π_old and π_ref are one call
    given = {"old_logps": params, "ref_logps": ref_params}
    return {
        k: response_logps(
            backbone,
            p,
            frozen,
            batch["query_responses"],
            batch["padding_mask"],
            context_length=context_length,
            temperature=temperature,
        )[0]
        for k, p in given.items()
        if p is not None
    }


# ---- train_step: one update of the policy on a (mini-)batch of completions
def train_step(backbone, optimizer, args, state, frozen, *, batch, context_length):
    """state = (params, opt_state); batch: query_responses / padding_mask [B, Q+R], response_mask [B, R] (the loss's
    tokens), advantages [B]; old_logps / ref_logps [B, R] if made at rollout; sampler_logps and sampled_mask
    [B, R] (the policy's own tokens) if its weights'."""
    # differs from grpo.py's: the mismatch meter over sampled_mask (the tool results in the context are not sampled)
    params, opt_state = state

    def loss_fn(p):
        logps, entropy, aux_loss = response_logps(
            backbone,
            p,
            frozen,
            batch["query_responses"],
            batch["padding_mask"],
            context_length=context_length,
            temperature=args.temperature,
        )
        loss, metrics = grpo_loss(
            logps,
            batch.get("old_logps", jax.lax.stop_gradient(logps)),  # μ = 1: π_old = sg(π_θ), ratio 1
            batch.get("ref_logps"),
            batch["advantages"],
            batch["response_mask"],
            epsilon=args.epsilon,
            epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
            beta=args.beta,
            loss_type=args.loss_type,
        )
        if "sampler_logps" in batch:  # mismatch/*, over the policy's own tokens
            metrics.update(mismatch(logps, batch["sampler_logps"], batch["sampled_mask"]))
        # + the router load-balancing loss (a mixture of experts; 0.0 dense)
        return loss + aux_loss, {
            **metrics,
            "entropy": masked_mean(entropy, batch["response_mask"]),
            "aux_loss": aux_loss,
        }

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state), {**metrics, "train/loss": loss, "train/grad_norm": optax.global_norm(grads)}


# ---- main's pieces: flag checks, what a completion is for the rewards and metrics, the greedy evaluation
def check_args(args, mesh):
    """Inconsistent sizes, unsupported choices: stop before the model loads (--reward-weights against
    --reward-fn: common.load_scorer)."""
    plumbing.check_flags(
        num_mini_batches=(args.num_mini_batches, 1, False),
        num_iterations=(args.num_iterations, 1, False),
        temperature=(args.temperature, 0, True),
        max_tool_calls=(args.max_tool_calls, 0, False),
        tool_timeout=(args.tool_timeout, 0, True),
    )
    if args.num_generations < 2 or args.batch_size % args.num_generations:
        raise common.UsageError(
            f"--batch-size {args.batch_size} must be a multiple of --num-generations {args.num_generations} "
            "(≥ 2: a group of one has no relative advantage)"
        )
    if (
        args.batch_size % args.num_mini_batches
        or args.batch_size // args.num_mini_batches % mesh.shape["data"]
    ):
        raise common.UsageError(
            f"--batch-size {args.batch_size} must split into --num-mini-batches {args.num_mini_batches} "
            f"each divisible by the data axis ({mesh.shape['data']})"
        )
    common.check_sampler(args.model)  # a family whose decoder layers the sampler knows


def completions(batch, transcript, stop_ids):
    """On the host: (final answers: each completion's last assistant text, completion_ids: its real tokens, tool
    results included, before the final stop, lengths [B]: the policy's tokens less that stop, has_eos [B]:
    the last turn ended at a stop token)."""
    sampled = common.to_host(batch["response_mask"])
    tokens, real = (
        common.to_host(batch[k])[:, common.query_length(batch) :] for k in ("query_responses", "padding_mask")
    )
    last = sampled.shape[1] - 1 - np.argmax(sampled[:, ::-1], 1)  # the policy's last token
    has_eos = sampled.any(1) & np.isin(tokens[np.arange(len(tokens)), last], stop_ids)
    ids = [x[m][: m.sum() - e] for x, m, e in zip(tokens, real, has_eos)]
    texts = [
        next((m["content"] for m in reversed(ms) if m["role"] == "assistant"), "")
        for ms in transcript.messages
    ]
    return texts, ids, sampled.sum(1) - has_eos, has_eos


def tool_metrics(transcript, prefix=""):
    """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed ÷ calls), turns."""
    called = [m for ms in transcript.messages for m in ms if m["role"] == "assistant"]  # the model's turns
    calls = sum(len(m.get("tool_calls", ())) for m in called)
    return {
        f"{prefix}tools/call_frequency": calls / len(transcript.messages),
        f"{prefix}tools/failure_frequency": float(transcript.failures.sum() / calls) if calls else 0.0,
        f"{prefix}completions/mean_turns": len(called) / len(transcript.messages),
    }


def evaluate(fns, params, frozen, data, scorer, *, batch_size, end, stop_ids, path, **rollout_kwargs):
    """Greedy multi-turn completions of every eval prompt (batches of batch_size, the last padded with repeats),
    scored -> eval/reward, eval/rewards/<fn>/mean, the tool metrics and lengths; each prompt's row in `path`
    too (its columns, the completion's messages, each reward function's score: paired comparisons)."""
    prompts, rows, queries, query_mask = data
    n = len(prompts)
    done = []  # each batch's (transcript, lengths, scores)
    for begin in range(0, n, batch_size):
        idx = np.minimum(np.arange(begin, begin + batch_size), n - 1)
        batch, transcript = rollout(
            fns, params, frozen, queries[idx], query_mask[idx], key=jax.random.key(0), **rollout_kwargs
        )
        texts, ids, length, _ = completions(batch, transcript, stop_ids)
        scores, parts = scorer(
            [prompts[i] for i in idx],
            texts,
            batch,
            rows=[rows[i] for i in idx],
            completion_ids=ids,
            end=end,
            messages=transcript.messages,
        )
        done.append((transcript, length, common.to_host(scores), parts))
    transcripts, lengths, rewards, scored = zip(*done)  # the repeats are not scored: each cut at n below
    messages = [ms for t in transcripts for ms in t.messages][:n]  # each prompt's completion (TRL's messages)
    parts = {k: np.concatenate([x[k] for x in scored])[:n] for k in scored[0]}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    scores = [{k: None if np.isnan(v[i]) else float(v[i]) for k, v in parts.items()} for i in range(n)]
    with open(path, "w") as f:
        f.writelines(
            json.dumps({**row, "completion": c, "scores": s}) + "\n"
            for row, c, s in zip(rows, messages, scores)
        )
    failures = np.concatenate([t.failures for t in transcripts])[:n]
    return {
        "eval/reward": float(np.concatenate(rewards)[:n].mean()),
        **{f"eval/rewards/{k}/mean": float(np.nanmean(v)) for k, v in parts.items()},
        **tool_metrics(Transcript(messages, failures), "eval/"),
        "eval/completions/mean_length": float(np.concatenate(lengths)[:n].mean()),
    }


def main(args):
    # ---- set-up: every flag, file, tool and row checked before the models load ----
    run = plumbing.Run(__file__, args, eval_every=args.eval_every, export_hf=args.export_hf)
    check_args(args, run.mesh)
    template = common.chat_template(args.model, args.chat_template)
    fmt = tool_format(template)
    tools = Toolbox([common.load_reward_fn(spec, "--tools") for spec in args.tools], args.tool_timeout)
    prompts, rows = read_tool_prompts(
        args.dataset,
        template,
        fmt,
        tools.schemas,
        "--dataset",
        config=args.dataset_config,
        split=args.dataset_split,
    )
    eval_path, eval_split, eval_flag = common.eval_source(
        args.dataset, args.eval_dataset, None, (Args.dataset, Args.eval_dataset)
    )
    evals = (
        read_tool_prompts(eval_path, template, fmt, tools.schemas, eval_flag, split=eval_split)
        if eval_path
        else None
    )
    g, n_prompts = args.num_generations, args.batch_size // args.num_generations
    max_steps = run.resolve_max_steps(len(prompts), n_prompts)
    scorer = common.load_scorer(
        run.mesh,
        run.dtype,
        reward_model=args.reward_model,
        reward_fns=args.reward_fn,
        weights=args.reward_weights,
    )
    scorer.check_columns(rows)
    model = common.load_model(
        args.model, run.mesh, run.dtype, args.seed, logits_chunk=args.logits_chunk, **args.lora
    )
    backbone, tokenizer = model.backbone, model.preprocessor.tokenizer
    scorer.check_tokenizer(tokenizer)
    remat = plumbing.Remat(args.remat, backbone)
    queries, query_mask = tokenize_prompts(prompts, tokenizer, args.max_prompt_length)
    eval_data = (*evals, *tokenize_prompts(evals[0], tokenizer, args.max_prompt_length)) if evals else None
    r, pad = args.response_length, tokenizer.pad_token_id
    stops = common.stop_token_ids(tokenizer, template, args.stop_token)  # EOS, the turn end, --stop-token
    end = common.turn_end(template)
    bridge = lambda results: (
        template.end[template.end.index(end) + len(end) :] + fmt.results(results) + template.model
    )
    print(
        f"data: {len(prompts)} prompts, queries padded to ≤ {queries.shape[1]} tokens; {n_prompts} prompts × G={g} "
        f"completions of ≤ {r} positions a step (tool results included); {len(evals[0]) if evals else 0} eval "
        f"prompts; tools: {', '.join(tools.fns) or 'none'}"
        + (f", ≤ {args.max_tool_calls} tool turns each" if args.max_tool_calls is not None else "")
    )

    params, frozen = common.split_variables(backbone, frozen_dtype=run.frozen_dtype)
    params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=common.shardings(params))(params)
    ref_params = common.frozen_copy(params, run.frozen_dtype) if args.beta else None
    off_policy = args.num_iterations > 1 or args.num_mini_batches > 1
    optimizer, schedule, warmup = plumbing.make_optimizer(
        args, run.schedule_steps, updates_per_step=args.num_iterations * args.num_mini_batches
    )
    opt_state, opt_shardings = common.init_optimizer(optimizer, params, run.mesh)
    state_shardings = (common.shardings(params), opt_shardings)
    key, rng = jax.random.key(args.seed), np.random.default_rng(args.seed)
    order = np.concatenate(
        [rng.permutation(len(prompts)) for _ in range(max(1, -(-max_steps * n_prompts // len(prompts))))]
    )
    (params, opt_state, key_data), meta = run.resume(
        (params, opt_state, jax.random.key_data(key)), {"rng": rng.bit_generator.state}
    )
    key = jax.random.wrap_key_data(np.asarray(key_data))
    rng.bit_generator.state = meta["rng"]
    state = jax.device_put((params, opt_state), state_shardings)

    # the sampler: prefill, turns (sampled at --temperature, and greedy), tool results into the cache
    fns = {
        "start": jax.jit(functools.partial(start, backbone, response_length=r, pad_id=pad, group=g)),
        "turn": jax.jit(
            functools.partial(sample_turn, backbone, temperature=args.temperature, stop_ids=stops, pad_id=pad)
        ),
        "append": jax.jit(functools.partial(append, backbone)),
    }
    greedy = {  # the evaluation: a prompt a row, the arg-max
        **fns,
        "start": jax.jit(functools.partial(start, backbone, response_length=r, pad_id=pad)),
        "turn": jax.jit(
            functools.partial(sample_turn, backbone, temperature=0.0, stop_ids=stops, pad_id=pad)
        ),
    }
    logps_fn = jax.jit(
        lambda p, rp, f, b: rollout_logps(
            backbone, p, rp, f, b, context_length=common.query_length(b), temperature=args.temperature
        )
    )
    step_fn = remat.jit(
        lambda s, f, b: train_step(
            backbone, optimizer, args, s, f, batch=b, context_length=common.query_length(b)
        ),
        donate_argnums=0,
        out_shardings=(state_shardings, common.replicated(run.mesh)),
    )
    run.record(remat=remat, num_warmup_steps=warmup)
    on_data = jax.sharding.NamedSharding(run.mesh, jax.sharding.PartitionSpec("data"))
    turns = dict(
        tools=tools,
        fmt=fmt,
        bridge=bridge,
        tokenizer=tokenizer,
        max_tool_calls=args.max_tool_calls,
        turn_end_id=tokenizer.token_to_id(end),
        on_data=on_data,
    )
    n, n_rm = (plumbing.count_params(m.backbone) if m is not None else 0 for m in (model, scorer.model))
    score = lambda params: evaluate(
        greedy,
        params,
        frozen,
        eval_data,
        scorer,
        batch_size=args.batch_size,
        end=end,
        stop_ids=stops,
        path=os.path.join(run.dir, f"eval_completions_step{run.step}.jsonl"),  # prompt by prompt
        **turns,
    )
    if eval_data is not None and run.start == 0:
        run.log_eval(score(state[0]))  # step 0: the start, for the comparison

    # ---- the loop: rollout (turns, tool calls) -> rewards -> advantages -> update ----
    # FLOPs a token: 2N a forward (sampler, π_old, π_ref, reward model), 6N an update pass (docs/design.md)
    for step in run.steps(
        flops_per_token=2 * n * (1 + off_policy + (args.beta > 0)) + 2 * n_rm + args.num_iterations * 6 * n,
        learning_rate=lambda s: schedule(s * args.num_iterations * args.num_mini_batches),
        summed=("charts/generated_tokens",),
        show=("reward", "tools/call_frequency"),
    ):
        ticks = [time.perf_counter()]
        idx = np.repeat(order[step * n_prompts : (step + 1) * n_prompts], g)  # [B]
        key, gen_key = jax.random.split(key)  # rollout: G multi-turn completions of B/G prompts
        batch, transcript = rollout(
            fns, state[0], frozen, queries[idx], query_mask[idx], key=gen_key, **turns
        )
        ticks.append(plumbing.synced(batch))
        texts, ids, lengths, has_eos = completions(batch, transcript, stops)  # rewards: the whole completion
        scores, parts = scorer(
            [prompts[i] for i in idx],
            texts,
            batch,
            rows=[rows[i] for i in idx],
            completion_ids=ids,
            end=end,
            messages=transcript.messages,
        )
        rewards = common.to_host(scores)
        advantages, group_std = jax.device_get(group_advantages(jnp.asarray(rewards), g, args.scale_rewards))
        if args.mask_truncated_completions:  # DAPO: a cut-off completion is not judged at all
            batch["response_mask"] = batch["response_mask"] & common.put_global(has_eos[:, None], on_data)
        if args.accept_reward is not None:  # RFT: SFT on the accepted transcripts, the others out of the loss
            advantages, accepted = rft_advantages(rewards, args.accept_reward)
            batch["response_mask"] = batch["response_mask"] & common.put_global(accepted[:, None], on_data)
        batch["advantages"] = common.put_global(advantages, on_data)
        batch.update(logps_fn(state[0] if off_policy else None, ref_params, frozen, batch))  # π_old, π_ref
        meter = (  # mismatch/*, over the policy's own tokens: here, or in train_step
            mismatch(batch["old_logps"], batch.pop("sampler_logps"), batch["sampled_mask"])
            if "old_logps" in batch
            else {}
        )
        ticks.append(plumbing.synced(batch))
        updates = []
        for mb_idx in common.mini_batches(
            rng, args.batch_size, args.num_mini_batches, args.num_iterations, on_data
        ):
            state, metrics = step_fn(state, frozen, jax.tree.map(lambda x: x[mb_idx], batch))
            updates.append(metrics)
        run.log(
            {
                **plumbing.phase_metrics(updates, ticks, int((lengths + has_eos).sum())),
                **meter,
                **common.reward_metrics(rewards, parts, lengths, has_eos),
                **tool_metrics(transcript),
                "reward_std": float(np.mean(group_std)),
                "frac_reward_zero_std": float(np.mean(np.isclose(group_std, 0.0))),
                "charts/generate_compilations": float(fns["turn"]._cache_size()),
            },
            tokens=int(query_mask[idx].sum() + sum(len(x) for x in ids) + has_eos.sum()),
            padded=len(idx) * (common.query_length(batch) + r),
        )
        if args.sample_every and (step % args.sample_every == 0 or step + 1 == max_steps):
            print(
                f"step {step + 1} sample (reward {rewards[0]:.3f}): {prompts[idx[0]]!r} -> {json.dumps(transcript.messages[0])}"
            )
        if eval_data is not None and (
            run.eval_due() or step + 1 == max_steps
        ):  # --eval-every 0: the end only
            run.log_eval(score(state[0]))
        run.checkpoint((state[0], state[1], jax.random.key_data(key)), {"rng": rng.bit_generator.state})

    # ---- outputs: the policy (LoRA merged) as a KerasHub preset ----
    run.finish(lambda path: common.save_model(model, state[0], path))


if __name__ == "__main__":
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
