"""grpo_tools.py: tools described from their signatures, the template formats (gemma's, Qwen 3.5's) parsed,
failing tools (raising, hanging, non-text, unknown) answered with an error and counted, and the multi-turn
rollout on `tiny` with scripted calls (grpo_tools.draw patched): the transcript, the policy's tokens against
the tool results (the trainer's log-probs equal the sampler's over the policy's tokens; the loss's gradient
through every other position is exactly zero), tool results prefilled into the cache (never the context
again), the first turn as grpo.py's sampler draws it, 8 devices as 1; its copy of the objective equal to
grpo.py's; grpo.py's flags it does not take refused; and the CLI end to end."""

import functools
import json
import os
import sys
import time

import numpy as np
import pytest

import common  # noqa: F401  (first: KERAS_BACKEND=jax)

import grpo  # an independent cross-check only: grpo.generate's draw, grpo.grpo_loss's values
import grpo_tools as gt
from helpers import ROOT, metrics, run_script, usage_error

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


def test_gemma_format_parses_calls():
    fmt = gt.FORMATS["gemma"]
    assert fmt.parse('[calculator(expression="37 * 58")]', {}) == [("calculator", {"expression": "37 * 58"})]
    assert fmt.parse(' [calculator(expression="37 * 58")]\n', {}) == [
        ("calculator", {"expression": "37 * 58"})
    ]
    assert fmt.parse("[f(a=1, b='x'), g()]", {}) == [("f", {"a": 1, "b": "x"}), ("g", {})]
    assert fmt.parse("2146", {}) == [] and fmt.parse("[1, 2]", {}) == []  # answers, not calls
    assert fmt.parse("[f(a=open('x'))]", {}) is None  # a call whose values are not literals: malformed
    assert fmt.results(["12"]) == "<start_of_turn>user\n```tool_output\n12\n```<end_of_turn>\n"


