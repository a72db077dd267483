"""What is done to each decoder block of a KerasHub backbone, below the scripts and the run shell:
  1. Remat    enable_remat (a jax.checkpoint switch per decoder block), Remat (--remat: the policy asked for;
              auto: the first policy whose compiled step fits, every policy compiled at once, the decision
              remembered for the next run of the same step on the same machine)
  2. Packing  enable_packing, packed: attention that stops at each example's end and positions that restart
              at its start, for rows that hold several examples (sft.py --packing), pack (the rows)
common and plumbing import it; it imports interop (UsageError) alone. jax and keras are imported inside the
functions that use them, as in plumbing: `python dpo.py --help` stays instant."""

import contextlib
import functools
import hashlib
import json
import os
import time

from interop import UsageError

# --- 1. Remat: activation checkpointing per decoder block, --remat {auto,off,full,minimal,save_dots,...} ---
# What a decoder block keeps for the backward pass, by --remat (MaxText's names where they mean the same), from
# the least recompute (fastest, most memory) to the most; `auto` takes the first whose compiled step fits.
REMAT_POLICIES = {
    "off": None,  # no checkpoint: every activation kept
    "save_dots": "dots_saveable",  # every matmul's output kept (attention's too), the rest recomputed
    "minimal": "checkpoint_dots_with_no_batch_dims",  # the weight projections' outputs kept; attention recomputed
    "minimal_offloaded": "offload_dot_with_no_batch_dims",  # those outputs kept in host memory (TPU, GPU)
    "full": "nothing_saveable",  # only the block's input kept: everything recomputed (about +1/3 FLOPs)
}
# "off/2": nothing recomputed, each micro-batch run as two halves, accumulated (as --grad-accum-steps doubled: the
# same update where a script's accumulation is exact, Remat.jit's `split`). One v5e, LoRA r16 at Gemma-2B,
# 8 x 1024: 69.3% MFU as two halves, 50.3% with "full" (benchmarks/RESULTS.md, section 12).
AUTO_ORDER = (
    "off",
    "off/2",
    "save_dots",
    "minimal",
    "full",
)  # offloading waits on the host link: asked for by name only


def checkpoint_policy(mode):
    """--remat's mode ("on": "full") -> the jax.checkpoint policy of a decoder block; None for "off"."""
    import jax

    name = REMAT_POLICIES["full" if mode == "on" else mode]
    if name == "offload_dot_with_no_batch_dims":
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    return getattr(jax.checkpoint_policies, name) if name else None


def enable_remat(backbone, mode="full"):
    """Activation checkpointing per decoder block, by `backbone.remat_mode` (a REMAT_POLICIES key, "on" for
    "full"; read when a step is traced, so Remat's auto can switch it): "full" keeps only the block inputs
    [B, T, D] between forward and backward (Gemma-2B DPO fits 16 GiB chips), "minimal" and "save_dots" keep
    more and recompute less. Calls with a KV cache (generation) are left alone. A block's added losses (MoE
    router loss) leave the checkpoint as outputs."""
    import jax
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    backbone.remat_mode = mode
    for layer in [] if hasattr(backbone, "_remat_layers") else getattr(backbone, "transformer_layers", []):

        def call(*args, _call=layer.call, **kwargs):
            # a call with a KV cache (generation) is left alone
            if backbone.remat_mode == "off" or any(
                v is not None for k, v in kwargs.items() if "cache" in k and "index" not in k
            ):
                return _call(*args, **kwargs)
            arrays = {k: v for k, v in kwargs.items() if hasattr(v, "shape")}
            rest = {k: v for k, v in kwargs.items() if k not in arrays}
            losses = getattr(get_stateless_scope(), "losses", [])  # none outside a stateless scope

            def block(a, kw):  # a loss added inside, left in the scope, would be a leaked tracer
                n = len(losses)
                out = _call(*a, **kw, **rest)
                added = losses[n:]  # taken out of the scope, returned instead
                del losses[n:]
                return out, added

            out, added = jax.checkpoint(block, policy=checkpoint_policy(backbone.remat_mode))(args, arrays)
            losses.extend(added)
            return out

        layer.call = call
    backbone._remat_layers = True
    return backbone


