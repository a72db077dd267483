r"""Pallas TPU kernels for hot paths where XLA's own program writes large arrays or leaves a unit of the chip
idle, each tested on CPU (in Pallas' interpreter) against the plain JAX it replaces.

Contents:
- `flash_attention`: Gemma's attention (1 and 2) without a cache through Pallas' Splash kernel on a TPU mesh,
  the padding as segment ids: [B, H, T, T] scores never written, forward or backward (common.load_model
  installs it)
- `categorical` (`fits`: where it applies): a sampler's draw from softmax(logits / T), the output layer's
  matmul and jax.random.categorical's Gumbel-max draw in one pass over the vocabulary, the logits never
  written. XLA runs them as three passes (the matmul writing [B, V] logits, then the draw's threefry noise
  and arg-max, then a log-sum-exp), and the draw's integer work (threefry: ~130 operations a logit) waits
  for the matmul; in one pass the matrix unit's work hides mostly under the vector units' (on a v5e at batch
  256: 2.4 ms where XLA's three passes take 3.2-3.6; benchmarks/RESULTS.md, section 12).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

# Splash attention's query and key block (flash_attention), forward and backward: on one v5e at Gemma-2B
# width and T = 1024, 512 took full fine-tuning from 68.1% to 69.7% MFU, where 128 (the kernel's default)
# slowed it to 62.3% and 1024 failed to compile (benchmarks/RESULTS.md, section 12)
SPLASH_BLOCK = 512

FUSED_DRAW = True  # benchmarks/decode.py turns it off to time XLA's draw beside the kernel
# vocabulary rows a grid step of the draw: on a v5e at B 256, 2.43 ms a draw at 2,048, 2.52 at 1,024, 2.72 at 512;
# 4,096: 2.43 where 2,048 took 2.31 in another run (benchmarks/draw.py; RESULTS.md, section 12)
DRAW_BLOCK = 2048
THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def flash_attention(backbone, mesh, interpret=False, block=SPLASH_BLOCK):
    """On a TPU mesh, Gemma's (1 and 2) attention without a cache (every training and scoring forward) runs
    the Splash kernel (jax.experimental.pallas): [B, H, T, T] scores are never written, forward or backward
    (it keeps q, k, v, the output and a log-sum-exp per query), and causal blocks above the diagonal are
    skipped. KerasHub's own call gives the kernel up for a traced padding mask; here the padding becomes
    Splash's segment ids: a position sees the positions of its own segment (real 1, padding 0) at or before
    it, so every real query sees exactly the keys KerasHub's mask shows it (a padding query's output, which
    no loss reads, differs). Gemma 2's soft cap and sliding window go into the kernel. A cached call
    (decode, prefill), a length that `block` positions do not tile or under two blocks (measured faster at
    T = 1024; one block skips nothing and was not measured), other families and other platforms keep
    KerasHub's attention. interpret: Pallas' interpreter (tests on CPU)."""
    import keras_hub  # loaded already: common.py, which calls this, set its backend first

    if not interpret and (
        mesh.devices.flat[0].platform != "tpu" or not isinstance(backbone, keras_hub.models.GemmaBackbone)
    ):
        return
    for layer in backbone.transformer_layers:
        layer.attention._compute_attention = functools.partial(
            _splash,
            attention=layer.attention,
            keras_attention=layer.attention._compute_attention,
            mesh=mesh,
            interpret=interpret,
            block=block,
        )


def _splash(q, k, v, attention_mask, *, attention, keras_attention, mesh, interpret, block, **kwargs):
    """flash_attention's replacement for CachedGemmaAttention._compute_attention: q [B, T, H, D], k and v
    [B, T, K, D] (K divides H), attention_mask [B, T, T] (padding and causal, as KerasHub builds it)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    b, t, h, d = q.shape
    data, model = mesh.shape["data"], mesh.shape["model"]
    if (
        k.shape[1] != t or t % block or t < 2 * block or b % data or attention.dropout
    ):  # measured: T = 2 blocks
        return keras_attention(q, k, v, attention_mask, **kwargs)
    scale = 1 / np.sqrt(d if attention.query_head_dim_normalize else attention.hidden_dim // h)
    heads = P("data", "model") if h % model == 0 and k.shape[2] % model == 0 else P("data")
    local_h = h // model if len(heads) > 1 else h
    if attention.use_sliding_window_attention:  # KerasHub's window: the key at most W - 1 positions back
        mask = masks.LocalMask((t, t), (attention.sliding_window_size - 1, 0), offset=0)
    else:
        mask = masks.CausalMask((t, t))
    splash = kernel.make_splash_mha(
        masks.MultiHeadMask([mask] * local_h),
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=attention.logit_soft_cap,
        interpret=interpret,
        block_sizes=kernel.BlockSizes(  # every block of the forward and of the backward's two kernels
            **dict.fromkeys(
                ("block_q", "block_kv", "block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq"), block
            )
        ),
    )

    def local(q, k, v, segments):  # one device's [b, h, T, D] q and [b, k, T, D] k, v; segments [b, T]
        ids = kernel.SegmentIds(q=segments, kv=segments)
        return jax.vmap(splash)(q * jnp.asarray(scale, q.dtype), k, v, segment_ids=ids)  # as KerasHub's

    # [B, T]: 1 + the first key a query sees (its example's start: one id an example, packed rows too), 0 padding
    segments = jnp.where(
        jnp.diagonal(attention_mask, axis1=1, axis2=2), jnp.argmax(attention_mask, axis=-1) + 1, 0
    ).astype(jnp.int32)
    out = jax.shard_map(
        local, mesh=mesh, in_specs=(heads, heads, heads, P("data")), out_specs=heads, check_vma=False
    )(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), segments)
    return out.transpose(0, 2, 1, 3)  # [B, T, H, D]