def test_qwen3_5_format_parses_calls():
    """Qwen 3.5's XML calls, values read by the parameter's JSON type; results as <tool_response> blocks; the
    tools described in the system turn as its chat template writes them."""
    fmt = gt.FORMATS["qwen3.5"]
    text = (  # a call as Qwen 3.5's template writes one
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


async def napping(expression: str) -> str:
    """An async tool: hangs, then answers.

    Args:
        expression: echoed
    """
    import asyncio

    await asyncio.sleep(float(expression))
    return expression


def test_failing_tools_give_an_error_result_counted_and_reported_once(capsys):
    """A raise, a hang past --tool-timeout (even one that catches Exception), a non-text result and an unknown
    name: each an error result as TRL writes it, `failed`, and one warning per tool naming its file and line."""
    tools = gt.Toolbox([calculator.calculator, slow, listing, stubborn, napping], timeout=0.2)
    assert tools("calculator", {"expression": "37 * 58"}) == ("2146", False)
    assert tools("calculator", {"expression": "2 ** 3"}) == (
        "{'error': \"not an integer expression: '2 ** 3'\"}",
        True,
    )
    began = time.perf_counter()
    assert tools("slow", {"expression": ""}) == ("{'error': 'timed out after 0.2 s'}", True)
    assert tools("stubborn", {"expression": ""}) == ("{'error': 'timed out after 0.2 s'}", True)
    assert tools("napping", {"expression": "0"}) == ("0", False)  # async: awaited
    assert tools("napping", {"expression": "30"}) == ("{'error': 'timed out after 0.2 s'}", True)
    assert time.perf_counter() - began < 3
    assert tools("listing", {"expression": "x"}) == ("{'error': 'returned list, not text'}", True)
    assert tools("search", {"q": "x"}) == ("{'error': 'Tool search not found.'}", True)
    assert tools("calculator", {"expression": "1 / 0"})[1]  # the second failure of a tool: not reported
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 6, err
    line = calculator.calculator.__code__.co_firstlineno
    assert err[0].startswith(
        f"warning: tool calculator ({calculator.__file__}:{line}) raised ValueError: not an integer expression"
    )
    assert f"(at {calculator.__file__}:" in err[0] and "tools/failure_frequency" in err[0]
    assert f"slow ({__file__}:" in err[1] and "ran past --tool-timeout 0.2 s" in err[1]
    assert "stubborn" in err[2] and "napping" in err[3] and "listing" in err[4] and "returned ['x']" in err[4]
    assert err[5].startswith("warning: tool 'search' was called but is not a --tools function")


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
    queries, query_mask = gt.tokenize_prompts(prompts[:8], tokenizer, 64)
    return dict(model=model, mesh=mesh, tools=tools, queries=queries, query_mask=query_mask, rows=rows[:8])


# Scripted completions (the n-th token of a row is the script's): two tool turns, a failing tool, an answer at
# once; the rest drawn by the model (random text), their turn ended by the script
SCRIPTS = [
    ['[calculator(expression="3 * 4")]', '[calculator(expression="12 + 1")]', "13"],
    ['[listing(expression="3")]', "7"],
    ["42"],
] + [[5 + i] for i in range(5)]  # n: n tokens drawn, then the turn end


def calls_of(transcript):
    """Each completion's tool calls (its assistant messages' tool_calls)."""
    return [sum(len(m.get("tool_calls", ())) for m in ms) for ms in transcript.messages]


def turns_of(transcript):
    """Each completion's model turns (its assistant messages)."""
    return [sum(m["role"] == "assistant" for m in ms) for ms in transcript.messages]


def scripted_turn(backbone, params, frozen, state, key, *, script, **sampling):
    """gt.sample_turn with its draw scripted (gt.draw patched while it traces): a row's n-th token of the
    completion is script[row, n] where that is ≥ 0 (a scripted call), else the model's draw; either way its log q
    is log softmax(logits / T)[token], as the trainer scores it. n: the row's tokens before this turn
    (state["sampled"]) + the step within it, the index of the step's key among the turn's (sample_turn splits
    its key once a step)."""
    import jax
    import jax.numpy as jnp

    def split(k, _):
        k, step_key = jax.random.split(k)
        return k, jax.random.key_data(step_key)

    keys = jax.lax.scan(split, key, None, length=state["tokens"].shape[1])[1]  # [S, 2]: each step's key
    before = state["sampled"].sum(1)  # [B]
    model_draw = gt.draw

    def draw(backbone, h, step_key, temperature):
        token, _ = model_draw(backbone, h, step_key, temperature)
        n = before + jnp.argmax((keys == jax.random.key_data(step_key)).all(-1))  # [B]
        given = jnp.take_along_axis(script, jnp.minimum(n, script.shape[1] - 1)[:, None], 1)[:, 0]
        token = jnp.where((n < script.shape[1]) & (given >= 0), given, token)
        scaled = common.logits(backbone, h) / temperature  # [B, V], float32
        return token, jnp.take_along_axis(scaled, token[:, None], -1)[:, 0] - jax.nn.logsumexp(scaled, -1)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gt, "draw", draw)
        return gt.sample_turn(backbone, params, frozen, state, key, **sampling)