def device_memory_limit():
    """Bytes one device may allocate; None where the backend sets no limit (CPU)."""
    import jax

    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def choose_remat(peak_of, limit, modes=AUTO_ORDER):
    """--remat auto's decision: the first of `modes` (the least recompute first) whose step fits 90% of
    `limit` bytes a device (the 10%: what the compiler's analysis leaves out: fragmentation, runtime buffers,
    the next batch). peak_of(mode) -> the compiled peak in bytes, or raises where the compile itself runs out
    of memory (that mode does not fit). -> (mode, why: each mode's need, for the log). None fits: a
    UsageError with the need of the last and the flags that lower it."""
    needs = []
    for mode in modes:
        try:
            peak = peak_of(mode)
        except Exception as e:  # XLA's RESOURCE_EXHAUSTED: the compile (or its program) did not fit
            if "RESOURCE_EXHAUSTED" not in str(e) and "Out of memory" not in str(e):
                raise
            found = [x for x in str(e).splitlines() if "exceeds" in x or "RESOURCE_EXHAUSTED" in x]
            needs.append(f"{mode}: does not compile in the memory ({(found or [str(e)])[0].strip()[:160]})")
        else:
            needs.append(f"{mode} {peak / 2**30:.2f} GiB")
            if peak <= 0.9 * limit:
                return mode, f"compiled peak per device: {', '.join(needs)}; of {limit / 2**30:.2f} GiB"
    raise UsageError(
        f"the train step does not fit a device's {limit / 2**30:.2f} GiB with any remat policy "
        f"({'; '.join(needs)}): lower --batch-size (--grad-accum-steps keeps the batch: the micro-batch is "
        "what counts), --max-length, train LoRA (--lora-rank 16), or spread over more devices (--mesh)"
    )


class Remat:
    """--remat for `backbones`: "off" leaves them untouched; else each decoder block gets a switch
    (enable_remat) that `jit` sets: the policy asked for; auto: off where the device sets no memory limit
    (CPU: remat is pure cost), else decided at the first call (choose). `limit`: the device's bytes (None: the
    device's own; benchmarks/memory.py passes a target's). say: where the decision is told (plumbing's
    announce: process 0, above the progress bar). str(remat): the mode."""

    def __init__(self, mode, *backbones, limit=None, say=print):
        self.requested = mode
        self.mode = None if mode == "auto" else mode  # auto: set at the first call
        self.limit = limit
        self.say = say
        self.backbones = []
        for backbone in backbones:
            self.add(backbone)

    def add(self, backbone):
        """Put one more backbone (e.g. PPO's value model) under the same switch."""
        if self.requested != "off":
            self.backbones.append(
                enable_remat(backbone, "off" if self.requested == "auto" else self.requested)
            )
        return backbone

    def __str__(self):
        return self.mode or self.requested

    def _resolve(self, mode, fn, jit_kwargs, split=None):
        import jax

        self.mode = mode
        policy, _, halves = mode.partition("/")
        for backbone in self.backbones:
            backbone.remat_mode = policy
        if halves:  # "off/2": the batch argument's micro-batches cut in two
            fn = functools.partial(halve_batch, fn, split, self.shards)
        # a new function object: jax.jit caches traces per function, and the switch is read when tracing
        return jax.jit(functools.partial(fn), **jit_kwargs)

    def jit(self, fn, length=None, split=None, **jit_kwargs):
        """jax.jit(fn, **jit_kwargs) with the remat mode applied. auto, on a device with a memory limit: at the
        first call the policy is chosen (choose) for that call's shapes and shardings, the batch (third
        argument, leaves [A, B, T, ...]) at `length` tokens (the run's longest), and logged in one line with
        why; the program compiled for the choice runs every call at those shapes. split: where the script's
        accumulation over micro-batches is exact (a sum over equal micro-batches), the batch argument's index
        (2 in the scripts): auto may then run each micro-batch as two halves ("off/2")."""
        import jax

        limit = self.limit or device_memory_limit()
        if self.requested != "auto" or limit is None:
            if self.requested == "auto":
                self.say(f"remat: auto -> off ({jax.devices()[0].platform}: no device memory limit)")
            return self._resolve("off" if self.requested == "auto" else self.requested, fn, jit_kwargs)
        resolved = []  # the jitted step at the chosen mode, the batch shapes compiled for, that program

        def shapes(args):  # what a compiled program takes: the tree, each leaf's shape, dtype and layout
            return jax.tree.structure(args), [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(args)]

        def at_length(spec):  # a batch leaf [A, B, T, ...] at the run's longest length
            return (
                spec.update(shape=spec.shape[:2] + (length,) + spec.shape[3:])
                if length and spec.ndim >= 3
                else spec
            )

        def step(*a):
            if not resolved:
                spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), a)
                spec = (*spec[:2], jax.tree.map(at_length, spec[2]), *spec[3:])
                t = time.perf_counter()
                mode, why, compiled = self.choose(fn, spec, limit, split=split, **jit_kwargs)
                self.say(f"remat: auto -> {mode} ({why}; {time.perf_counter() - t:.0f} s; {ASKED[mode]})")
                resolved.extend([self._resolve(mode, fn, jit_kwargs, split), shapes(spec), compiled])
            # the compiled program itself where the shapes are its own (no second trace, no cache read)
            return (resolved[2] if shapes(a) == resolved[1] else resolved[0])(*a)

        return step

    def choose(self, fn, spec, limit, split=None, **jit_kwargs):
        """auto's decision for jax.jit(fn, **jit_kwargs) at arguments `spec` (shapes and shardings) -> (mode,
        why, its compiled program); the switches are left at it. The mode this machine decided for the same
        step before (remembered) is compiled alone and checked. Else every policy of AUTO_ORDER ("off/2" where
        `split` names a batch whose micro-batches halve on every device) is traced in turn, each compile
        started in a thread as its trace ends (XLA compiles outside Python's lock), and the first in that
        order whose compiled peak fits 90% is taken (choose_remat): the choice of compiling them one after
        another, in about the time of the slowest compile instead of their sum (benchmarks/RESULTS.md)."""
        import concurrent.futures

        import jax

        # the devices a halved batch spreads over (B's; False: no halving), for _resolve's "off/2"
        self.shards = split is not None and batch_shards(spec[split])
        modes = [m for m in AUTO_ORDER if "/" not in m or self.shards]
        named = getattr(fn, "func", fn)  # a script's train_step: its module too (dpo's and simpo's differ)
        step = (
            named.__module__,
            named.__qualname__,
            [getattr(b, "logits_chunk", None) for b in self.backbones],  # memory, not shapes
            jax.tree.map(repr, spec),
            jax.devices()[0].device_kind,
        )
        key = hashlib.sha256(f"{step} {limit} {jax.__version__}".encode()).hexdigest()[:24]
        if (before := remembered(key)) in modes:
            compiled = {}  # compiled inside choose_remat, which reads a compile running out of memory as a no
            with contextlib.suppress(UsageError):  # it no longer fits: decided afresh below
                mode, why = choose_remat(
                    lambda m: peak_bytes(
                        compiled.setdefault(m, self._resolve(m, fn, jit_kwargs, split).lower(*spec).compile())
                    ),
                    limit,
                    [before],
                )
                return mode, f"{why}; as decided here before for this step", compiled[mode]
        pool = concurrent.futures.ThreadPoolExecutor(len(modes))
        compiling = {
            m: pool.submit(self._resolve(m, fn, jit_kwargs, split).lower(*spec).compile) for m in modes
        }
        try:
            mode, why = choose_remat(lambda m: peak_bytes(compiling[m].result()), limit, modes)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # the later policies' compiles end unread
        remembered(key, mode)
        self._resolve(mode, fn, jit_kwargs, split)
        return mode, why, compiling[mode].result()


