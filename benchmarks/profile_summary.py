"""Where a profiled step's device time goes: a jax.profiler trace (.trace.json.gz, as throughput.py --profile and
decode.py --profile write them, tpu_check.sh's `profile` part copies them to trace_*.json.gz) summed by the
kind of op on each device's op line. Prints one JSON object: the device time in all, and the top kinds.
    python benchmarks/profile_summary.py trace_lora.json.gz [--top 25]
    python benchmarks/profile_summary.py trace_decode.json.gz --by op --per 32   # ms a decode step, by JAX op
A kind is the op's HLO category where the trace gives one (TPU traces: `hlo_category`), else its name without
the `.N` instance number (`fusion.12` -> fusion, `convolution.3` -> convolution); its long name's first words
are kept as an example, which tells a matmul fusion from an elementwise one. `--by op`: by the JAX operation
each op came from (`tf_op`, the decoder block's number dropped, so a row sums over the blocks); `--per N`
divides every time by N (a decode trace's steps)."""

import argparse
import collections
import gzip
import json
import re


def summarize(path, top=25, by="kind", per=1):
    with gzip.open(path) if path.endswith(".gz") else open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {}  # (pid, tid or None) -> process / thread name
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = e["args"]["name"]
    device = {
        pid for (pid, tid), name in names.items() if tid is None and re.search(r"TPU|GPU|/device:", name)
    }
    op_lines = {
        (pid, tid)
        for (pid, tid), name in names.items()
        if pid in device and tid is not None and "Ops" in name
    }
    kinds, examples = collections.Counter(), {}
    total = 0.0
    for e in events:
        if e.get("ph") != "X" or e["pid"] not in device:
            continue
        if op_lines and (e["pid"], e.get("tid")) not in op_lines:
            continue  # the module / step lines repeat the ops' time
        args = e.get("args", {})
        kind = args.get("hlo_category") or re.sub(r"\.\d+$", "", e["name"])
        if by == "op" and args.get("tf_op"):
            kind = re.sub(r"decoder_block_\d+", "decoder_block_N", args["tf_op"].rstrip(":"))
        kinds[kind] += e["dur"]
        total += e["dur"]
        long_name = args.get("long_name") or args.get("tf_op") or ""
        examples.setdefault(kind, " ".join(long_name.split()[:8]))
    return {
        "trace": path,
        "device_lines": sorted(names[k] for k in op_lines) or sorted(names[(p, None)] for p in device),
        "device_ms": total / 1e3 / per,
        "top": [
            {"kind": k, "ms": v / 1e3 / per, "share": v / total if total else 0.0, "example": examples[k]}
            for k, v in kinds.most_common(top)
        ],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--by", choices=("kind", "op"), default="kind")
    parser.add_argument(
        "--per", type=int, default=1, help="divide the times by this (a decode trace's steps)"
    )
    options = parser.parse_args()
    print(json.dumps(summarize(options.trace, options.top, options.by, options.per), indent=1))