def scripted_rollout(setup, mesh=None, forced=True, max_tool_calls=None, spy=None, rows=4, scripts=SCRIPTS):
    """The rollout of the first `rows` prompts, `scripts` forced (scripted_turn; or all drawn), on `mesh`
    (default: one device), in setup's template (default gemma's) -> (batch, transcript, params, frozen)."""
    import jax
    import jax.numpy as jnp

    backbone, tokenizer = setup["model"].backbone, setup["model"].preprocessor.tokenizer
    mesh = mesh or setup["mesh"]
    params, frozen = common.split_variables(backbone)
    if mesh is not setup["mesh"]:
        params, frozen = jax.device_put((params, frozen), common.replicated(mesh))
    template = setup.get("template", GEMMA)
    stops = common.stop_token_ids(tokenizer, template)
    end = common.turn_end(template)
    script = np.full((rows, 96), -1, np.int32)
    for i, turns in enumerate(scripts[:rows] if forced else []):
        ids = [
            t
            for turn in turns
            for t in (
                [-1] * turn + [tokenizer.token_to_id(end)]
                if isinstance(turn, int)
                else tokenizer.tokenize(turn + end)
            )
        ]
        script[i, : len(ids)] = ids
    turn = functools.partial(scripted_turn, script=jnp.asarray(script)) if forced else gt.sample_turn
    fns = {
        "start": jax.jit(functools.partial(gt.start, backbone, response_length=R, pad_id=0)),
        "turn": jax.jit(functools.partial(turn, backbone, temperature=1.0, stop_ids=stops, pad_id=0)),
        "append": jax.jit(functools.partial(gt.append, backbone)),
    }
    if spy is not None:
        fns = {k: (lambda f, k: lambda *a: spy(k, a) or f(*a))(f, k) for k, f in fns.items()}
    fmt = setup.get("fmt", gt.FORMATS["gemma"])
    batch, transcript = gt.rollout(
        fns,
        params,
        frozen,
        setup["queries"][:rows],
        setup["query_mask"][:rows],
        key=jax.random.key(3),
        tools=setup["tools"],
        fmt=fmt,
        bridge=lambda results: "\n" + fmt.results(results) + template.model,
        tokenizer=tokenizer,
        max_tool_calls=max_tool_calls,
        turn_end_id=tokenizer.token_to_id(end),
        on_data=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
    )
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
    assert calls_of(transcript) == [2, 1, 0, 0] and list(transcript.failures) == [0, 1, 0, 0]
    assert turns_of(transcript) == [3, 2, 1, 1]
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
    assert calls_of(transcript) == [1, 1, 0, 0]


def test_tool_tokens_are_context_not_policy(tiny, rolled):
    """The policy's tokens (response_mask) are exactly the scripted turns', each with its stop; the tool results
    in their template turns are context (padding_mask) outside it; over the policy's tokens the trainer's
    log-probs equal the sampler's (mismatch 1: the cache held the tool results as a forward over the whole
    sequence sees them, holes and all)."""
    batch, _, params, frozen = rolled
    tokenizer = tiny["model"].preprocessor.tokenizer
    qb = common.query_length(batch)
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
    assert_sampler_is_trainer(tiny["model"].backbone, params, frozen, batch, qb)