# How each auto choice is asked for by name (the check skipped): off/2 is the flag's off at twice the steps
ASKED = {m: f"--remat {m} asks for it by name" for m in AUTO_ORDER}
ASKED["off/2"] = "--remat off with --grad-accum-steps doubled asks for the same"


def remembered(key, mode=None, folder=None):
    """--remat auto's decisions on this machine, in `folder` (None: beside JAX's compilation cache; none where
    that is off): key -> the mode decided (None: none yet); with `mode`: stored under key."""
    import jax

    folder = folder or jax.config.jax_compilation_cache_dir
    if not folder:
        return None
    path = os.path.join(folder, "remat-auto.json")
    known = {}
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        known = json.load(f)
    if mode is None:
        return known.get(key)
    known[key] = mode
    os.makedirs(folder, exist_ok=True)
    with open(f"{path}.{os.getpid()}", "w") as f:
        json.dump(known, f)
    os.replace(f"{path}.{os.getpid()}", path)  # whole, for a process reading it at the same moment


def batch_shards(batch):
    """The devices a batch's leaves [A, B, ...] spread B over, where each device's rows halve evenly; else 0."""
    import jax

    sizes = {
        (x.shape[1], x.sharding.shard_shape(x.shape)[1]) if x.ndim > 1 else (0, 1)
        for x in jax.tree.leaves(batch)
    }
    rows, local = sizes.pop() if len(sizes) == 1 else (0, 1)  # one B, one split of it, for every leaf
    return rows // local if local % 2 == 0 else 0


