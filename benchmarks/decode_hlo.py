r"""What a decode step does on a TPU chip, seen from a CPU: the sampler (`<script>.generate`) compiled for one
TPU v5e chip through libtpu's topology (as memory.py compiles a train step; no chip needed), with abstract
Gemma weights held in bfloat16, and the ops inside its `lax.while_loop` body (one decode step) counted by kind:
copies, dynamic slices, transposes, reductions, the fusions that write [B, V] arrays (the output layer's
logits, the draw's noise). Run it before and after a change to the sampler (`--before REV`: that revision's
<script>.py and common.py, as decode.py takes them) and compare the counts:
    python benchmarks/decode_hlo.py --model gemma_2b --num-layers 2 --batch-size 256 --before main
    python benchmarks/decode_hlo.py --model gemma_2b --num-layers 2 --dump /tmp/step.hlo   # the body's text
Prints one JSON line per side last. Fewer layers compile faster; a decoder block's ops repeat per layer.
"""

import collections
import functools
import inspect
import json
import os
import re
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import plumbing  # noqa: E402  (instant: `--help` below answers before the heavy imports)

plumbing.answer_help(__name__, __file__)

import harness  # noqa: E402  (build_backbone; imports common)
import decode  # noqa: E402  (modules_at)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


@dataclass
class Args:
    script: str = "grpo"
    """whose `generate` is compiled: grpo, ppo or evaluate"""
    before: str = ""
    """a git revision whose <script>.py and common.py are compiled too, counted beside the working tree's"""
    model: str = "gemma_2b"
    """architecture (benchmarks/harness.py ARCHS), abstract weights"""
    num_layers: int = 2
    """decoder blocks (0: the model's own); each adds the same ops"""
    batch_size: int = 256
    prompt_length: int = 64
    response_length: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    chip: str = "v5e"
    """libtpu's name of the one chip compiled for: v5e, v5p, v6e"""
    dump: str = ""
    """a file: the while body's HLO text (and the computations it calls) is written there (`.before` added
    for --before's)"""


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+(?: \S+)*?) ([\w\-]+)\((.*)$")


def computations(text):
    """{name: [instruction lines]} of an HLO module's text."""
    out, name = {}, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line[0].isspace():  # a computation's header; its instructions are indented
            name = m.group(1)
            out[name] = []
        elif line.strip() == "}":
            name = None
        elif name is not None and line.strip():
            out[name].append(line)
    return out


def parse(line):
    """(name, shape text, opcode, rest) of an instruction line, or None."""
    m = _INSTRUCTION.match(line)
    return m and m.groups()


def called(rest):
    return re.findall(r"(?:calls|body|condition|to_apply|branch_computations)=\{?%?([\w.\-]+)", rest)


def while_body(comps):
    """The largest while loop's body: the decode step."""
    bodies = [
        re.search(r"body=%?([\w.\-]+)", line).group(1)
        for lines in comps.values()
        for line in lines
        if " while(" in line
    ]
    return max(bodies, key=lambda b: len(comps[b]))


def count(comps, body, b, v):
    """Counts of the body's top-level ops by opcode; fusions by what they hold; ops writing a [B, V] array."""
    ops, fused_roots, bv_writes = collections.Counter(), collections.Counter(), []
    for line in comps[body]:
        p = parse(line)
        if not p:
            continue
        name, shape, opcode, rest = p
        ops[opcode] += 1
        if opcode == "fusion":
            inner = [parse(x) for x in comps.get(called(rest)[0], [])]
            kinds = {x[2] for x in inner if x} & {
                "dynamic-slice",
                "dynamic-update-slice",
                "copy",
                "transpose",
                "reduce",
                "convolution",
                "dot",
                "rng-bit-generator",
                "sort",
            }
            fused_roots["+".join(sorted(kinds)) or "elementwise"] += 1
        written = re.findall(rf"(\w+)\[{b},{v}\]", shape)  # the [B, V] arrays it writes
        if written and opcode not in ("parameter", "get-tuple-element", "tuple", "bitcast"):
            bv_writes.append(f"{name} ({opcode}): " + ", ".join(f"{t}[{b},{v}]" for t in written))
    return {
        "estimated_cycles": estimated_cycles(comps[body]),
        "async_copied_mb": async_copied_mb(comps[body]),
        "ops": dict(ops.most_common()),
        "fusions_by_content": dict(fused_roots.most_common()),
        "bv_writes": bv_writes,
    }


def estimated_cycles(lines):
    """The compiler's own cost estimate (backend_config estimated_cycles) of the body's top-level ops, summed
    by what they compute (their op_name, the decoder block's number dropped): a prediction, not a timing."""
    out = collections.Counter()
    for line in lines:
        cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
        name = re.search(r'op_name="[^"]*?while/body/([^"]*)"', line)
        if cycles:
            where = re.sub(r"decoder_block_\d+/", "", name.group(1)) if name else "(no name)"
            out["/".join(where.split("/")[:2])] += int(cycles.group(1))
    return {"total": sum(out.values()), **dict(out.most_common(12))}


def async_copied_mb(lines):
    """MB the body's async copies and slices (copy-start, slice-start) move between memories (the compiler's
    prefetches: weights, cache, into on-chip memory): their cost is in no op's estimated cycles, and the ops
    that read what they move look the cheaper for it."""
    sizes = {"bf16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1}
    total = 0
    for line in lines:
        p = parse(line)
        if p and p[2] in ("copy-start", "slice-start"):
            dest = re.findall(r"(\w+)\[([\d,]*)\]", p[1])[-2]  # (source, destination, context)
            total += sizes.get(dest[0], 4) * int(np.prod([int(d) for d in dest[1].split(",") if d]))
    return total / 1e6


def body_text(comps, body):
    """The body and every computation it calls, transitively."""
    seen, todo = [], [body]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.append(name)
        for line in comps[name]:
            todo += called(line)
    return "\n\n".join(f"{n} {{\n" + "\n".join(comps[n]) + "\n}" for n in seen)


def chip_mesh(chip):
    """A 1 × 1 ("data", "model") mesh on one chip of libtpu's topology (a host of one chip: memory.py's
    slices have 2 × 2 chips a host, which a 1x1 topology is refused for)."""
    from jax.experimental import topologies

    shape = "1x1x1" if chip == "v5p" else "1x1"
    devices = topologies.get_topology_desc(f"{chip}:{shape}", "tpu", chips_per_host_bounds=(1, 1, 1)).devices
    return jax.sharding.Mesh(np.asarray(devices).reshape(1, 1), ("data", "model"))


def main(args):
    mesh = chip_mesh(args.chip)
    overrides = {"num_layers": args.num_layers} if args.num_layers else {}
    backbone = harness.build_backbone(args.model, mesh, "bfloat16", abstract=True, overrides=overrides)
    params, frozen = harness.abstract_variables(backbone, "bfloat16", all_frozen=True)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    b, q = args.batch_size, args.prompt_length
    queries = jax.ShapeDtypeStruct((b, q), jnp.int32, sharding=replicated)
    query_mask = jax.ShapeDtypeStruct((b, q), jnp.bool_, sharding=replicated)
    key_data = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
    scripts = {"after": __import__(args.script)}
    if args.before:
        scripts["before"] = decode.modules_at(args.before, ["common", args.script])[args.script]
    for side, module in sorted(scripts.items(), reverse=True):
        stop = "stop_ids" if "stop_ids" in inspect.signature(module.generate).parameters else "eos_id"
        settings = {"response_length": args.response_length, "temperature": args.temperature}
        settings.update({stop: harness.EOS, "pad_id": 0, "top_p": args.top_p})
        gen = functools.partial(module.generate, backbone, **settings)
        fn = jax.jit(lambda p, f, qs, qm, k: gen(p, f, qs, qm, jax.random.wrap_key_data(k)))
        compiled = fn.lower(params, frozen, queries, query_mask, key_data).compile()
        comps = computations(compiled.as_text())
        body = while_body(comps)
        if args.dump:
            with open(args.dump + (".before" if side == "before" else ""), "w") as f:
                f.write(body_text(comps, body))
        out = {"side": side, "revision": args.before if side == "before" else "working tree"}
        out.update({"batch_size": b, "num_layers": args.num_layers or backbone.num_layers})
        out.update(count(comps, body, b, backbone.vocabulary_size))
        memory_stats = compiled.memory_analysis()
        out["temp_gib"] = memory_stats.temp_size_in_bytes / 2**30
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    plumbing.launch(main, Args)