def test_the_loss_gradient_through_tool_tokens_is_exactly_zero(tiny, rolled):
    """d loss / d logits [B, R, V] of grpo_tools' objective on a multi-turn batch, with the k3 KL, under each
    --loss-type: exactly 0 at every position whose label is not the policy's (the tool results, the template's
    turns around them, the holes, the padding); non-zero at each of the policy's."""
    import jax
    import jax.numpy as jnp

    batch, _, params, frozen = rolled
    backbone = tiny["model"].backbone
    qb = common.query_length(batch)
    ids, policy = batch["query_responses"], batch["response_mask"]
    hidden, _ = common.forward(backbone, params, frozen, ids, batch["padding_mask"])
    with common.weights(backbone, params, frozen):
        logits = common.logits(backbone, hidden[:, qb - 1 : -1])  # [B, R, V]: position t predicts t + 1

    def loss(logits, loss_type):
        logps = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, qb:, None], -1)[..., 0]  # T = 1
        return gt.grpo_loss(
            logps,
            jax.lax.stop_gradient(logps),
            jax.lax.stop_gradient(logps) - 0.3,  # a reference apart: the KL has a gradient
            jnp.array([1.0, -1.0, 0.5, 2.0]),
            policy,
            epsilon=0.2,
            epsilon_high=0.28,
            beta=0.04,
            loss_type=loss_type,
        )[0]

    policy = np.asarray(policy)
    context = np.asarray(batch["padding_mask"])[:, qb:] & ~policy
    assert context[:2].sum() > 0
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        grads = np.asarray(jax.grad(loss)(logits, loss_type))  # [B, R, V]
        assert (grads[~policy] == 0.0).all(), loss_type
        assert (np.abs(grads[policy]).sum(-1) > 0).all(), loss_type


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_the_objective_is_grpo_py_s(loss_type, beta):
    """grpo_tools' copy of the objective gives grpo.py's loss, metrics and gradient for every setting both
    take: random log-probs, π_old and π_ref apart (ratios past both clips), advantages of both signs, ragged
    completions."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    b, r = 6, 12
    logps = jnp.asarray(rng.normal(-2.0, 0.5, (b, r)), jnp.float32)
    old = logps + jnp.asarray(rng.normal(0.0, 0.3, (b, r)), jnp.float32)
    ref = logps + jnp.asarray(rng.normal(0.0, 0.3, (b, r)), jnp.float32)
    advantages = jnp.asarray(rng.normal(size=b), jnp.float32)
    mask = jnp.arange(r)[None] < jnp.asarray(rng.integers(1, r + 1, b))[:, None]
    kw = dict(epsilon=0.2, epsilon_high=0.28, beta=beta, loss_type=loss_type)
    got, want = (
        jax.value_and_grad(lambda x, f=f: f(x, old, ref, advantages, mask, **kw), has_aux=True)(logps)
        for f in (gt.grpo_loss, grpo.grpo_loss)
    )
    (loss, metrics), grads = got
    (want_loss, want_metrics), want_grads = want
    assert float(loss) == float(want_loss) and metrics.keys() == want_metrics.keys()
    assert ("kl" in metrics) == bool(beta) and float(metrics["clip_ratio"]) > 0
    for k in metrics:
        assert float(metrics[k]) == float(want_metrics[k]), k
    np.testing.assert_array_equal(np.asarray(grads), np.asarray(want_grads))


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
    assert widths == [common.query_length(batch), 1, *dict.fromkeys(appended)]  # each traced once


def test_first_turn_draws_what_grpo_generate_draws(tiny):
    """Nothing scripted, no call made: the rollout's one turn is grpo.generate's sample for the same key
    (the same tokens, the same log q)."""
    import jax

    batch, transcript, params, frozen = scripted_rollout(tiny, forced=False)
    backbone = tiny["model"].backbone
    stops = common.stop_token_ids(tiny["model"].preprocessor.tokenizer, GEMMA)
    qb = common.query_length(batch)
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
    assert turns_of(transcript) == [1, 1, 1, 1]
    np.testing.assert_array_equal(np.asarray(batch["query_responses"])[:, qb:], np.asarray(tokens))
    np.testing.assert_allclose(np.asarray(batch["sampler_logps"]), np.asarray(logqs), atol=1e-5)


def test_start_prefills_each_prompt_once_for_its_rows(tiny):
    """start(group=G), as the training rollouts call it (G rows a prompt): each prompt prefilled once, its cache
    and last hidden state copied to its rows: group=1's state (to float32 rounding), from a prefill of B/G rows."""
    import jax

    backbone = tiny["model"].backbone
    params, frozen = common.split_variables(backbone)
    rows = np.repeat([0, 1, 2], 2)  # 3 prompts of the calculator task, 2 rows each
    queries, query_mask = tiny["queries"][rows], tiny["query_mask"][rows]
    forward, prefilled = common.cached_forward, []
    states = {}
    for g in (1, 2):
        fn = functools.partial(gt.start, backbone, response_length=R, pad_id=0, group=g)
        with pytest.MonkeyPatch.context() as mp:  # the rows of the prefill, as traced
            mp.setattr(
                common,
                "cached_forward",
                lambda bb, x, *a, **k: prefilled.append(len(x)) or forward(bb, x, *a, **k),
            )
            states[g] = jax.device_get(jax.jit(fn)(params, frozen, queries, query_mask))
    assert prefilled == [6, 3]
    for name in ("tokens", "mask", "sampled", "t", "done"):
        np.testing.assert_array_equal(states[2][name], states[1][name])
    np.testing.assert_allclose(states[2]["hidden"], states[1]["hidden"], atol=1e-5)
    for shared, alone in zip(jax.tree.leaves(states[2]["cache"]), jax.tree.leaves(states[1]["cache"])):
        np.testing.assert_allclose(shared, alone, atol=1e-5)


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
    assert calls_of(transcript) == [2, 1, 0, 0, 0, 0, 0, 0]


