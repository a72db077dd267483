"""grpo_tools.py: tools described from their signatures, the template formats (gemma's, Qwen 3.5's) rendered
and parsed, failing tools (raising, hanging, non-text, unknown) answered with an error and counted, and the
multi-turn rollout on `tiny` with scripted calls: the transcript, the policy's tokens against the tool results
(the trainer's log-probs equal the sampler's over the policy's tokens; the loss's gradient through every other
position is exactly zero), tool results prefilled into the cache (never the context again), the first turn as
grpo.py's sampler draws it, 8 devices as 1, and the CLI end to end."""

import functools
import json
import os
import sys
import time

import numpy as np
import pytest

import common  # noqa: F401  (first: KERAS_BACKEND=jax)

import grpo
import grpo_tools as gt
from helpers import ROOT, metrics, usage_error

sys.path.insert(0, os.path.join(ROOT, "data"))
import calculator  # noqa: E402

GEMMA = common.CHAT_TEMPLATES["gemma"]
R = 192  # response positions of the scripted rollouts: room for two tool rounds of `tiny`s many byte tokens


def test_schema_comes_from_the_signature_and_docstring():
    """transformers' get_json_schema form: the docstring's summary, the `Args:` lines, hints, required."""
    assert gt.tool_schema(calculator.calculator) == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression of integers with +, - and *.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": 'the expression, e.g. "37 * 58"'}
                },
                "required": ["expression"],
            },
        },
    }

    def lookup(key: str, limit: int = 3, scale: float = 1.0, tags: list[str] = ()):
        """Look a key up.

        Args:
            key: what to look up
            limit (int): how many
        """

    params = gt.tool_schema(lookup)["function"]["parameters"]
    assert params["required"] == ["key"]
    assert params["properties"] == {
        "key": {"type": "string", "description": "what to look up"},
        "limit": {"type": "integer", "description": "how many"},
        "scale": {"type": "number"},
        "tags": {"type": "array"},
    }

    def undocumented(x: int):
        pass

    def unhinted(x):
        """Doc."""

    with pytest.raises(common.UsageError, match="undocumented .*no docstring"):
        gt.tool_schema(undocumented)
    with pytest.raises(common.UsageError, match="parameter 'x' has no type hint"):
        gt.tool_schema(unhinted)


def test_gemma_format_renders_and_parses_calls():
    fmt = gt.FORMATS["gemma"]
    text = fmt.call("calculator", {"expression": "37 * 58"})
    assert text == '[calculator(expression="37 * 58")]'
    assert fmt.parse(text, {}) == [("calculator", {"expression": "37 * 58"})]
    assert fmt.parse("[f(a=1, b='x'), g()]", {}) == [("f", {"a": 1, "b": "x"}), ("g", {})]
    assert fmt.parse("2146", {}) == [] and fmt.parse("[1, 2]", {}) == []  # answers, not calls
    assert fmt.parse("[f(a=open('x'))]", {}) is None  # a call whose values are not literals: malformed
    assert fmt.results(["12"]) == "<start_of_turn>user\n```tool_output\n12\n```<end_of_turn>\n"


