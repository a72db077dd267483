r"""GRPO with tools: the policy calls Python functions mid-completion, over several turns (TRL's GRPOTrainer(tools=…)).

grpo.py's loss, advantages and update, imported; here: the tools, their chat format and the multi-turn sampler.
    python grpo_tools.py --model runs/sft…/model --dataset tasks.jsonl --tools my_tools.py:search my_tools.py:lookup \
        --reward-fn my_checks.py:correct --max-tool-calls 4
Offline, the calculator task (data/calculator.py) from an SFT start (docs/grpo_tools.md has that command):
    python grpo_tools.py --model runs/sft…/model --max-steps 100 --batch-size 64 --learning-rate 1e-4 \
        --max-prompt-length 64 --response-length 96 --lr-scheduler-type constant_with_warmup
"""

import functools
import inspect
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import plumbing  # the run shell: shared flags, Run, the exit boundary (instant to import)

# `python grpo_tools.py --help`: from Args' source, before the imports below
plumbing.answer_help(__name__, __file__)

import common  # noqa: E402  (mesh, models, data files, the scorer)
import grpo  # noqa: E402  (the loss, advantages, update, sampling filters: grpo.py's, imported)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


@dataclass
class Args(grpo.Args):
    """grpo.py's flags (its loss, sampling, rewards) plus the tools'; the bundled calculator task by default."""

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
    # tools
    tools: tuple[str, ...] = (os.path.join(common.HERE, "data", "calculator.py") + ":calculator",)
    """`path.py:function` each (TRL's tools=[…]): described to the model by its signature and docstring;
    `--tools` with none: the same GRPO without tools (a call is then just text)"""
    max_tool_calls: int | None = None
    """tool turns per completion, each running every call of one model turn (TRL's max_tool_calling_iterations,
    default None: until a turn calls nothing or --response-length is spent)"""
    tool_timeout: float = 10.0
    """seconds a call may run; past them it is stopped and the model gets an error result"""


# ---- Tools: loaded by path, described by their signatures, run on the host with a time limit
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool_schema(fn, flag="--tools"):
    """{"type": "function", "function": {name, description, parameters}}: what transformers' get_json_schema
    makes of fn (the docstring's text before `Args:` and its `name: text` lines, the type hints; parameters
    without a default are required) and chat templates render; a UsageError without docstring or hints."""
    import typing

    doc = inspect.getdoc(fn) or ""
    summary, _, documented = doc.partition("\nArgs:")
    if not summary.strip():
        raise common.UsageError(f"{flag} {common.described(fn)}: no docstring, the model's description of it")
    hints = typing.get_type_hints(fn)
    notes = dict(re.findall(r"^\s*(\w+)(?:\s*\(.*?\))?:\s*(.+)$", documented.split("\nReturns:")[0], re.M))
    properties, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.name not in hints:
            raise common.UsageError(f"{flag} {common.described(fn)}: parameter {p.name!r} has no type hint")
        kind = typing.get_origin(hints[p.name]) or hints[p.name]
        properties[p.name] = {"type": JSON_TYPES.get(kind, "string")}
        properties[p.name].update({"description": notes[p.name]} if p.name in notes else {})
        required += [p.name] if p.default is p.empty else []
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": fn.__name__, "description": summary.strip(), "parameters": parameters},
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
        fn = self.fns.get(name)
        if fn is None:  # TRL's message for a name it does not know
            return self.failed(name, f"Tool {name} not found.", "was called but is not a --tools function")
        try:
            result = call_with_time_limit(fn, arguments, self.timeout)
        except (Exception, ToolTimeout) as e:
            import traceback

            where = traceback.extract_tb(e.__traceback__)[-1]  # the innermost frame: where in the tool
            said = f"ran past --tool-timeout {self.timeout:g} s" if isinstance(e, ToolTimeout) else "raised"
            message = str(e) if isinstance(e, ToolTimeout) else f"{type(e).__name__}: {e}"
            return self.failed(name, str(e), f"{said} {message} (at {where.filename}:{where.lineno})")
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
            fn = self.fns.get(name)
            tqdm.write(
                f"warning: tool {common.described(fn) if fn else repr(name)} {report}: the model gets "
                f"{str({'error': error})!r} and the run goes on; failures are counted in tools/failure_frequency "
                "(each tool's first is reported)",
                sys.stderr,
            )
        return str({"error": error}), True