def halve_batch(fn, index, shards, *args):
    """fn(*args) with args[index]'s leaves [A, B, ...] as [2A, B/2, ...]: micro-batch a becomes 2a and 2a + 1,
    each taking the first or the second half of every device's rows (`shards` devices: no data moves)."""
    import jax

    def halve(x):
        a, b = x.shape[:2]
        x = x.reshape(a, shards, 2, b // shards // 2, *x.shape[2:]).swapaxes(1, 2)  # [A, 2, D, B/2D, ...]
        return x.reshape(2 * a, b // 2, *x.shape[4:])

    return fn(*args[:index], jax.tree.map(halve, args[index]), *args[index + 1 :])


def peak_bytes(compiled):
    """Bytes a device needs for a compiled program, from the compiler (argument + output + temp − alias)."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


# --- 2. Packing: several examples in one row (sft.py --packing), none seeing another ---
SEGMENTS = []  # the packed batch's segment ids [B, T] while its forward is traced (packed)


@contextlib.contextmanager
def packed(backbone, padding_mask):
    """The forward inside sees each row's examples apart where `padding_mask` [B, T] holds segment ids (an
    integer array: 1, 2, … per example of a row, 0 padding): each decoder block's attention mask keeps a
    query's own example only, and rotary positions restart at 0 at each example's start. A boolean mask
    (one example a row) leaves the forward as it is. The first packed call hooks the backbone's blocks."""
    import jax.numpy as jnp

    segmented = jnp.issubdtype(padding_mask.dtype, jnp.integer)
    if segmented and not hasattr(backbone, "_packing"):
        enable_packing(backbone)
    SEGMENTS.append(padding_mask if segmented else None)
    try:
        yield
    finally:
        SEGMENTS.pop()


def example_positions(padding_mask):
    """Each token's position [B, T] int32: in its own example (0 at its first token) for segment ids; for a
    boolean mask 0 … T-1, as the families count them."""
    import jax
    import jax.numpy as jnp

    t = jnp.broadcast_to(jnp.arange(padding_mask.shape[1]), padding_mask.shape)
    if not jnp.issubdtype(padding_mask.dtype, jnp.integer):
        return t
    starts = jnp.where(padding_mask != jnp.pad(padding_mask, ((0, 0), (1, 0)))[:, :-1], t, 0)
    return t - jax.lax.cummax(starts, axis=1)


def enable_packing(backbone):
    """Hooks on every decoder block (while `packed` holds segment ids): the mask its attention is given
    (KerasHub's padding-and-causal one, from the block's _compute_attention_mask or
    _compute_self_attention_mask), and with it Splash's segment ids on a TPU, is cut to pairs within one
    example; each rotary embedding (Gemma, Llama, Mistral, Qwen) counts positions from the example's start.
    A family whose blocks carry state from token to token (Qwen 3.5's linear attention) is refused."""
    import jax.numpy as jnp
    from keras_hub.src.layers.modeling.rotary_embedding import RotaryEmbedding

    def masked(compute, *args, **kwargs):
        mask = compute(*args, **kwargs)
        if not SEGMENTS or SEGMENTS[-1] is None:  # not packed, or not a training forward (a sampler's)
            return mask
        same = SEGMENTS[-1][:, :, None] == SEGMENTS[-1][:, None, :]  # [B, T, T]
        return jnp.where(same, mask, jnp.zeros_like(mask))

    def restarted(rotate, inputs, start_index=0, positions=None):
        if SEGMENTS and SEGMENTS[-1] is not None and positions is None:
            positions = example_positions(SEGMENTS[-1])
        return rotate(inputs, start_index=start_index, positions=positions)

    for layer in backbone.transformer_layers:
        names = [n for n in ("_compute_attention_mask", "_compute_self_attention_mask") if hasattr(layer, n)]
        if not names or "linear_attention" in getattr(backbone, "layer_types", ()):
            raise UsageError(
                f"--packing: {type(layer).__name__} layers are not packed here (dense attention only)"
            )
        setattr(layer, names[0], functools.partial(masked, getattr(layer, names[0])))
        for sub in layer._flatten_layers():
            if isinstance(sub, RotaryEmbedding):
                sub.call = functools.partial(restarted, sub.call)
    backbone._packing = True


def pack(examples, length):
    """TRL's packing (best-fit decreasing; no example is cut): (ids, mask) examples -> rows of at most `length`
    tokens, each (ids, mask, segment ids 1, 2, … one per example), the longest example first, each into the
    row it fills the most."""
    import bisect

    import numpy as np

    rows, free = [], []  # the examples of each row; (room left, row) sorted
    for i in sorted(range(len(examples)), key=lambda i: -len(examples[i][0])):
        n = len(examples[i][0])
        at = bisect.bisect_left(free, (n, -1))  # the row with the least room that still holds it
        room, row = free.pop(at) if at < len(free) else (length, len(rows))
        rows += [[]] if row == len(rows) else []
        rows[row].append(examples[i])
        bisect.insort(free, (room - n, row))
    return [
        tuple(np.concatenate(parts) for parts in zip(*r))
        + (np.repeat(np.arange(1, len(r) + 1, dtype=np.int32), [len(ids) for ids, _ in r]),)
        for r in rows
    ]