def test_qwen3_5_format_renders_and_parses_calls():
    """Qwen 3.5's XML calls, values read by the parameter's JSON type; results as <tool_response> blocks; the
    tools described in the system turn as its chat template writes them."""
    fmt = gt.FORMATS["qwen3.5"]
    text = fmt.call("lookup", {"key": "a b", "limit": 2})
    assert text == (
        "<tool_call>\n<function=lookup>\n<parameter=key>\na b\n</parameter>\n<parameter=limit>\n2\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    types = {"lookup": {"key": {"type": "string"}, "limit": {"type": "integer"}}}
    assert fmt.parse("Let me look.\n\n" + text, types) == [("lookup", {"key": "a b", "limit": 2})]
    assert fmt.parse(text.replace("\n2\n", "\n12\n"), {"lookup": {"limit": {"type": "string"}}}) == [
        ("lookup", {"key": "a b", "limit": "12"})
    ]
    assert fmt.parse("<tool_call>\n<function=lookup>", types) is None and fmt.parse("no call", types) == []
    assert fmt.results(["1", "2"]) == (
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
    )
    schema = gt.tool_schema(calculator.calculator)
    system = fmt.system([schema])
    assert system.startswith("# Tools\n\nYou have access to the following functions:\n\n<tools>\n{")
    assert "\n" + json.dumps(schema) + "\n</tools>\n\nIf you choose to call a function ONLY reply" in system


def test_a_template_without_a_tool_format_is_refused():
    with pytest.raises(common.UsageError, match="chat template llama3 has no tool format here"):
        gt.tool_format(common.CHAT_TEMPLATES["llama3"])


def slow(expression: str) -> str:
    """Hangs.

    Args:
        expression: ignored
    """
    time.sleep(30)


def listing(expression: str) -> str:
    """Returns a list.

    Args:
        expression: ignored
    """
    return [expression]


def stubborn(expression: str) -> str:
    """Hangs, catching every Exception.

    Args:
        expression: ignored
    """
    while True:
        try:
            time.sleep(30)
        except Exception:
            pass


def test_failing_tools_give_an_error_result_counted_and_reported_once(capsys):
    """A raise, a hang past --tool-timeout (even one that catches Exception), a non-text result and an unknown
    name: each an error result as TRL writes it, `failed`, and one warning per tool naming its file and line."""
    tools = gt.Toolbox([calculator.calculator, slow, listing, stubborn], timeout=0.2)
    assert tools("calculator", {"expression": "37 * 58"}) == ("2146", False)
    assert tools("calculator", {"expression": "2 ** 3"}) == (
        "{'error': \"not an integer expression: '2 ** 3'\"}",
        True,
    )
    began = time.perf_counter()
    assert tools("slow", {"expression": ""}) == ("{'error': 'timed out after 0.2 s'}", True)
    assert tools("stubborn", {"expression": ""}) == ("{'error': 'timed out after 0.2 s'}", True)
    assert time.perf_counter() - began < 2
    assert tools("listing", {"expression": "x"}) == ("{'error': 'returned list, not text'}", True)
    assert tools("search", {"q": "x"}) == ("{'error': 'Tool search not found.'}", True)
    assert tools("calculator", {"expression": "1 / 0"})[1]  # the second failure of a tool: not reported
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 5, err
    line = calculator.calculator.__code__.co_firstlineno
    assert err[0].startswith(
        f"warning: tool calculator ({calculator.__file__}:{line}) raised ValueError: not an integer expression"
    )
    assert f"(at {calculator.__file__}:" in err[0] and "tools/failure_frequency" in err[0]
    assert f"slow ({__file__}:" in err[1] and "ran past --tool-timeout 0.2 s" in err[1]
    assert "stubborn" in err[2] and "listing" in err[3] and "returned ['x']" in err[3]
    assert err[4].startswith("warning: tool 'search' was called but is not a --tools function")


@pytest.fixture(scope="module")
def tiny():
    """`tiny` (random init) on one device, its gemma template, prompts of the calculator task."""
    import jax

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    model = common.load_model("tiny", mesh, "float32", 0)
    tokenizer = model.preprocessor.tokenizer
    tools = gt.Toolbox([calculator.calculator, listing], timeout=1.0)
    path = os.path.join(ROOT, "data", "calculator", "prompts_eval.jsonl")
    prompts, rows = gt.read_tool_prompts(path, GEMMA, gt.FORMATS["gemma"], tools.schemas)
    queries, query_mask = grpo.tokenize_prompts(prompts[:8], tokenizer, 64)
    return dict(model=model, mesh=mesh, tools=tools, queries=queries, query_mask=query_mask, rows=rows[:8])


# Scripted completions (the n-th token of a row is the script's): two tool turns, a failing tool, an answer at
# once; the rest drawn by the model (random text), their turn ended by the script
SCRIPTS = [
    ['[calculator(expression="3 * 4")]', '[calculator(expression="12 + 1")]', "13"],
    ['[listing(expression="3")]', "7"],
    ["42"],
] + [[5 + i] for i in range(5)]  # n: n tokens drawn, then the turn end


def scripted_rollout(setup, mesh=None, forced=True, max_tool_calls=None, spy=None, rows=4):
    """The rollout of the first `rows` prompts, SCRIPTS forced (or all drawn), on `mesh` (default: one device)."""
    import jax
    import jax.numpy as jnp

    backbone, tokenizer = setup["model"].backbone, setup["model"].preprocessor.tokenizer
    mesh = mesh or setup["mesh"]
    params, frozen = common.split_variables(backbone)
    if mesh is not setup["mesh"]:
        params, frozen = jax.device_put((params, frozen), common.replicated(mesh))
    stops = common.stop_token_ids(tokenizer, GEMMA)
    script = np.full((rows, 96), -1, np.int32)
    for i, turns in enumerate(SCRIPTS[:rows] if forced else []):
        ids = [
            t
            for turn in turns
            for t in (
                [-1] * turn + [stops[1]]
                if isinstance(turn, int)
                else tokenizer.tokenize(turn + "<end_of_turn>")
            )
        ]
        script[i, : len(ids)] = ids
    fns = {
        "start": jax.jit(functools.partial(gt.start, backbone, response_length=R, pad_id=0)),
        "turn": jax.jit(
            functools.partial(
                gt.sample_turn,
                backbone,
                temperature=1.0,
                stop_ids=stops,
                pad_id=0,
                forced=jnp.asarray(script),
            )
        ),
        "append": jax.jit(functools.partial(gt.append, backbone)),
    }
    if spy is not None:
        fns = {k: (lambda f, k: lambda *a: spy(k, a) or f(*a))(f, k) for k, f in fns.items()}
    end = common.turn_end(GEMMA)
    fmt = gt.FORMATS["gemma"]
    batch, transcript = gt.rollout(
        fns,
        params,
        frozen,
        setup["queries"][:rows],
        setup["query_mask"][:rows],
        key=jax.random.key(3),
        tools=setup["tools"],
        fmt=fmt,
        bridge=lambda results: "\n" + fmt.results(results) + GEMMA.model,
        tokenizer=tokenizer,
        max_tool_calls=max_tool_calls,
        turn_end_id=stops[1],
        on_data=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
    )
    assert end == "<end_of_turn>"
    return batch, transcript, params, frozen


@pytest.fixture(scope="module")
def rolled(tiny):
    return scripted_rollout(tiny)


def test_multi_turn_transcript(rolled):
    """Calls parsed, run, answered; TRL's messages; counts; a failing tool leaves the rollout going."""
    _, transcript, _, _ = rolled
    calc = lambda e: [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
    ]
    assert transcript.messages[0] == [
        {"role": "assistant", "content": '[calculator(expression="3 * 4")]', "tool_calls": calc("3 * 4")},
        {"role": "tool", "name": "calculator", "content": "12"},
        {"role": "assistant", "content": '[calculator(expression="12 + 1")]', "tool_calls": calc("12 + 1")},
        {"role": "tool", "name": "calculator", "content": "13"},
        {"role": "assistant", "content": "13"},
    ]
    assert transcript.messages[1][1] == {
        "role": "tool",
        "name": "listing",
        "content": "{'error': 'returned list, not text'}",
    }
    assert transcript.messages[1][2] == {"role": "assistant", "content": "7"}
    assert transcript.messages[2] == [{"role": "assistant", "content": "42"}]
    assert list(transcript.calls) == [2, 1, 0, 0] and list(transcript.failures) == [0, 1, 0, 0]
    assert list(transcript.turns) == [3, 2, 1, 1]
    scores = calculator.correct([m for m in transcript.messages[:3]], ["13", "7", "41"])
    assert scores == [1.0, 1.0, 0.0]
    assert calculator.useful_call(transcript.messages[:3], ["13", "7", "42"]) == [1.0, 0.0, 0.0]
    assert gt.tool_metrics(transcript) == {
        "tools/call_frequency": 3 / 4,
        "tools/failure_frequency": 1 / 3,
        "completions/mean_turns": 7 / 4,
    }


def test_max_tool_calls_ends_the_completion_at_the_next_call(tiny):
    """--max-tool-calls 1: one tool turn runs; the next turn's call is the completion's last message."""
    _, transcript, _, _ = scripted_rollout(tiny, max_tool_calls=1)
    assert [m["role"] for m in transcript.messages[0]] == ["assistant", "tool", "assistant"]
    assert transcript.messages[0][-1] == {"role": "assistant", "content": '[calculator(expression="12 + 1")]'}
    assert list(transcript.calls) == [1, 1, 0, 0]


def test_tool_tokens_are_context_not_policy(tiny, rolled):
    """The policy's tokens (response_mask) are exactly the scripted turns', each with its stop; the tool results
    in their template turns are context (padding_mask) outside it; over the policy's tokens the trainer's
    log-probs equal the sampler's (mismatch 1: the cache held the tool results as a forward over the whole
    sequence sees them, holes and all)."""
    batch, _, params, frozen = rolled
    tokenizer = tiny["model"].preprocessor.tokenizer
    qb = grpo.query_length(batch)
    tokens = np.asarray(batch["query_responses"])[:, qb:]
    policy, context = np.asarray(batch["response_mask"]), np.asarray(batch["padding_mask"])[:, qb:]
    results = [["12", "13"], ["{'error': 'returned list, not text'}"], []]
    for i, turns in enumerate(SCRIPTS[:3]):
        assert list(tokens[i][policy[i]]) == [
            t for x in turns for t in tokenizer.tokenize(x + "<end_of_turn>")
        ]
        bridges = ["\n" + gt.FORMATS["gemma"].results([x]) + GEMMA.model for x in results[i]]
        assert list(tokens[i][context[i] & ~policy[i]]) == [t for x in bridges for t in tokenizer.tokenize(x)]
    assert not (policy & ~context).any()  # the policy's tokens are context too
    logps, _, _ = grpo.response_logps(
        tiny["model"].backbone,
        params,
        frozen,
        batch["query_responses"],
        batch["padding_mask"],
        context_length=qb,
        temperature=1.0,
    )
    meter = grpo.mismatch(logps, batch["sampler_logps"], batch["sampled_mask"])
    assert (
        abs(float(meter["mismatch/ratio_max"]) - 1) < 1e-4
        and abs(float(meter["mismatch/ratio_min"]) - 1) < 1e-4
    )


def test_the_loss_gradient_through_tool_tokens_is_exactly_zero(tiny, rolled):
    """d loss / d logits [B, R, V] of grpo.py's objective on a multi-turn batch, with the k3 KL, an entropy
    bonus and the 80/20 entropy mask on: exactly 0 at every position whose label is not the policy's (the tool
    results, the template's turns around them, the holes, the padding); non-zero at each of the policy's."""
    import jax
    import jax.numpy as jnp

    batch, _, params, frozen = rolled
    backbone = tiny["model"].backbone
    qb = grpo.query_length(batch)
    ids, policy = batch["query_responses"], batch["response_mask"]
    hidden, _ = common.forward(backbone, params, frozen, ids, batch["padding_mask"])
    with common.weights(backbone, params, frozen):
        logits = common.logits(backbone, hidden[:, qb - 1 : -1])  # [B, R, V]: position t predicts t + 1

    def loss(logits):
        b, r, v = logits.shape
        logps, entropy = grpo.filtered_logps(logits.reshape(b * r, v), ids[:, qb:].reshape(-1), 1.0)
        logps = logps.reshape(b, r)
        return grpo.grpo_loss(
            logps,
            jax.lax.stop_gradient(logps),
            jax.lax.stop_gradient(logps) - 0.3,  # a reference apart: the KL has a gradient
            jnp.array([1.0, -1.0, 0.5, 2.0]),
            policy,
            epsilon=0.2,
            epsilon_high=0.28,
            beta=0.04,
            loss_type="dapo",
            importance_sampling_level="token",
            entropy=entropy.reshape(b, r),
            top_entropy_quantile=0.5,
            entropy_coef=0.01,
        )[0]

    grads = np.asarray(jax.grad(loss)(logits))  # [B, R, V]
    policy = np.asarray(policy)
    context = np.asarray(batch["padding_mask"])[:, qb:] & ~policy
    assert context[:2].sum() > 0 and (grads[~policy] == 0.0).all()
    assert (np.abs(grads[policy]).sum(-1) > 0).all()


def test_tool_results_are_prefilled_into_the_cache_not_recomputed(tiny, monkeypatch):
    """What goes through common.cached_forward (recorded as each jitted function is traced): the prompts once
    (start, Qb wide), one token a step (turn), and each tool round's bridges alone (append, W wide: the
    longest bridge rounded up to 8). The context before them is never fed again: the cache holds it."""
    widths, calls = [], []
    forward = common.cached_forward
    monkeypatch.setattr(
        common,
        "cached_forward",
        lambda backbone, ids, *a, **k: widths.append(ids.shape[1]) or forward(backbone, ids, *a, **k),
    )
    batch, _, _, _ = scripted_rollout(tiny, spy=lambda kind, args: calls.append((kind, args)))
    assert [k for k, _ in calls] == ["start", "turn", "append", "turn", "append", "turn"]  # row 0's 3 turns
    appended = [args[3].shape[1] for k, args in calls if k == "append"]
    tokenizer = tiny["model"].preprocessor.tokenizer
    longest = len(
        tokenizer.tokenize(
            "\n" + gt.FORMATS["gemma"].results(["{'error': 'returned list, not text'}"]) + GEMMA.model
        )
    )
    assert appended == [
        8 * -(-longest // 8),
        8 * -(-len(tokenizer.tokenize("\n" + gt.FORMATS["gemma"].results(["13"]) + GEMMA.model)) // 8),
    ]
    assert widths == [grpo.query_length(batch), 1, *dict.fromkeys(appended)]  # each traced once


def test_first_turn_draws_what_grpo_generate_draws(tiny):
    """Nothing scripted, no call made: the rollout's one turn is grpo.generate's sample for the same key
    (the same tokens, the same log q)."""
    import jax

    batch, transcript, params, frozen = scripted_rollout(tiny, forced=False)
    backbone = tiny["model"].backbone
    stops = common.stop_token_ids(tiny["model"].preprocessor.tokenizer, GEMMA)
    qb = grpo.query_length(batch)
    tokens, _, logqs = grpo.generate(
        backbone,
        params,
        frozen,
        batch["query_responses"][:, :qb],
        batch["padding_mask"][:, :qb],
        jax.random.split(jax.random.key(3))[1],
        response_length=R,
        temperature=1.0,
        stop_ids=stops,
        pad_id=0,
    )
    assert list(transcript.turns) == [1, 1, 1, 1]
    np.testing.assert_array_equal(np.asarray(batch["query_responses"])[:, qb:], np.asarray(tokens))
    np.testing.assert_allclose(np.asarray(batch["sampler_logps"]), np.asarray(logqs), atol=1e-5)


def test_eight_devices_roll_out_as_one(tiny):
    """The scripted rollout with its batch over 8 simulated devices (params replicated) equals one device's."""
    mesh = common.make_mesh(None)  # 8 devices on `data`
    one, _, _, _ = scripted_rollout(tiny, rows=8)
    eight, transcript, _, _ = scripted_rollout(tiny, mesh=mesh, rows=8)
    assert eight["query_responses"].sharding.shard_shape(eight["query_responses"].shape)[0] == 1
    for k in ("query_responses", "padding_mask", "response_mask"):
        np.testing.assert_array_equal(np.asarray(one[k]), np.asarray(eight[k]))
    np.testing.assert_allclose(
        np.asarray(one["sampler_logps"]), np.asarray(eight["sampler_logps"]), atol=1e-5
    )
    assert list(transcript.calls) == [2, 1, 0, 0, 0, 0, 0, 0]