# ---- How a chat template writes tools: their description, a call, the results (ToolFormat per template)
class ToolFormat(NamedTuple):
    system: Callable  # schemas -> the text of the system turn that describes the tools (None: the template has none)
    parse: Callable  # (a model turn's text, {tool: parameter types}) -> [(name, arguments)] ([]: no call; None: malformed)
    call: Callable  # (name, arguments) -> the text of one call, as the model writes it
    results: Callable  # [result texts] -> the turn that carries them back, between the model's turns


def parse_python_calls(text, types):
    """Gemma's form, `[name(key=value, …), …]` with literal values -> [(name, {key: value})]."""
    import ast

    text = text.strip()
    if not re.match(r"\[\s*[A-Za-z_]\w*\(", text):
        return []
    try:
        node = ast.parse(text, mode="eval").body
        return [
            (c.func.id, {k.arg: ast.literal_eval(k.value) for k in c.keywords})
            for c in node.elts
            if not c.args
        ] or None
    except (SyntaxError, ValueError, AttributeError):
        return None


def python_call(name, arguments):
    """The text of a call in Gemma's form: strings in double quotes, other literals as Python writes them."""
    values = [f"{k}={json.dumps(v) if isinstance(v, str) else repr(v)}" for k, v in arguments.items()]
    return f"[{name}({', '.join(values)})]"


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


def xml_call(name, arguments):
    parameters = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in arguments.items()
    )
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


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
        call=python_call,
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
        call=xml_call,
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
        if system and messages and messages[0].get("role") == "system":
            messages = [
                {"role": "system", "content": system + "\n\n" + str(messages[0]["content"]).strip()}
            ] + messages[1:]
        elif system:
            messages = [{"role": "system", "content": system}] + messages
        prompts.append(common.prompt_text({"prompt": messages}, f"{path}:{line}", template))
    return prompts, [row for row, _ in rows]


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


def draw(backbone, h, key, temperature, top_k=0, top_p=1.0, min_p=None):
    """grpo.generate's draw from final hidden states h [B, D] (inside common.weights): a token [B] from
    softmax(filter_logits(logits / T)) and its log q [B] (common.categorical); T = 0: greedy."""
    if temperature == 0:
        return jnp.argmax(common.logits(backbone, h), -1).astype(jnp.int32), jnp.zeros(h.shape[:1])
    filtered = top_k or top_p < 1.0 or min_p is not None  # else q is softmax(logits / T) itself
    keep = functools.partial(grpo.filter_logits, top_k=top_k, top_p=top_p, min_p=min_p) if filtered else None
    return common.categorical(backbone, h, key, temperature, keep)