def on_chip(backbone):
    """One TPU chip (a mesh of several keeps XLA's partitioned draw), computing in bf16 (in float32, XLA's
    matmul takes bf16 passes where the kernel's would not)."""
    return jax.device_count() == 1 and jax.default_backend() == "tpu" and backbone.compute_dtype == "bfloat16"


def fits(backbone, batch, temperature):
    """Whether `categorical` draws an unfiltered sample at these settings (common.categorical asks): on_chip,
    T > 0, an output layer with no soft cap (Gemma 2's) or cast of its own, JAX's default keys (threefry,
    partitionable: the bits `threefry_bits` computes), B · V < 2^32 (the counter's high word is 0)."""
    layer = backbone.token_embedding
    return (
        FUSED_DRAW
        and on_chip(backbone)
        and temperature > 0
        and getattr(layer, "logit_soft_cap", None) is None
        and getattr(layer, "reverse_dtype", None) is None
        and jax.config.jax_default_prng_impl == "threefry2x32"
        and jax.config.jax_threefry_partitionable
        and batch * backbone.vocabulary_size < 2**32
    )


def categorical(backbone, hidden, key, temperature, *, block=DRAW_BLOCK, interpret=None):
    """For final hidden states [B, D] (after the last norm, in the compute dtype) -> (token [B] int32, log q
    [B]): token = argmax(gumbel(key, [B, V]) + logits / T), the first index at a tie, as
    jax.random.categorical(key, logits / T) draws it; log q = its logit / T − logsumexp(logits / T). The
    logits as the output layer computes them (backbone.token_embedding, tied or not: the matmul in the
    compute dtype, accumulated in float32), `block` vocabulary rows a grid step. interpret: run in Pallas'
    interpreter (None: off a TPU)."""
    layer = backbone.token_embedding
    tied = layer.tie_weights
    w = (layer.embeddings if tied else layer.reverse_embeddings).value.astype(hidden.dtype)  # [V, D] | [D, V]
    b, d = hidden.shape
    vocab = w.shape[0] if tied else w.shape[1]
    rows = b + -b % 8  # a whole number of sublanes
    block = min(block, vocab + -vocab % 128)
    keys = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,  # the key's two words, in scalar memory
        grid=(-(-vocab // block),),
        in_specs=[
            pl.BlockSpec((rows, d), lambda j, k: (0, 0)),  # the hidden states: read once, kept
            pl.BlockSpec((block, d), lambda j, k: (j, 0))
            if tied
            else pl.BlockSpec((d, block), lambda j, k: (0, j)),
        ],
        out_specs=[pl.BlockSpec((rows, 1), lambda j, k: (0, 0))] * 2,
        scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32)] * 4 + [pltpu.VMEM((rows, 1), jnp.int32)],
    )
    settings = {"vocab": vocab, "block": block, "temperature": temperature, "tied": tied}
    token, logq = pl.pallas_call(
        functools.partial(_draw, **settings),
        grid_spec=spec,
        out_shape=[jax.ShapeDtypeStruct((rows, 1), jnp.int32), jax.ShapeDtypeStruct((rows, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=64 * 2**20),
        interpret=jax.default_backend() != "tpu" if interpret is None else interpret,
    )(jax.lax.bitcast_convert_type(keys, jnp.int32), jnp.pad(hidden, ((0, rows - b), (0, 0))), w)
    return token[:b, 0], logq[:b, 0]


def _draw(
    key, hidden, w, token, logq, best_z, best_logit, m, s, best_index, *, vocab, block, temperature, tied
):
    """One grid step: block j of the vocabulary. Carried over the steps (scratch): the best noised value so
    far, its index and scaled logit; the log-sum-exp's running max m and sum s of exp(logit / T − m)."""
    j = pl.program_id(0)

    @pl.when(j == 0)
    def _():
        best_z[...] = jnp.full(best_z.shape, -jnp.inf)
        best_index[...] = jnp.full(best_index.shape, vocab, jnp.int32)
        best_logit[...] = jnp.zeros(best_logit.shape)
        m[...] = jnp.full(m.shape, -jnp.inf)
        s[...] = jnp.zeros(s.shape)

    contract = ((1,), (1,)) if tied else ((1,), (0,))  # w's D axis: [block, D] tied, [D, block] not
    raw = jax.lax.dot_general(hidden[...], w[...], (contract, ((), ())), preferred_element_type=jnp.float32)
    scaled = raw.astype(hidden.dtype).astype(jnp.float32) / temperature  # [B, block]: the layer's rounding
    column = j * block + jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
    row = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 0)
    z = gumbel(threefry_bits(key[0], key[1], row * vocab + column)) + scaled
    if vocab % block:  # the last block reaches past V: those columns count for nothing
        z = jnp.where(column < vocab, z, -jnp.inf)
        scaled = jnp.where(column < vocab, scaled, -jnp.inf)
    z_max = z.max(1, keepdims=True)
    first = jnp.where(z == z_max, column, vocab).min(1, keepdims=True)  # the block's first index at its max
    take = z_max > best_z[...]  # strictly: an earlier block wins a tie
    best_z[...] = jnp.where(take, z_max, best_z[...])
    best_index[...] = jnp.where(take, first, best_index[...])
    at_first = jnp.where(column == first, scaled, 0.0).sum(1, keepdims=True)
    best_logit[...] = jnp.where(take, at_first, best_logit[...])
    m_new = jnp.maximum(m[...], scaled.max(1, keepdims=True))
    s[...] = s[...] * jnp.exp(m[...] - m_new) + jnp.exp(scaled - m_new).sum(1, keepdims=True)
    m[...] = m_new

    @pl.when(j == pl.num_programs(0) - 1)
    def _():
        token[...] = best_index[...]
        logq[...] = best_logit[...] - m[...] - jnp.log(s[...])


def threefry_bits(k1, k2, counter):
    """jax.random.bits(key, shape) of 32 bits under JAX's default threefry2x32 with partitionable keys:
    element i's bits are threefry2x32(key, (0, i))'s two words xor-ed; counter: the flat indices i (< 2^32),
    int32 arrays throughout (the same bits as uint32; +, ^ and shifts wrap alike), 20 rounds in 5 groups."""
    ks = (k1, k2, k1 ^ k2 ^ jnp.int32(0x1BD11BDA))
    x0 = jnp.zeros_like(counter) + ks[0]
    x1 = counter + ks[1]
    for i in range(5):
        for r in THREEFRY_ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ ((x1 << r) | jax.lax.shift_right_logical(x1, jnp.int32(32 - r)))  # x1 rotated left by r
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.int32(i + 1)
    return x0 ^ x1


def gumbel(bits):
    """jax.random.gumbel's float32 noise from its 32 random bits (int32): −log(−log(u)), u uniform in
    [tiny, 1) from the bits' top 23 as a mantissa."""
    tiny = jnp.float32(jnp.finfo(jnp.float32).tiny)
    one_to_two = jax.lax.shift_right_logical(bits, jnp.int32(9)) | jnp.int32(0x3F800000)  # [1, 2) as bits
    u = jax.lax.bitcast_convert_type(one_to_two, jnp.float32) - 1.0
    return -jnp.log(-jnp.log(jnp.maximum(tiny, u + tiny)))