def test_qwen3_5_tool_calls_on_a_small_random_model(tmp_path):
    """Qwen 3.5's format on its own backbone (a gated delta net layer, then attention; random init) with a
    byte-level BPE holding its tool tokens: the system turn describes the tools as its template does; a
    scripted XML call is parsed and run, its result comes back as a <tool_response> user turn and the model's
    next turn opens as the template's; the sampler's log q equal the trainer's over the policy's tokens: the
    delta net's conv and recurrent states carry over the tool result and the holes as the full forward's."""
    import jax
    import keras
    import keras_hub.models as m
    from helpers import byte_bpe, short_delta_rule_chunks

    short_delta_rule_chunks()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|vision_start|>"]
    specials += ["<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>"]
    specials += [
        "<tool_response>",
        "</tool_response>",
    ]  # Qwen 3.5's tool tokens: one each, as in its vocabulary
    vocab, merges = byte_bpe(specials)
    tokenizer = m.Qwen3_5Tokenizer(vocabulary=vocab, merges=merges, unsplittable_tokens=specials)
    keras.utils.set_random_seed(0)
    backbone = m.Qwen3_5Backbone(
        vocabulary_size=len(vocab),
        num_layers=2,
        hidden_dim=64,
        intermediate_dim=128,
        num_query_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        tie_word_embeddings=True,
    )
    common.ensure_start_token(tokenizer, "qwen3.5")
    template, fmt = common.CHAT_TEMPLATES["qwen3.5"], gt.FORMATS["qwen3.5"]
    tools = gt.Toolbox([calculator.calculator], timeout=1.0)
    path = tmp_path / "prompts.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 * 4"}]
    path.write_text(
        json.dumps({"prompt": chat, "answer": "12"}) + "\n" + json.dumps({"prompt": chat[1:]}) + "\n"
    )
    prompts, _ = gt.read_tool_prompts(str(path), template, fmt, tools.schemas)
    assert prompts[0] == (
        "<|im_start|>system\n"
        + fmt.system(tools.schemas)
        + "\n\nBe brief.<|im_end|>\n<|im_start|>user\n3 * 4"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert (
        prompts[1].startswith("<|im_start|>system\n# Tools\n")
        and "</IMPORTANT><|im_end|>\n<|im_start|>user" in prompts[1]
    )
    queries, query_mask = gt.tokenize_prompts(prompts, tokenizer, 2048)
    setup = dict(
        model=m.Qwen3_5CausalLM(backbone, m.Qwen3_5CausalLMPreprocessor(tokenizer)),
        mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model")),
        tools=tools,
        queries=queries,
        query_mask=query_mask,
        template=template,
        fmt=fmt,
    )
    call = "<tool_call>\n<function=calculator>\n<parameter=expression>\n3 * 4\n</parameter>\n</function>\n</tool_call>"
    batch, transcript, params, frozen = scripted_rollout(setup, rows=2, scripts=[[call, "12"], ["12"]])
    assert transcript.messages[0] == [
        {
            "role": "assistant",
            "content": call,
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3 * 4"}}}
            ],
        },
        {"role": "tool", "name": "calculator", "content": "12"},
        {"role": "assistant", "content": "12"},
    ]
    qb = common.query_length(batch)
    tokens = np.asarray(batch["query_responses"])[0, qb:]
    policy, context = np.asarray(batch["response_mask"])[0], np.asarray(batch["padding_mask"])[0, qb:]
    assert decode_ids(tokenizer, tokens[context & ~policy]) == (
        "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n"
        "</think>\n\n"
    )
    assert (~context[: np.flatnonzero(context & ~policy)[0]]).any()  # holes before the right-aligned bridge
    assert_sampler_is_trainer(backbone, params, frozen, batch, qb)