def sample_turn(
    backbone,
    params,
    frozen,
    state,
    key,
    *,
    temperature,
    stop_ids,
    pad_id,
    top_k=0,
    top_p=1.0,
    min_p=None,
    forced=None,
):
    """One model turn of each row not done: a token a step, fed through the model at once (its key and value
    join the cache), until every row has sampled a stop token or S is reached; a done row writes a hole (pad,
    masked) -> the state. A key split a step, as grpo.generate: its tokens for a key, in the first turn.
    forced [B, K]: a row's n-th token of the completion is forced[row, n] where that is ≥ 0 (a scripted call:
    the tests), with its log q as drawn."""
    s, r = state["tokens"].shape[1], state["sampled"].shape[1]
    put = lambda x, new, at: jax.lax.dynamic_update_slice_in_dim(x, new[:, None].astype(x.dtype), at, 1)

    def step(carry):
        st, key = carry
        key, sample_key = jax.random.split(key)
        active, t = ~st["done"], st["t"]
        with common.weights(backbone, params, frozen):
            token, logq = draw(
                backbone, st["hidden"], sample_key, temperature, top_k=top_k, top_p=top_p, min_p=min_p
            )
            if forced is not None:  # the script's token where it has one for the row's next position
                n = st["sampled"].sum(1)  # [B]: the completion's tokens so far
                script = jnp.take_along_axis(forced, jnp.minimum(n, forced.shape[1] - 1)[:, None], 1)[:, 0]
                token = jnp.where((n < forced.shape[1]) & (script >= 0), script, token)
                if temperature:
                    raw = common.logits(backbone, st["hidden"], raw=True)
                    logq = grpo.filtered_logps(
                        raw, token, temperature, top_k=top_k, top_p=top_p, min_p=min_p
                    )[0]
            token = jnp.where(active, token, pad_id)
            mask = put(st["mask"], active, t)  # the token is a key for later positions where a row sampled it
            hidden, cache = common.cached_forward(backbone, token[:, None], mask, st["cache"], t, hidden=True)
        new = {
            "tokens": put(st["tokens"], token, t),
            "mask": mask,
            "sampled": put(st["sampled"], active, t - (s - r)),
            "logqs": put(st["logqs"], jnp.where(active, logq, 0.0), t - (s - r)),
            "cache": cache,
            "hidden": hidden[:, -1],
            "t": t + 1,
            "done": st["done"] | jnp.isin(token, jnp.asarray(stop_ids)),
        }
        return new, key

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
    calls: np.ndarray  # [B] tool calls made
    failures: np.ndarray  # [B] of them failed
    turns: np.ndarray  # [B] model turns


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
    the template's turn end is parsed; its calls run (`tools`, None: no tools), their results go into the cache
    (fns["append"], `bridge`: results -> text) and the rows sample again; until no row calls, --max-tool-calls
    rounds, or R is spent (a result that does not fit is dropped, as TRL drops it) -> (batch, Transcript)."""
    qb = common.bucket_length(int(query_mask.sum(1).max()), queries.shape[1])
    qs, qm = common.put_global(queries[:, -qb:], on_data), common.put_global(query_mask[:, -qb:], on_data)
    state = fns["start"](params, frozen, qs, qm)
    b, s = queries.shape[0], qb + state["sampled"].shape[1]
    begin = np.full(b, qb)  # where each row's current turn starts
    live = np.ones(b, bool)  # rows whose turn is being sampled
    messages = [[] for _ in range(b)]
    calls = np.zeros(b, int)  # [B] tool calls made
    failures = np.zeros(b, int)  # [B] of them failed
    turns = np.ones(b, int)  # [B] model turns
    for rounds in range(s):
        key, turn_key = jax.random.split(key)
        state = fns["turn"](params, frozen, state, turn_key)
        t = int(state["t"])
        tokens = common.to_host(state["tokens"])
        sampled = common.to_host(state["sampled"])
        rows = np.flatnonzero(live)
        ids = [tokens[i, begin[i] : t][sampled[i, begin[i] - qb : t - qb]] for i in rows]  # the turn's tokens
        ended = [len(x) > 0 and x[-1] == turn_end_id for x in ids]
        texts = decode(tokenizer, [x[:-1] if e else x for x, e in zip(ids, ended)])
        bridges = {}  # row -> the ids that carry its results back, and how many results
        for i, text, e in zip(rows, texts, ended):
            found = fmt.parse(text, tools.types) if tools and e else []
            if found == [] or (max_tool_calls is not None and rounds >= max_tool_calls):
                messages[i].append({"role": "assistant", "content": text})
                continue
            found = found or [("(malformed)", None)]  # None: the turn opened a call it did not close
            results = [
                tools(n, a) if a is not None else tools.failed(n, "could not parse the call", "was malformed")
                for n, a in found
            ]
            calls[i] += len(found)
            failures[i] += sum(failed for _, failed in results)
            asked = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in found]
            messages[i].append({"role": "assistant", "content": text, "tool_calls": asked})
            messages[i] += [
                {"role": "tool", "name": n, "content": r} for (n, _), (r, _) in zip(found, results)
            ]
            bridges[i] = (list(tokenizer.tokenize(bridge([r for r, _ in results]))), len(results))
        room = s - 1 - t  # positions left for a bridge and at least one token after it
        for i in [i for i, (x, _) in bridges.items() if len(x) > room]:  # does not fit: TRL drops the results
            del messages[i][-bridges.pop(i)[1] :]
        live[:] = False
        if not bridges:
            break
        w = min(
            8 * -(-max(len(x) for x, _ in bridges.values()) // 8), room
        )  # a multiple of 8: few compilations
        ids, ids_mask = np.zeros((b, w), np.int32), np.zeros((b, w), bool)
        for i, (x, _) in bridges.items():  # right-aligned: every row's next token goes to position t + w
            ids[i, w - len(x) :] = x
            ids_mask[i, w - len(x) :] = True
        ids, ids_mask = common.put_global(ids, on_data), common.put_global(ids_mask, on_data)
        state = fns["append"](params, frozen, state, ids, ids_mask)
        live[list(bridges)] = True
        begin[list(bridges)] = t + w
        turns[list(bridges)] += 1
    batch = {
        "query_responses": state["tokens"],
        "padding_mask": state["mask"],
        "response_mask": state["sampled"],  # the policy's own tokens: the loss, KL, entropy and meter's
        "sampled_mask": state["sampled"],
        "sampler_logps": state["logqs"],
    }
    return batch, Transcript(messages, calls, failures, turns)


def decode(tokenizer, ids):
    """Token id arrays -> their texts (an empty one: "")."""
    texts = iter(
        tokenizer.detokenize([list(map(int, x)) for x in ids if len(x)]) if any(len(x) for x in ids) else []
    )
    return [
        (lambda t: t.decode() if isinstance(t, bytes) else str(t))(next(texts)) if len(x) else "" for x in ids
    ]


# ---- main's pieces: what a completion is for the rewards and metrics, the greedy evaluation
def completions(batch, transcript, stop_ids):
    """On the host: (final answers: each completion's last assistant text, completion_ids: its real tokens, tool
    results included, before the final stop, lengths [B]: the policy's tokens less that stop, has_eos [B]:
    the last turn ended at a stop token)."""
    sampled = common.to_host(batch["response_mask"])
    r = sampled.shape[1]
    tokens = common.to_host(batch["query_responses"])[:, -r:]
    real = common.to_host(batch["padding_mask"])[:, -r:]
    last = r - 1 - np.argmax(sampled[:, ::-1], 1)  # the policy's last token
    has_eos = sampled.any(1) & np.isin(tokens[np.arange(len(tokens)), last], stop_ids)
    ids = [x[m][: m.sum() - e] for x, m, e in zip(tokens, real, has_eos)]
    texts = [
        next((m["content"] for m in reversed(ms) if m["role"] == "assistant"), "")
        for ms in transcript.messages
    ]
    return texts, ids, sampled.sum(1) - has_eos, has_eos


def tool_metrics(transcript, prefix=""):
    """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed ÷ calls), turns."""
    calls = transcript.calls.sum()
    return {
        f"{prefix}tools/call_frequency": float(calls / len(transcript.calls)),
        f"{prefix}tools/failure_frequency": float(transcript.failures.sum() / calls) if calls else 0.0,
        f"{prefix}completions/mean_turns": float(transcript.turns.mean()),
    }


def evaluate(fns, params, frozen, data, scorer, *, batch_size, end, stop_ids, path=None, **rollout_kwargs):
    """Greedy multi-turn completions of every eval prompt (batches of batch_size, the last padded with repeats),
    scored -> eval/reward, eval/rewards/<fn>/mean, the tool metrics and lengths; with a path, each prompt's
    row there too (its columns, the completion's messages, each reward function's score: paired comparisons)."""
    prompts, rows, queries, query_mask = data
    n = len(prompts)
    parts, kept = {}, []
    messages = []  # each prompt's completion (TRL's messages)
    for begin in range(0, n, batch_size):
        idx = np.minimum(np.arange(begin, begin + batch_size), n - 1)
        batch, transcript = rollout(
            fns, params, frozen, queries[idx], query_mask[idx], key=jax.random.key(0), **rollout_kwargs
        )
        texts, ids, length, _ = completions(batch, transcript, stop_ids)
        m = min(batch_size, n - begin)  # the repeats are not scored
        _, scored = scorer(
            [prompts[i] for i in idx],
            texts,
            batch,
            rows=[rows[i] for i in idx],
            completion_ids=ids,
            end=end,
            messages=transcript.messages,
        )
        scored = {k: v[:m] for k, v in scored.items()}
        for k, v in scored.items():
            parts.setdefault(k, []).append(v)
        kept.append((transcript.calls[:m], transcript.failures[:m], transcript.turns[:m], length[:m]))
        messages += transcript.messages[:m]
    parts = {k: np.concatenate(v) for k, v in parts.items()}
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            for i, (row, completion) in enumerate(zip(rows, messages)):
                scores = {k: None if np.isnan(v[i]) else float(v[i]) for k, v in parts.items()}
                f.write(json.dumps({**row, "completion": completion, "scores": scores}) + "\n")
    weighted = np.nansum([w * parts[name] for _, w, _, name in scorer.fns], 0) + parts.get(
        "reward_model", 0.0
    )
    calls, failures, turns, lengths = (np.concatenate(x) for x in zip(*kept))
    return {
        "eval/reward": float(weighted.mean()),
        **{f"eval/rewards/{k}/mean": float(np.nanmean(v)) for k, v in parts.items()},
        **tool_metrics(Transcript([], calls, failures, turns), "eval/"),
        "eval/completions/mean_length": float(lengths.mean()),
    }


def main(args):
    # ---- set-up: every flag, file, tool and row checked before the models load ----
    run = plumbing.Run(__file__, args, eval_every=args.eval_every, export_hf=args.export_hf)
    grpo.check_args(args, run.mesh)
    plumbing.check_flags(
        max_tool_calls=(args.max_tool_calls, 0, False), tool_timeout=(args.tool_timeout, 0, True)
    )
    if args.accept_reward is not None:  # grpo.Args' rejection sampling: its update is grpo.py's one-turn loop
        raise common.UsageError(
            "--accept-reward (rejection sampling) is grpo.py's: grpo_tools.py does not take it"
        )
    template = common.chat_template(args.model, args.chat_template)
    fmt = tool_format(template)
    tools = (
        Toolbox([common.load_reward_fn(spec, "--tools") for spec in args.tools], args.tool_timeout)
        if args.tools
        else None
    )
    schemas = tools.schemas if tools else []
    prompts, rows = read_tool_prompts(
        args.dataset,
        template,
        fmt,
        schemas,
        "--dataset",
        config=args.dataset_config,
        split=args.dataset_split,
    )
    eval_path, eval_split, eval_flag = common.eval_source(
        args.dataset, args.eval_dataset, None, (Args.dataset, Args.eval_dataset)
    )
    evals = (
        read_tool_prompts(eval_path, template, fmt, schemas, eval_flag, split=eval_split)
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
    queries, query_mask = grpo.tokenize_prompts(prompts, tokenizer, args.max_prompt_length)
    eval_data = (
        (*evals, *grpo.tokenize_prompts(evals[0], tokenizer, args.max_prompt_length)) if evals else None
    )
    r, pad = args.response_length, tokenizer.pad_token_id
    stops = common.stop_token_ids(tokenizer, template, args.stop_token)  # EOS, the turn end, --stop-token
    end = common.turn_end(template)
    bridge = lambda results: (
        template.end[template.end.index(end) + len(end) :] + fmt.results(results) + template.model
    )
    print(
        f"data: {len(prompts)} prompts, queries padded to ≤ {queries.shape[1]} tokens; {n_prompts} prompts × G={g} "
        f"completions of ≤ {r} positions a step (tool results included); {len(evals[0]) if evals else 0} eval "
        f"prompts; tools: {', '.join(tools.fns) if tools else 'none'}"
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

    # the sampler: prefill, turns (sampled and greedy), tool results into the cache; q: what is sampled and scored
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    fns = {
        "start": jax.jit(functools.partial(start, backbone, response_length=r, pad_id=pad, group=g)),
        "turn": jax.jit(functools.partial(sample_turn, backbone, stop_ids=stops, pad_id=pad, **sampling)),
        "append": jax.jit(functools.partial(append, backbone)),
    }
    greedy = {  # the evaluation: a prompt a row
        **fns,
        "start": jax.jit(functools.partial(start, backbone, response_length=r, pad_id=pad)),
        "turn": jax.jit(
            functools.partial(sample_turn, backbone, temperature=0.0, stop_ids=stops, pad_id=pad)
        ),
    }
    logps_fn = jax.jit(
        lambda p, rp, f, b: grpo.rollout_logps(
            backbone, p, rp, f, b, context_length=grpo.query_length(b), **sampling
        )
    )
    step_fn = remat.jit(
        lambda s, f, b: grpo.train_step(
            backbone, optimizer, args, s, f, batch=b, context_length=grpo.query_length(b)
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
    flops_per_token = 2 * n * (1 + off_policy + (args.beta > 0)) + 2 * n_rm + args.num_iterations * 6 * n
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
    for step in run.steps(
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
        qb = grpo.query_length(batch)
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
        advantages, group_std = jax.device_get(
            grpo.group_advantages(jnp.asarray(rewards), g, args.scale_rewards)
        )
        if args.mask_truncated_completions:  # DAPO: a cut-off completion is not judged at all
            batch["response_mask"] = batch["response_mask"] & common.put_global(has_eos[:, None], on_data)
        batch["advantages"] = common.put_global(advantages, on_data)
        if off_policy or ref_params is not None:
            batch.update(logps_fn(state[0] if off_policy else None, ref_params, frozen, batch))
        meter = {}  # mismatch/*, over the policy's own tokens: here, or in train_step
        if "old_logps" in batch:
            meter = grpo.mismatch(batch["old_logps"], batch.pop("sampler_logps"), batch["sampled_mask"])
        ticks.append(plumbing.synced(batch))
        updates = []
        for mb_idx in grpo.mini_batches(
            rng, args.batch_size, args.num_mini_batches, args.num_iterations, on_data
        ):
            state, metrics = step_fn(state, frozen, jax.tree.map(lambda x: x[mb_idx], batch))
            updates.append(metrics)
        real = int(query_mask[idx].sum() + sum(len(x) for x in ids) + has_eos.sum())
        sampled_tokens = int((lengths + has_eos).sum())
        run.log(
            {
                **plumbing.phase_metrics(updates, ticks, sampled_tokens),
                **meter,
                **grpo.reward_metrics(rewards, parts, lengths, has_eos),
                **tool_metrics(transcript),
                "reward_std": float(np.mean(group_std)),
                "frac_reward_zero_std": float(np.mean(np.isclose(group_std, 0.0))),
                "charts/generate_compilations": float(fns["turn"]._cache_size()),
            },
            tokens=real,
            padded=len(idx) * (qb + r),
            flops=real * flops_per_token,
        )
        if args.sample_every and (step % args.sample_every == 0 or step + 1 == max_steps):
            print(
                f"step {step + 1} sample (reward {rewards[0]:.3f}): {prompts[idx[0]]!r} -> {json.dumps(transcript.messages[0])}"
            )
        if run.eval_due() and eval_data is not None and step + 1 < max_steps:
            run.log_eval(score(state[0]))
        run.checkpoint((state[0], state[1], jax.random.key_data(key)), {"rng": rng.bit_generator.state})
    if eval_data is not None and run.step > run.start:
        run._eval_started = time.perf_counter()
        run.log_eval(score(state[0]))

    # ---- outputs: the policy (LoRA merged) as a KerasHub preset ----
    run.finish(lambda path: common.save_model(model, state[0], path))


if __name__ == "__main__":
    plumbing.launch(main, Args)  # the one boundary: exceptions -> exit codes and one-line messages