def assert_sampler_is_trainer(backbone, params, frozen, batch, qb):
    """The mismatch meter over the sampled tokens (sampled_mask): the sampler's log q and the trainer's log p
    agree to float32 (every ratio 1 within 1e-4)."""
    logps, _, _ = gt.response_logps(
        backbone,
        params,
        frozen,
        batch["query_responses"],
        batch["padding_mask"],
        context_length=qb,
        temperature=1.0,
    )
    meter = gt.mismatch(logps, batch["sampler_logps"], batch["sampled_mask"])
    assert abs(float(meter["mismatch/ratio_max"]) - 1) < 1e-4, meter
    assert abs(float(meter["mismatch/ratio_min"]) - 1) < 1e-4, meter


def decode_ids(tokenizer, ids):
    return gt.decode(tokenizer, [ids])[0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--dataset", os.path.join(ROOT, "data", "prompts_train.jsonl")],
            "prompts_train.jsonl:1: with --tools, 'prompt' must be a chat",
        ),
        (["--chat-template", "llama3"], "the chat template llama3 has no tool format here (gemma, qwen3.5"),
        (["--max-tool-calls", "-1"], "--max-tool-calls -1: must be >= 0"),
        (["--tool-timeout", "0"], "--tool-timeout 0.0: must be > 0"),
        (["--loss-type", "cispo"], "invalid choice 'cispo' for argument '--loss-type'"),
        (["--batch-size", "16", "--num-generations", "3"], "--batch-size 16 must be a multiple of"),
        (
            ["--tools", f"{__file__}:listing", f"{os.path.join(ROOT, 'grpo_tools.py')}:masked_mean"],
            f"--tools masked_mean ({os.path.join(ROOT, 'grpo_tools.py')}:",
        ),
    ],
)
def test_bad_tool_flags_are_refused_before_the_model_loads(flags, message, tmp_path):
    got = usage_error(gt, "--output-dir", str(tmp_path / "out"), *flags)
    assert message in got, got
    assert not (tmp_path / "out").exists()


def test_grpo_py_s_flags_it_does_not_take_are_refused(tmp_path):
    """grpo.py's sampling filters and other objectives are not grpo_tools.py's flags: through the CLI, one
    line on stderr, exit 2, before the heavy imports."""
    for flag, value in (("--top-p", "0.9"), ("--entropy-coef", "0.01"), ("--min-p", "0.1")):
        out = run_script("grpo_tools.py", flag, value, "--output-dir", str(tmp_path / "out"), timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
        assert lines[0].startswith(f"error: Unrecognized options: {flag}"), lines
    assert not (tmp_path / "out").exists()


def test_end_to_end_with_tools_and_the_control(tmp_path):
    """Two steps of `tiny` (random init: it calls nothing) on 8 simulated devices: TRL's tool metrics and
    turns logged, the eval rows at the start and the end, the model saved; the control (`--tools` with none)
    evaluated at 0 steps: what a model scores without the tools."""
    import plumbing

    evals = tmp_path / "eval.jsonl"
    with open(os.path.join(ROOT, "data", "calculator", "prompts_eval.jsonl")) as f:
        evals.write_text("".join(f.readlines()[:12]))  # 12: the last batch of 8 padded with repeats
    small = ["--model", "tiny", "--batch-size", "8", "--num-generations", "4", "--response-length", "24"]
    small += ["--eval-dataset", str(evals), "--learning-rate", "1e-4", "--sample-every", "1"]
    out = tmp_path / "tools"
    gt.main(plumbing.cli(gt.Args, small + ["--max-steps", "2", "--output-dir", str(out)]))
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 2] and "eval/reward" in rows[0] and "eval/reward" in rows[3]
    for k in (
        "tools/call_frequency",
        "tools/failure_frequency",
        "completions/mean_turns",
        "rewards/correct/mean",
    ):
        assert k in rows[1] and k in rows[2], k
    assert rows[1]["rewards/useful_call/mean"] == 0.0 and rows[1]["reward"] == rows[1]["rewards/correct/mean"]
    assert "mismatch/ratio_mean" in rows[1] and abs(rows[1]["mismatch/ratio_mean"] - 1) < 1e-4
    assert rows[3]["eval/completions/mean_turns"] == 1.0 and "eval/tools/call_frequency" in rows[3]
    assert (out / "model" / "config.json").exists()
    for step in (
        0,
        2,
    ):  # each evaluation prompt by prompt (paired comparisons): its columns, messages, scores
        done = [json.loads(line) for line in open(out / f"eval_completions_step{step}.jsonl")]
        assert [r["answer"] for r in done] == [json.loads(line)["answer"] for line in open(evals)]
        assert [r["scores"]["correct"] for r in done] == calculator.correct(
            [r["completion"] for r in done], [r["answer"] for r in done]
        )
        assert all(r["completion"][-1]["role"] == "assistant" for r in done)
    control = tmp_path / "control"
    gt.main(plumbing.cli(gt.Args, small + ["--max-steps", "0", "--tools", "--output-dir", str(control)]))
    assert [r["step"] for r in metrics(control)] == [0] and metrics(control)[0][
        "eval/tools/call_frequency"
    ] == 0


def test_rejection_sampling_on_tool_transcripts(tmp_path):
    """--accept-reward (the tools task's rft control): every transcript accepted (reward 0 ≥ 0), one update
    at ratio 1 has Â = 1 on each policy token: the surrogate −ρÂ is −1 at every token, so the loss is −1.0
    and the gradient is SFT's (non-zero); none accepted (`tiny` answers nothing right: reward 0 < 1), every
    token leaves the loss: loss 0.0, gradient exactly 0."""
    import plumbing

    small = ["--model", "tiny", "--batch-size", "8", "--num-generations", "4", "--response-length", "24"]
    small += ["--eval-dataset", "", "--max-steps", "1", "--learning-rate", "1e-4"]
    got = {}
    for accept in ("0", "1"):
        out = tmp_path / f"accept{accept}"
        gt.main(plumbing.cli(gt.Args, small + ["--accept-reward", accept, "--output-dir", str(out)]))
        (row,) = [r for r in metrics(out) if "train/loss" in r]
        got[accept] = row["train/loss"], row["train/grad_norm"]
    assert got["0"][0] == -1.0 and got["0"][1] > 0
    assert got["1"] == (0.0, 0.0)


def test_calculator_splits_share_no_two_digit_product():
    """The reported split measures the copy, not memory: no two-digit product of eval or test is in the RL
    prompts or the demonstrations (before the fifth run, 52 of test's 224 were in train); the first 4,000
    demonstrations are the RL prompts."""
    read = lambda name: [json.loads(line) for line in open(os.path.join(ROOT, "data", "calculator", name))]
    question = lambda row: (row.get("prompt") or row.get("messages"))[0]["content"]
    names = ("prompts_train.jsonl", "sft_train.jsonl", "prompts_eval.jsonl", "prompts_test.jsonl")
    two = {
        name: [question(r) for r in read(name) if calculator.two_digit(question(r))]
        for name in (*names, "prompts_fresh.jsonl")
    }
    held_out = set(two["prompts_eval.jsonl"]) | set(two["prompts_test.jsonl"])
    assert len(held_out) > 300 and not held_out & set(two["prompts_train.jsonl"] + two["sft_train.jsonl"])
    # fresh (the five-seed comparison's test split): none of any other split's, none repeated
    fresh = two["prompts_fresh.jsonl"]
    assert len(read("prompts_fresh.jsonl")) == 500 and len(fresh) > 200 and len(set(fresh)) == len(fresh)
    assert not set(fresh) & set().union(*map(set, (two[n] for n in names)))
    demos = read("sft_train.jsonl")
    assert len(demos) == 16000 and [question(r) for r in read("prompts_train.jsonl")] == [
        question(r) for r in demos[:4000]
    ]


def test_calculator_demonstrations_are_what_the_rollout_builds(tiny):
    """A demonstration that calls the tool (data/calculator/sft_train.jsonl), tokenised as sft.py trains on it,
    is token for token what a rollout holds for the same completion: the prompt as grpo_tools.py tokenises it, the
    call and its turn end, the gemma bridge around the result, the answer; the call parses, the tool agrees."""
    import sft

    tokenizer = tiny["model"].preprocessor.tokenizer
    with open(os.path.join(ROOT, "data", "calculator", "sft_train.jsonl")) as f:
        demos = [json.loads(line) for line in f]
    calling = [d for d in demos if len(d["messages"]) == 4]
    for two, share in (
        (True, 0.8),
        (False, 0.3),
    ):  # TOOL_SHARE: 80% of the two-digit products, 30% of the rest
        size = [d for d in demos if calculator.two_digit(d["messages"][0]["content"]) == two]
        assert share - 0.05 < sum(len(d["messages"]) == 4 for d in size) / len(size) < share + 0.05
    row = calling[0]["messages"]
    (ids, mask), *_ = sft.tokenize_dataset(
        [common.sft_segments(calling[0], "demo", GEMMA)], tokenizer, 512, True, "x"
    )[0]
    prompt = common.prompt_text({"prompt": row[:1]}, "x", GEMMA)
    query = list(gt.tokenize_prompts([prompt], tokenizer, 64)[0][0])
    query = query[query.index(tokenizer.start_token_id) :]
    (name, arguments), *_ = gt.FORMATS["gemma"].parse(row[1]["content"], {})
    result = calculator.calculator(**arguments)
    assert (
        name == "calculator"
        and row[2]["content"] == f"```tool_output\n{result}\n```"
        and row[3]["content"] == result
    )
    bridge = "\n" + gt.FORMATS["gemma"].results([result]) + GEMMA.model
    completion = [*tokenizer.tokenize(row[1]["content"] + "<end_of_turn>"), *tokenizer.tokenize(bridge)]
    completion += [*tokenizer.tokenize(result + "<end_of_turn>"), tokenizer.end_token_id]  # sft.py's EOS last
    assert list(ids) == query + completion


def test_calculator_checks_and_metrics_by_size():
    """correct reads the final answer's last number; useful_call needs a call that worked and a right answer;
    the by-size metrics are None on the other size (left out of their means, as TRL's nanmean)."""
    prompts = [[{"role": "user", "content": "37 * 58"}], [{"role": "user", "content": "3 * 5"}], "12 * 2"]
    worked = [
        {"role": "assistant", "content": "[c]", "tool_calls": []},
        {"role": "tool", "name": "calculator", "content": "2146"},
        {"role": "assistant", "content": "It is 2146"},
    ]
    failed = [worked[0], {"role": "tool", "name": "calculator", "content": "{'error': 'x'}"}, worked[2]]
    completions = [worked, [{"role": "assistant", "content": "15"}], "24"]
    answers = ["2146", "15", "24"]
    assert calculator.correct(completions, answers) == [1.0, 1.0, 1.0]
    assert calculator.correct([[{"role": "assistant", "content": "2147"}], "no number"], ["2146", "1"]) == [
        0,
        0,
    ]
    assert calculator.useful_call([worked, failed, completions[1]], ["2146", "2146", "15"]) == [1.0, 0.0, 0.0]
    assert calculator.correct_two_digit(prompts, completions, answers) == [1.0, None, 1.0]
    assert calculator.correct_one_digit(prompts, completions, answers) == [None, 1.0, None]
    assert calculator.calls_two_digit(prompts, completions) == [1.0, None, 0.0]
    assert calculator.calls_one_digit(prompts, completions) == [None, 0.0, None]
