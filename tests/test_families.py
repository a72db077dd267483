"""Every advertised model family (common.FAMILIES) offline: a tiny random model of each backbone
class with a real tokenizer of its kind (SentencePiece for Gemma / Gemma 3 / Mistral, byte-level
BPE for Llama 3 / Qwen, trained here on the toy data), saved as a local KerasHub preset. Checked:
the sampler's forward (common.cached_forward) against KerasHub's own call_with_cache and backbone,
left padding, the chat template per family and --chat-template, --export-hf's tokenizer.json and chat
template per exported family, a multimodal preset loaded text-only, and one step of sft, dpo and grpo
and one evaluate call (SCRIPT_FAMILIES, in one subprocess on one device)."""

import io
import json
import math
import os
import subprocess
import sys
from unittest import mock

import pytest

from helpers import ROOT, byte_bpe, corpus, metrics

FAMILIES = ("gemma", "gemma2", "gemma3", "gemma4", "llama3", "mistral", "qwen2.5", "qwen3", "qwen3.5")
TEMPLATE = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma4": "gemma4",
    "llama3": "llama3",
    "mistral": "mistral",
    "qwen2.5": "chatml",
    "qwen3": "chatml",
    "qwen3.5": "qwen3.5",
}
QWEN3_5_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
SIZE = dict(num_layers=2, hidden_dim=64, intermediate_dim=128, num_query_heads=4, num_key_value_heads=2)


def sentencepiece(**ids):
    """A SentencePiece BPE model (bytes) in a family's special-token layout."""
    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()),
        model_writer=proto,
        vocab_size=400,
        model_type="bpe",
        split_digits=True,
        byte_fallback=True,
        hard_vocab_limit=False,
        minloglevel=2,
        **ids,
    )
    return proto.getvalue()


GEMMA_SPECIALS = dict(
    pad_id=0,
    eos_id=1,
    bos_id=2,
    unk_id=3,
    pad_piece="<pad>",
    eos_piece="<eos>",
    bos_piece="<bos>",
    unk_piece="<unk>",
    user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
)


def gemma3(vision=False):
    """A tiny random Gemma 3 (6 layers: 5 local with a sliding window of 4 tokens, then 1 global with
    RoPE scaled 8x, as Gemma 3 4B+; query-key norms, post-norms), text-only or vision-and-text
    (a 1-layer vision encoder), with a Gemma3Tokenizer (its image tokens too)."""
    import keras_hub
    import keras_hub.models as m

    tokenizer = m.Gemma3Tokenizer(
        proto=sentencepiece(
            **{
                **GEMMA_SPECIALS,
                "user_defined_symbols": [
                    "<start_of_turn>",
                    "<end_of_turn>",
                    "<img>",
                    "<start_of_image>",
                    "<end_of_image>",
                ],
            }
        )
    )
    encoder = vision and m.Gemma3VisionEncoder(
        image_size=28,
        patch_size=14,
        num_heads=2,
        hidden_dim=16,
        num_layers=1,
        intermediate_dim=32,
        pool_size=2,
        output_dim=SIZE["hidden_dim"],
    )
    backbone = m.Gemma3Backbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        image_size=28,
        head_dim=16,
        **{**SIZE, "num_layers": 6},
        use_post_ffw_norm=True,
        use_post_attention_norm=True,
        use_sliding_window_attention=True,
        sliding_window_size=4,
        global_rope_scaling_factor=8.0,
        vision_encoder=encoder or None,
    )
    converter = vision and keras_hub.layers.Gemma3ImageConverter(image_size=(28, 28))
    with mock.patch(
        "keras_hub.src.models.gemma3.gemma3_causal_lm_preprocessor.assert_tf_installed", lambda symbol: None
    ):  # saved as Kaggle's presets have it (it asks for TensorFlow)
        preprocessor = m.Gemma3CausalLMPreprocessor(
            tokenizer, image_converter=converter or None, sequence_length=1024
        )
    return m.Gemma3CausalLM(backbone=backbone, preprocessor=preprocessor)


GEMMA4_SPECIALS = [
    "<|turn>",
    "<turn|>",
    "<|channel>",
    "<channel|>",
    "<|think|>",
    "<|image>",
    "<|image|>",
    "<image|>",
    "<|video|>",
    "<|audio>",
    "<|audio|>",
    "<audio|>",
]


def gemma4(per_layer=8, vision=False):
    """A tiny random Gemma 4 with every size's features at once (6 layers, 2 local with a sliding window of
    4 tokens then 1 global, twice): E2B / E4B's per-layer embeddings (`per_layer` wide; 0: none, as 26B-A4B
    and 31B), key/value sharing (the last 2 layers read layers 3's and 2's) and double-wide MLPs there;
    31B / 26B-A4B's global layers with one key/value head, keys as values and 2x head size, RoPE on a
    quarter of it; 26B-A4B's mixture of experts beside each MLP (4 experts, 2 per token); a Gemma4Tokenizer;
    `vision`: a 1-layer vision encoder, as every Gemma 4 preset has."""
    import keras_hub.models as m

    tokenizer = m.Gemma4Tokenizer(
        proto=sentencepiece(**{**GEMMA_SPECIALS, "user_defined_symbols": GEMMA4_SPECIALS})
    )
    encoder = vision and m.Gemma4VisionEncoder(
        image_size=28,
        patch_size=14,
        num_heads=2,
        hidden_dim=16,
        num_layers=1,
        intermediate_dim=32,
        head_dim=8,
        output_dim=SIZE["hidden_dim"],
    )
    backbone = m.Gemma4Backbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        image_size=28,
        head_dim=16,
        vision_encoder=encoder or None,
        **{**SIZE, "num_layers": 6},
        sliding_window_size=4,
        sliding_window_pattern=3,
        global_head_dim=32,
        global_rope_partial_rotary_factor=0.25,
        num_global_key_value_heads=1,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=per_layer,
        enable_moe_block=True,
        num_experts=4,
        expert_intermediate_dim=32,
        num_experts_per_token=2,
        final_logit_soft_cap=30.0,
    )
    with mock.patch(
        "keras_hub.src.models.gemma4.gemma4_causal_lm_preprocessor.assert_tf_installed", lambda symbol: None
    ):  # saved as Kaggle's presets have it (it asks for TensorFlow)
        preprocessor = m.Gemma4CausalLMPreprocessor(tokenizer, sequence_length=1024)
    return m.Gemma4CausalLM(backbone=backbone, preprocessor=preprocessor)


def causal_lm(family):
    """A tiny random CausalLM of `family` with its tokenizer class."""
    import keras_hub.models as m

    if family == "gemma3":
        return gemma3()
    if family == "gemma4":
        return gemma4()
    if family in ("gemma", "gemma2"):
        tokenizer = m.GemmaTokenizer(proto=sentencepiece(**GEMMA_SPECIALS))
        gemma2 = dict(
            query_head_dim_normalize=False,
            use_post_ffw_norm=True,
            use_post_attention_norm=True,
            final_logit_soft_cap=30.0,
            attention_logit_soft_cap=50.0,
            use_sliding_window_attention=True,
            sliding_window_size=8,
        )
        backbone = m.GemmaBackbone(
            vocabulary_size=tokenizer.vocabulary_size(),
            head_dim=16,
            **SIZE,
            **(gemma2 if family == "gemma2" else {}),
        )
        return m.GemmaCausalLM(backbone, m.GemmaCausalLMPreprocessor(tokenizer))
    if family == "mistral":
        tokenizer = m.MistralTokenizer(proto=sentencepiece(unk_id=0, bos_id=1, eos_id=2, pad_id=-1))
        backbone = m.MistralBackbone(vocabulary_size=tokenizer.vocabulary_size(), sliding_window=8, **SIZE)
        return m.MistralCausalLM(backbone, m.MistralCausalLMPreprocessor(tokenizer))
    if family == "llama3":
        specials = [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ]
        vocab, merges = byte_bpe(specials)
        tokenizer = m.Llama3Tokenizer(vocabulary=vocab, merges=merges)
        backbone = m.Llama3Backbone(vocabulary_size=len(vocab), **SIZE)  # untied output embedding
        return m.Llama3CausalLM(backbone, m.Llama3CausalLMPreprocessor(tokenizer))
    if family == "qwen3.5":  # a gated delta net layer (2 key heads shared by 4 value heads), then attention
        from helpers import short_delta_rule_chunks  # this process's Qwen 3.5 delta rule: chunks of 8, not 64

        short_delta_rule_chunks()
        vocab, merges = byte_bpe(QWEN3_5_SPECIALS)  # (one of each: its chunked delta rule is slow to compile)
        tokenizer = m.Qwen3_5Tokenizer(vocabulary=vocab, merges=merges, unsplittable_tokens=QWEN3_5_SPECIALS)
        backbone = m.Qwen3_5Backbone(
            vocabulary_size=len(vocab),
            head_dim=16,
            **SIZE,
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            tie_word_embeddings=True,
        )  # tied, as 0.8B to 4B
        return m.Qwen3_5CausalLM(backbone, m.Qwen3_5CausalLMPreprocessor(tokenizer))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab, merges = byte_bpe(specials)
    if family == "qwen2.5":
        tokenizer = m.QwenTokenizer(vocabulary=vocab, merges=merges, unsplittable_tokens=specials)
        backbone = m.QwenBackbone(vocabulary_size=len(vocab), **SIZE)  # tied, as Qwen2.5-0.5B
        return m.QwenCausalLM(backbone, m.QwenCausalLMPreprocessor(tokenizer))
    tokenizer = m.Qwen3Tokenizer(vocabulary=vocab, merges=merges, unsplittable_tokens=specials)
    backbone = m.Qwen3Backbone(vocabulary_size=len(vocab), head_dim=16, **SIZE)
    return m.Qwen3CausalLM(backbone, m.Qwen3CausalLMPreprocessor(tokenizer))


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    """{family: local KerasHub preset dir}, plus "gpt2": a family outside common.FAMILIES."""
    import common  # noqa: F401  (first: it keeps TensorFlow out of the process)
    import keras
    import keras_hub.models as m

    root, dirs = tmp_path_factory.mktemp("families"), {}
    for i, family in enumerate(FAMILIES):
        keras.utils.set_random_seed(i)
        dirs[family] = str(root / family)
        causal_lm(family).save_to_preset(dirs[family])
    vocab, merges = byte_bpe(["<|endoftext|>"])
    tokenizer = m.GPT2Tokenizer(vocabulary=vocab, merges=merges)
    backbone = m.GPT2Backbone(
        vocabulary_size=len(vocab),
        num_layers=1,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=64,
    )
    dirs["gpt2"] = str(root / "gpt2")
    m.GPT2CausalLM(backbone, m.GPT2CausalLMPreprocessor(tokenizer)).save_to_preset(dirs["gpt2"])
    return dirs


def one_device_mesh():
    """A ("data", "model") mesh of one device: eager calls on weights spread over 8 simulated devices
    are several times slower, and these tests shard nothing."""
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))


@pytest.fixture(scope="module")
def one_device_models(presets):
    """family -> its preset through common.load_model on one_device_mesh() in float32, loaded once for the
    tests that read it (the cached forward, the layout map's reference, the sampler, the chat template) and
    change nothing in it."""
    import common

    models = {}

    def load(family):
        if family not in models:
            models[family] = common.load_model(presets[family], one_device_mesh(), "float32")
        return models[family]

    return load


def keras_hub_cache(backbone, cache):
    """common.empty_cache's per-layer entries -> the cache the family's call_with_cache takes: Gemma 3's
    per-layer (K, V) pairs as they are, the others' (K, V) [B, S, K, H] stacked to [B, L, 2, S, K, H] (Gemma
    4's [B, 2, S, K, H] each padded to the most heads and the largest head size, a KV-shared layer's all
    zeros); Qwen 3.5's (KV [B, L, 2, S, K, H], conv [B, L, C, k-1], recurrent [B, L, Hv, Dk, Dv]): every
    layer in each, zeros where a layer has no such state (its call_with_cache passes those through)."""
    import jax.numpy as jnp

    if type(backbone).__name__ == "Gemma3Backbone":
        return cache
    if type(backbone).__name__ == "Gemma4Backbone":
        kv = [c for c in cache if c is not None]
        k, h = max(c.shape[3] for c in kv), max(c.shape[4] for c in kv)
        full = [jnp.zeros(kv[0].shape[:3] + (k, h), kv[0].dtype) if c is None else c for c in cache]
        return jnp.stack(
            [jnp.pad(c, [(0, 0)] * 3 + [(0, k - c.shape[3]), (0, h - c.shape[4])]) for c in full], 1
        )
    linear = [c[0].ndim == 3 for c in cache]  # Qwen 3.5's gated delta net states: (conv, recurrent)
    if not any(linear):
        return jnp.stack([jnp.stack(c, 1) for c in cache], 1)
    kv = jnp.stack(next(c for c, lin in zip(cache, linear) if not lin), 1)
    conv, state = next(c for c, lin in zip(cache, linear) if lin)
    return (
        jnp.stack([jnp.zeros_like(kv) if lin else jnp.stack(c, 1) for c, lin in zip(cache, linear)], 1),
        jnp.stack([c[0] if lin else jnp.zeros_like(conv) for c, lin in zip(cache, linear)], 1),
        jnp.stack([c[1] if lin else jnp.zeros_like(state) for c, lin in zip(cache, linear)], 1),
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_forward_matches_keras_hub(one_device_models, family):
    """Prefill + one decode step of common.cached_forward == the family's CausalLM.call_with_cache
    (no padding) and == backbone() + common.logits; the same prompt left-padded gives the same
    logits (the key padding mask); common.logits is h·Wᵀ with the family's output matrix (tied or
    not), soft-capped 30·tanh(z/30) for Gemma 2 and 4."""
    import common
    import jax
    import jax.numpy as jnp
    import plumbing
    import numpy as np

    model = one_device_models(family)
    backbone, tokenizer = model.backbone, model.preprocessor.tokenizer
    ids = np.array([[tokenizer.start_token_id] + list(tokenizer.tokenize("Sort: 3 1 2 9 0 5 7"))], np.int32)
    t, s, pad = ids.shape[1], ids.shape[1] + 1, 5
    cache = common.empty_cache(backbone, 1, s)
    ours, ours_cache = common.cached_forward(backbone, ids, jnp.ones((1, s), bool), cache, 0)
    theirs, _, theirs_cache = model.call_with_cache(ids, keras_hub_cache(backbone, cache), 0)
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    hidden = backbone(common.inputs(backbone, ids, np.ones_like(ids, bool)))  # [1, t, D]
    np.testing.assert_allclose(ours, common.logits(backbone, hidden), atol=1e-4)
    nxt = np.array([[7]], np.int32)
    for a, b in zip(jax.tree.leaves(keras_hub_cache(backbone, ours_cache)), jax.tree.leaves(theirs_cache)):
        np.testing.assert_allclose(a, b, atol=1e-5)  # the same K, V written
    step, _ = common.cached_forward(backbone, nxt, jnp.ones((1, s), bool), ours_cache, t)
    np.testing.assert_allclose(step, model.call_with_cache(nxt, theirs_cache, t)[0], atol=1e-5)
    padded = np.concatenate([np.zeros((1, pad), np.int32), ids], 1)
    mask = np.concatenate([np.zeros((1, pad), bool), np.ones((1, t + 1), bool)], 1)
    left, left_cache = common.cached_forward(
        backbone, padded, mask, common.empty_cache(backbone, 1, s + pad), 0
    )
    np.testing.assert_allclose(left[:, pad:], ours, atol=1e-4)
    left_step, _ = common.cached_forward(backbone, nxt, mask, left_cache, t + pad)  # what the prefill left
    np.testing.assert_allclose(left_step, step, atol=1e-4)
    embedding = backbone.token_embedding
    out = np.asarray(
        embedding.embeddings if embedding.tie_weights else embedding.reverse_embeddings.numpy().T
    )
    raw = 100 * np.asarray(hidden) @ out.T  # [1, t, V]: large enough for the soft-cap to bite
    want = 30.0 * np.tanh(raw / 30.0) if family in ("gemma2", "gemma4") else raw  # c·tanh(z/c), c = 30
    np.testing.assert_allclose(common.logits(backbone, 100 * hidden), want, rtol=1e-4, atol=1e-3)
    assert embedding.tie_weights == (
        family not in ("llama3", "mistral")
    )  # Llama 3, Mistral: own output matrix
    # FLOPs count the output matmul once; an untied input embedding is a lookup, not a matmul, and so is
    # Gemma 4's per-layer one (vocabulary × 6 layers × 8)
    total = sum(int(np.prod(v.shape)) for v in backbone.weights)
    v, d = embedding.embeddings.shape
    lookups = (0 if embedding.tie_weights else v * d) + (v * 6 * 8 if family == "gemma4" else 0)
    assert plumbing.count_params(backbone) == total - lookups


@pytest.mark.parametrize("family", ("gemma3", "gemma4"))
def test_gemma3_and_4_take_gemmas_layout_map(presets, one_device_models, family):
    """keras-hub 0.32 has no layout map for Gemma 3 or 4; their kernels are named as Gemma's, so on a mesh
    with a `model` axis they take its map: on `data=4,model=2` the attention heads and the MLP width split
    over `model` (a single key/value head stays whole), and the forward equals one device's. On `data` alone
    the generic rule stays (each kernel's largest dim over `data`: the MLP width, 128)."""
    import common
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    sharded = common.load_model(presets[family], common.make_mesh("data=4,model=2"), "float32").backbone
    spec = {v.path: v.value.sharding.spec for v in sharded.weights}
    assert spec["decoder_block_0/attention/query/kernel"] == P("model", "data", None)
    assert spec["decoder_block_0/attention/attention_output/kernel"] == P("model", None, "data")
    assert spec["decoder_block_0/ffw_gating/kernel"] == P("data", "model")
    assert spec["decoder_block_0/ffw_linear/kernel"] == P("model", "data")
    vocab = sharded.token_embedding.embeddings.shape[0]  # Gemma 3's 391 does not divide by `model`: whole
    assert spec["token_embedding/embeddings"] == P("model" if vocab % 2 == 0 else None, "data")
    if family == "gemma4":  # global layers: one key/value head, whole on every `model` shard
        assert spec["decoder_block_2/attention/key/kernel"] == P(None, "data", None)
    data_only = common.load_model(presets[family], common.make_mesh("data=8"), "float32").backbone
    assert {v.path: v.value.sharding.spec for v in data_only.weights}[
        "decoder_block_0/ffw_gating/kernel"
    ] == P(None, "data")
    one = one_device_models(family).backbone
    ids = np.arange(2 * 16, dtype=np.int32).reshape(2, 16) % 300 + 1
    mask = np.ones_like(ids, bool)

    def hidden(backbone):
        params, frozen = common.split_variables(backbone)
        return jax.jit(lambda p, f: common.forward(backbone, p, f, ids, mask)[0])(params, frozen)

    np.testing.assert_allclose(hidden(sharded), hidden(one), atol=1e-4)  # float32 sums in another order


@pytest.mark.parametrize("family", ("gemma3", "gemma4", "qwen3.5"))
def test_sampler_ignores_left_padding(one_device_models, family):
    """grpo.generate (greedy, 6 tokens): a short prompt left-padded beside a long one samples the tokens
    it samples unpadded (Gemma 3's and 4's sliding windows, Gemma 4's KV sharing and Qwen 3.5's recurrent
    states included)."""
    import common
    import grpo
    import jax
    import numpy as np

    model = one_device_models(family)
    params, frozen = common.split_variables(model.backbone)
    tok = model.preprocessor.tokenizer
    ids = [[tok.start_token_id] + list(x) for x in tok.tokenize(["Sort: 3 1 2 9 0 5 7 4 8", "Sort: 1"])]
    settings = {"response_length": 6, "temperature": 0.0, "stop_ids": -1, "pad_id": tok.pad_token_id}

    @jax.jit
    def generate(p, f, qs, qm):  # EOS -1: no early end
        return grpo.generate(model.backbone, p, f, qs, qm, key=jax.random.key(0), **settings)[0]

    def sample(rows):  # rows of token ids -> [len(rows), 6] greedy tokens
        q = max(map(len, rows))
        queries, mask = np.zeros((len(rows), q), np.int32), np.zeros((len(rows), q), bool)
        for i, x in enumerate(rows):
            queries[i, q - len(x) :], mask[i, q - len(x) :] = x, True
        return np.asarray(generate(params, frozen, queries, mask))

    np.testing.assert_array_equal(sample(ids)[1], sample([ids[1]] * 2)[0])  # the short one padded, and not


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_give_each_example_its_log_probs_alone(one_device_models, family):
    """sft.py --packing in every family: three examples packed into rows of 16 (blocks.pack: 9 + 6, then 4)
    give each token the log-prob it has alone, right-padded: the block's attention mask (Gemma's
    _compute_attention_mask, the others' _compute_self_attention_mask) is cut at each example's end and the
    rotary positions restart (Gemma 4: its position_ids). Qwen 3.5's linear attention, whose state runs
    along the row, is refused in one line. (The hooks do nothing to an unpacked forward.)"""
    import blocks
    import common
    import numpy as np
    import sft

    model = one_device_models(family)
    params, frozen = common.split_variables(model.backbone)
    rng = np.random.default_rng(0)
    examples = [(rng.integers(3, 200, n).astype(np.int32), np.ones(n, bool)) for n in (9, 4, 6)]
    rows = blocks.pack(examples, 16)
    alone, packed = sft.pad_examples(examples, 9), sft.pad_examples(rows, 16)
    logps = lambda d: np.asarray(  # noqa: E731
        sft.token_logps(model.backbone, params, frozen, d["token_ids"], d["padding_mask"])[0]
    )
    if family == "qwen3.5":
        with pytest.raises(common.UsageError, match="--packing: .* not packed here"):
            logps(packed)
        return
    a, p = logps(alone), logps(packed)
    np.testing.assert_allclose(p[0, :8], a[0, :8], rtol=1e-5, atol=2e-5)  # 9 tokens: row 0 from 0
    np.testing.assert_allclose(p[0, 9:14], a[2, :5], rtol=1e-5, atol=2e-5)  # 6 tokens: row 0 from 9
    np.testing.assert_allclose(p[1, :3], a[1, :3], rtol=1e-5, atol=2e-5)  # 4 tokens: row 1


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_follows_the_family(presets, one_device_models, family):
    """common.chat_template reads the family from the preset's config; --chat-template overrides;
    the template's turn markers are single tokens of the family's tokenizer (where it has them)."""
    import common

    assert common.chat_template(presets[family]) == common.CHAT_TEMPLATES[TEMPLATE[family]]
    assert common.chat_template(presets[family], "mistral") == common.CHAT_TEMPLATES["mistral"]
    with pytest.raises(
        common.UsageError, match="gemma, llama3, mistral, chatml, qwen3.5, gemma4, gemma4_large$"
    ):
        common.chat_template(presets[family], "vicuna")
    tokenizer = one_device_models(family).preprocessor.tokenizer
    markers = {
        "gemma": ["<start_of_turn>", "<end_of_turn>"],
        "llama3": ["<|start_header_id|>", "<|eot_id|>"],
        "chatml": ["<|im_start|>", "<|im_end|>"],
        "mistral": [],
        "qwen3.5": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        "gemma4": ["<|turn>", "<turn|>", "<|channel>", "<channel|>"],
    }[TEMPLATE[family]]
    for marker in markers:  # one piece (SentencePiece may put its word-start piece before it)
        assert list(tokenizer.tokenize(marker))[-1:] == [tokenizer.token_to_id(marker)], marker
    assert tokenizer.start_token_id is not None  # Qwen: <|endoftext|> (common.ensure_start_token)


def test_templates_render_as_the_model_cards():
    """One user turn + answer, rendered as each family's Hugging Face chat_template writes it
    (the BOS, and Mistral's </s>, are token ids the scripts add)."""
    import common

    chat = [{"role": "user", "content": "Sort: 2 1"}, {"role": "assistant", "content": "1 2"}]
    want = {
        "gemma": "<start_of_turn>user\nSort: 2 1<end_of_turn>\n<start_of_turn>model\n1 2<end_of_turn>\n",
        "llama3": "<|start_header_id|>user<|end_header_id|>\n\nSort: 2 1<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n1 2<|eot_id|>",
        "mistral": "[INST] Sort: 2 1 [/INST]1 2",
        "chatml": "<|im_start|>user\nSort: 2 1<|im_end|>\n<|im_start|>assistant\n1 2<|im_end|>\n",
        "qwen3.5": "<|im_start|>user\nSort: 2 1<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "1 2<|im_end|>\n",
        "gemma4": "<|turn>user\nSort: 2 1<turn|>\n<|turn>model\n1 2<turn|>\n",
        "gemma4_large": "<|turn>user\nSort: 2 1<turn|>\n<|turn>model\n<|channel>thought\n<channel|>1 2<turn|>\n",
    }
    assert set(want) == set(common.CHAT_TEMPLATES)
    for name, text in want.items():
        template = common.CHAT_TEMPLATES[name]
        assert common.render(chat, template) == text
        segments = common.sft_segments({"messages": chat}, "f:1", template)
        assert "".join(t for t, _ in segments) == text.rstrip("\n")  # the EOS follows the last answer
        assert [t for t, done in segments if done] == ["1 2" + template[2].rstrip("\n")]
        prompt, chosen, _ = common.preference_triple(
            {"prompt": chat[:1], "chosen": chat[1:], "rejected": chat[1:]}, "f:1", template
        )
        assert prompt + chosen == text.rstrip("\n")
    # Qwen 3.5's generation prompt with enable_thinking=false: the answer's turn, its thinking block empty
    assert (
        common.prompt_text({"prompt": chat[:1]}, "f:1", common.CHAT_TEMPLATES["qwen3.5"])
        == "<|im_start|>user\nSort: 2 1<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # Gemma 4's with thinking off: E2B / E4B open the model's turn; 26B-A4B and 31B add an empty thought channel
    assert (
        common.prompt_text({"prompt": chat[:1]}, "f:1", common.CHAT_TEMPLATES["gemma4"])
        == "<|turn>user\nSort: 2 1<turn|>\n<|turn>model\n"
    )
    assert (
        common.prompt_text({"prompt": chat[:1]}, "f:1", common.CHAT_TEMPLATES["gemma4_large"])
        == "<|turn>user\nSort: 2 1<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )


def test_aliases_name_presets_and_the_readme_lists_them():
    """Every alias is a keras-hub 0.32 CausalLM preset (Gemma 3's: text-only ones), and docs/models.md's
    alias row lists exactly common.MODEL_ALIASES."""
    import re
    import common
    import keras_hub

    presets = keras_hub.models.CausalLM.presets
    assert set(common.MODEL_ALIASES.values()) <= set(presets)
    for alias, preset in common.MODEL_ALIASES.items():
        assert not alias.startswith("gemma3") or "text-only" in presets[preset]["metadata"]["description"], (
            alias
        )
    with open(os.path.join(ROOT, "docs", "models.md"), encoding="utf-8") as f:
        row = next(line for line in f if line.startswith("| alias"))
    assert set(re.findall(r"`([^`]+)`", row)) - {"common.MODEL_ALIASES"} == set(common.MODEL_ALIASES)


def test_a_checkpoint_loads_without_drawing_the_weights_it_replaces(presets, monkeypatch):
    """common.load_model makes a checkpoint's variables as zeros before the file's values replace them
    (interop.loaded_not_drawn): no initializer draws while it loads, with --quantize too; LoRA's adapters,
    made after, and `tiny` (no file: its random weights are the model) are drawn as before; the loaded
    weights are the file's."""
    import common
    import numpy as np
    from keras.src.backend.jax.core import JaxVariable

    made, make = [], JaxVariable._initialize_with_initializer

    def recorded(variable, initializer):
        made.append((variable.path, type(initializer).__name__))
        return make(variable, initializer)

    monkeypatch.setattr(JaxVariable, "_initialize_with_initializer", recorded)
    for quantize in (None, "int8"):
        common.load_model(presets["llama3"], one_device_mesh(), "float32", lora_rank=2, quantize=quantize)
        assert {k for path, k in made if "lora_kernel" not in path} == {"Zeros"}, quantize
        assert {k for path, k in made if "lora_kernel_a" in path} - {"Zeros"}, quantize  # A: drawn (B: zeros)
        made.clear()
    # the file's values: KerasHub's own load (drawn, then read)
    theirs = common.keras_hub.models.CausalLM.from_preset(presets["llama3"], dtype="float32")
    made.clear()
    model = common.load_model(presets["llama3"], one_device_mesh(), "float32")
    for a, b in zip(model.backbone.weights, theirs.backbone.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value), err_msg=a.path)
    common.load_model("tiny", one_device_mesh(), "float32")
    assert {k for _, k in made} - {"Zeros"}  # `tiny`: drawn


def test_multimodal_preset_loads_text_only(tmp_path):
    """A vision-and-text KerasHub preset (Gemma 3 4B and up; every Gemma 4), or its Hugging Face checkpoint,
    loads its decoder alone: no encoder, the same text weights, KerasHub's generic text preprocessor (Gemma
    3's needs TensorFlow: KerasHub's generate, which sft.py's closing samples call, runs), its model/
    text-only; dataset rows carrying images stop with a UsageError."""
    import common
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    vision = gemma3(vision=True)
    vision.save_to_preset(str(tmp_path / "vision"))
    vision.export_to_transformers(str(tmp_path / "hf"))  # Gemma3ForConditionalGeneration, a vision_config
    weights = {w.path: w for w in vision.backbone.weights}
    for model in (
        common.load_model(str(tmp_path / "vision"), one_device_mesh(), "float32"),
        common.text_causal_lm(str(tmp_path / "hf")),
    ):
        assert model.backbone.text_only_model and type(model.preprocessor).__name__ == "CausalLMPreprocessor"
        assert len(weights) > len(model.backbone.weights)  # the encoder's are left out
        for w in model.backbone.weights:
            np.testing.assert_array_equal(w.numpy(), weights[w.path].numpy(), err_msg=w.path)
    model.save_to_preset(str(tmp_path / "text"))
    with open(tmp_path / "text" / "config.json") as f:
        assert json.load(f)["config"]["vision_encoder"] is None
    vision4 = gemma4(vision=True)  # Gemma 4's KerasHub preset: the same, its Gemma4CausalLM as the task
    vision4.save_to_preset(str(tmp_path / "vision4"))
    text4 = common.text_causal_lm(str(tmp_path / "vision4"))
    assert text4.backbone.text_only_model and type(text4).__name__ == "Gemma4CausalLM"
    weights = {w.path: w for w in vision4.backbone.weights}
    assert len(weights) > len(text4.backbone.weights)
    for w in text4.backbone.weights:
        np.testing.assert_array_equal(w.numpy(), weights[w.path].numpy(), err_msg=w.path)
    assert model.generate(["Sort: 1"], max_length=6)[0].startswith("Sort: 1")  # sft.py's closing samples
    rows = tmp_path / "images.jsonl"
    rows.write_text(json.dumps({"prompt": "Describe", "completion": "A fox", "images": ["fox.png"]}) + "\n")
    with pytest.raises(common.UsageError, match="images.jsonl:1: field 'images': .* text only"):
        common.read_dataset(str(rows), "sft", None)


def test_system_and_multi_turn_chats_render_as_the_model_cards():
    """A system turn and two exchanges, written out as each family's Hugging Face chat_template renders them
    (sources cited in common.CHAT_TEMPLATES): Gemma 1-3 and Mistral have no system role, so its text opens
    the first user turn; Llama 3, ChatML and Gemma 4 have a system turn; Gemma and Llama 3 strip contents
    (`| trim`). sft trains on both answers; a chat prompt renders up to the opened model turn."""
    import common

    chat = [
        {"role": role, "content": text}
        for role, text in [
            ("system", "Answer briefly."),
            ("user", "Sort: 2 1"),
            ("assistant", "1 2"),
            ("user", "Sort: 3 1\n"),
            ("assistant", "1 3"),
        ]
    ]
    want = {
        "gemma": "<start_of_turn>user\nAnswer briefly.\n\nSort: 2 1<end_of_turn>\n"
        "<start_of_turn>model\n1 2<end_of_turn>\n"
        "<start_of_turn>user\nSort: 3 1<end_of_turn>\n"
        "<start_of_turn>model\n1 3<end_of_turn>\n",
        "llama3": "<|start_header_id|>system<|end_header_id|>\n\nAnswer briefly.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nSort: 2 1<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n1 2<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nSort: 3 1<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n1 3<|eot_id|>",
        "mistral": "[INST] Answer briefly.\n\nSort: 2 1 [/INST]1 2[INST] Sort: 3 1\n [/INST]1 3",
        "chatml": "<|im_start|>system\nAnswer briefly.<|im_end|>\n"
        "<|im_start|>user\nSort: 2 1<|im_end|>\n"
        "<|im_start|>assistant\n1 2<|im_end|>\n"
        "<|im_start|>user\nSort: 3 1\n<|im_end|>\n"
        "<|im_start|>assistant\n1 3<|im_end|>\n",
        # Qwen 3.5's own template leaves the empty thinking block out of answers before the last user
        # turn ("1 2" here); this one writes it on every answer
        "qwen3.5": "<|im_start|>system\nAnswer briefly.<|im_end|>\n"
        "<|im_start|>user\nSort: 2 1<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n1 2<|im_end|>\n"
        "<|im_start|>user\nSort: 3 1\n<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n1 3<|im_end|>\n",
        "gemma4": "<|turn>system\nAnswer briefly.<turn|>\n<|turn>user\nSort: 2 1<turn|>\n"
        "<|turn>model\n1 2<turn|>\n<|turn>user\nSort: 3 1<turn|>\n<|turn>model\n1 3<turn|>\n",
        "gemma4_large": "<|turn>system\nAnswer briefly.<turn|>\n<|turn>user\nSort: 2 1<turn|>\n"
        "<|turn>model\n<|channel>thought\n<channel|>1 2<turn|>\n<|turn>user\nSort: 3 1<turn|>\n"
        "<|turn>model\n<|channel>thought\n<channel|>1 3<turn|>\n",
    }
    assert set(want) == set(common.CHAT_TEMPLATES)
    for name, text in want.items():
        template = common.CHAT_TEMPLATES[name]
        assert common.render(chat, template) == text, name
        segments = common.sft_segments({"messages": chat}, "f:1", template)
        assert "".join(t for t, _ in segments) == text.rstrip("\n")  # the EOS follows the last answer
        end = template.end.rstrip("\n")
        assert [t for t, done in segments if done] == ["1 2" + end, "1 3" + end], name
        assert common.prompt_text({"prompt": chat[:2]}, "f:1", template) == text[: text.index("1 2")], name


# Gemma 2 and Qwen 3 are not exported: keras-hub 0.32 has no exporter for them (interop.check_export_hf).
EXPORTED = ("gemma", "gemma3", "gemma4", "llama3", "mistral", "qwen2.5", "qwen3.5")


def export_hf(preset, path):
    """--export-hf of a saved preset, as plumbing.Run's final save calls it (the family's chat template)."""
    import common
    import interop

    interop.export_hf(common.host_model(preset), path, common.family_template(preset))


@pytest.mark.parametrize("family", EXPORTED)
def test_export_hf_tokenizer_and_chat_template(presets, family, tmp_path):
    """interop.export_hf's model_hf/ per family: tokenizer.json gives the family tokenizer's ids (helpers.
    check_exported_tokenizer; Qwen's start token is the scripts' <|endoftext|>), the family's chat template,
    ordinary file modes; keras-hub's own Hugging Face loader reads back the backbone's outputs."""
    import common
    import keras_hub
    import numpy as np
    from helpers import check_exported_tokenizer

    export_hf(presets[family], str(tmp_path / "hf"))
    tokenizer = keras_hub.models.Tokenizer.from_preset(presets[family])
    common.ensure_start_token(tokenizer, presets[family])
    check_exported_tokenizer(str(tmp_path / "hf"), tokenizer, TEMPLATE[family])
    with open(tmp_path / "hf" / "config.json") as f:  # keras-hub writes Gemma 4's headless Gemma4TextModel
        assert family != "gemma4" or json.load(f)["architectures"] == ["Gemma4ForCausalLM"]
    # keras-hub 0.32: its Gemma exporter writes the first key/value head only (Gemma 2B's one; not this model's
    # 2, nor 7B's 16), its Qwen 2 loader needs `use_sliding_window`, which its exporter leaves out
    if family in ("gemma", "qwen2.5"):
        return
    ids = np.array([[tokenizer.start_token_id] + list(tokenizer.tokenize("Sort: 3 1 2"))], np.int32)
    saved, exported = (
        keras_hub.models.Backbone.from_preset(p) for p in (presets[family], str(tmp_path / "hf"))
    )
    atol = 5e-3 if family == "mistral" else 1e-5  # keras-hub 0.32 reads a Mistral checkpoint through float16
    inputs = common.inputs(saved, ids, np.ones_like(ids, bool))
    np.testing.assert_allclose(exported(inputs), saved(inputs), atol=atol)


def test_gemma4_template_follows_the_size(tmp_path):
    """Gemma 4 without per-layer embeddings (26B-A4B, 31B) takes gemma4_large, whose answers open with an
    empty thought channel, read from its KerasHub preset and from its Hugging Face checkpoint (--export-hf,
    whose chat template is that one)."""
    import common
    import keras
    from helpers import check_exported_tokenizer

    keras.utils.set_random_seed(0)
    model = gemma4(per_layer=0)
    model.save_to_preset(str(tmp_path / "large"))
    assert common.chat_template(str(tmp_path / "large")) == common.CHAT_TEMPLATES["gemma4_large"]
    export_hf(str(tmp_path / "large"), str(tmp_path / "hf"))
    check_exported_tokenizer(str(tmp_path / "hf"), model.preprocessor.tokenizer, "gemma4_large")
    assert common.chat_template(str(tmp_path / "hf")) == common.CHAT_TEMPLATES["gemma4_large"]


@pytest.mark.parametrize(
    "spec",
    [
        # Gemma's own: no charsmap, no dummy prefix, whitespace kept (`tiny` has SentencePiece's defaults)
        dict(
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_by_whitespace=False,
        ),
        # Mistral's (and Llama 2's): no charsmap, a dummy prefix, whitespace kept
        dict(normalization_rule_name="identity", remove_extra_whitespaces=False),
    ],
)
def test_sentencepiece_tokenizer_json_follows_the_models_spec(spec):
    """interop.hf_tokenizer on SentencePiece models with the real models' normalizer specs: KerasHub's ids."""
    import common
    import keras_hub
    from helpers import TOKENIZER_TEXTS

    tokenizer = keras_hub.models.GemmaTokenizer(
        proto=sentencepiece(
            pad_id=0,
            eos_id=1,
            bos_id=2,
            unk_id=3,
            pad_piece="<pad>",
            eos_piece="<eos>",
            bos_piece="<bos>",
            unk_piece="<unk>",
            user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
            **spec,
        )
    )
    import interop

    converted = interop.hf_tokenizer(tokenizer)
    for text in TOKENIZER_TEXTS:
        ids = [int(i) for i in tokenizer.tokenize(text)]
        assert converted.encode(text).ids == ids, text
        text_back = tokenizer.detokenize(ids) if ids else ""
        assert converted.decode(ids, skip_special_tokens=False) == text_back, text


def test_unknown_family_needs_chat_template(presets, tmp_path):
    """A family outside common.FAMILIES (GPT-2): plain-text rows read; a chat stops with exit 2 naming
    --chat-template; an unknown --chat-template name exits 2 listing the names; no sampler."""
    import common
    from helpers import run_script

    assert common.chat_template(presets["gpt2"]) is None
    plain = os.path.join(ROOT, "data", "sft_train.jsonl")
    assert common.read_dataset(plain, "sft", None)[0] == [
        ("Sort: 0 9 1 6 6 2", False),
        (" 0 1 2 6 6 9", True),
    ]
    with pytest.raises(common.UsageError, match="sampler supports .* not GPT2Backbone"):
        common.check_sampler(presets["gpt2"])
    chats = os.path.join(ROOT, "data", "sft_messages_train.jsonl")
    res = run_script(
        "sft.py",
        "--model",
        presets["gpt2"],
        "--dataset",
        chats,
        "--eval-dataset",
        "",
        "--output-dir",
        str(tmp_path / "a"),
    )
    assert res.returncode == 2 and f"--chat-template ({', '.join(common.CHAT_TEMPLATES)})" in res.stderr, (
        res.stderr
    )
    assert len(res.stderr.strip().splitlines()) == 1
    rows = common.read_dataset(chats, "sft", common.chat_template(presets["gpt2"], "chatml"))  # with the flag
    assert rows[0][0] == ("<|im_start|>user\nSort: 0 9 1 6 6 2<|im_end|>\n", False)
    res = run_script("sft.py", "--chat-template", "vicuna", "--output-dir", str(tmp_path / "b"))
    assert res.returncode == 2 and "gemma" in res.stderr and "chatml" in res.stderr, res.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_chat_template_flag_offers_every_template():
    """--chat-template's choices, in every script's flags (the shared ones, evaluate's and compare's), are
    exactly common.CHAT_TEMPLATES: a template added there can be asked for by name (gemma4 and qwen3.5
    could not be when added)."""
    import dataclasses
    import typing
    import common
    import compare
    import evaluate
    import plumbing

    for args in (plumbing.SharedArgs, evaluate.Args, compare.Args):
        kind = {f.name: f.type for f in dataclasses.fields(args)}["chat_template"]
        literal = next(t for t in typing.get_args(kind) if typing.get_origin(t) is typing.Literal)
        assert sorted(typing.get_args(literal)) == sorted(common.CHAT_TEMPLATES), args


def run_scripts(preset, out):
    """One step of sft (on chats), dpo and grpo (sampler included, chat prompts) from `preset`, then
    evaluate.py on grpo's model/, each through its main(), in this process; outputs under `out`."""
    import dpo
    import evaluate
    import grpo
    import sft
    from helpers import short_delta_rule_chunks

    short_delta_rule_chunks()  # as in the test process (causal_lm): Qwen 3.5 compiles in under half the time
    prompts = os.path.join(out, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(
            json.dumps({"prompt": [{"role": "user", "content": f"Sort: {i} 2 7"}]}) + "\n" for i in range(4)
        )
    run = dict(model=preset, max_steps=1, batch_size=4, seed=0, remat="off")
    sft.main(
        sft.Args(
            **run,
            max_length=32,
            dataset=os.path.join(ROOT, "data", "sft_messages_train.jsonl"),
            eval_dataset=None,
            output_dir=os.path.join(out, "sft"),
        )
    )
    dpo.main(dpo.Args(**run, max_length=32, eval_dataset=None, output_dir=os.path.join(out, "dpo")))
    grpo.main(
        grpo.Args(
            **run,
            dataset=prompts,
            num_generations=2,
            response_length=4,
            max_prompt_length=32,
            output_dir=os.path.join(out, "grpo"),
        )
    )
    evaluate.main(
        evaluate.Args(
            model=os.path.join(out, "grpo", "model"),
            prompts=prompts,
            num_prompts=4,
            max_new_tokens=4,
            batch_size=4,
            output_dir=os.path.join(out, "eval"),
        )
    )


# The families whose script runs take paths the rest of the suite does not: the Llama-style decoder
# call and untied output matrices (Mistral), its template with no end-of-turn marker, byte-level BPE and
# Qwen's stand-in BOS (Qwen 3.5), Gemma 3's per-layer (K, V) cache and its preprocessor, Gemma 4's
# per-layer inputs, KV-shared layers, mixture of experts and template, Qwen 3.5's recurrent layers and its
# template. Gemma is `tiny` (every other test); Gemma 2 and Qwen 3 differ from Gemma and Qwen 2.5 only
# inside KerasHub's layers and the tokenizer's specials, checked above; Qwen 3.5's run covers Qwen 2.5's
# byte-level BPE, stand-in BOS and ChatML turns, and Mistral's and Qwen 3.5's together Llama 3's paths
# (its template and word splits are checked above). All passed run_scripts when each was added; each
# family costs ~25-40 s of CPU here, Gemma 4 up to ~50 s, Qwen 3.5 ~27 s (its delta rule in 8-token chunks).
SCRIPT_FAMILIES = ("gemma3", "gemma4", "mistral", "qwen3.5")


def test_one_step_of_each_script(presets, tmp_path):
    """run_scripts for SCRIPT_FAMILIES, in one process on one device (8 simulated devices on 2 cores
    compile 2.5x slower) with XLA's CPU code generation unoptimised (compiling is most of the time
    here: half of it so) and JAX's persistent compilation cache, as a script's own start-up (plumbing.launch)
    and the test processes have it (with these programs in the cache: 136 -> 55 s): finite losses, a
    model/ of the same family, eval.json with a score."""
    import common
    from helpers import one_device_env

    env = one_device_env()
    env["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    outs = {family: tmp_path / family for family in SCRIPT_FAMILIES}
    calls = "; ".join(f"run_scripts({presets[f]!r}, {str(o)!r})" for f, o in outs.items())
    for o in outs.values():
        o.mkdir()
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {ROOT!r}); import plumbing; plumbing.compilation_cache(); "
            f"from test_families import run_scripts; {calls}",
        ],
        cwd=os.path.dirname(os.path.abspath(__file__)),
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for family, out in outs.items():
        for name in ("sft", "dpo", "grpo"):
            rows = metrics(out / name)
            assert rows[-1]["step"] == 1 and math.isfinite(rows[-1]["train/loss"]), (family, name)
            assert common.backbone_class(str(out / name / "model")) is common.backbone_class(presets[family])
        with open(out / "eval" / "eval.json") as f:
            result = json.load(f)
        assert result["num_prompts"] == 4 and math.isfinite(result["score"]), family


def test_compare_passes_chat_template_to_every_stage(tmp_path):
    """compare.py forwards --chat-template to each script it runs (and to its evaluation)."""
    import compare

    stages = compare.plan(compare.Args(chat_template="chatml"), str(tmp_path))[0]
    assert stages and all(s["flags"][s["flags"].index("--chat-template") + 1] == "chatml" for s in stages)
    assert all("--chat-template" not in s["flags"] for s in compare.plan(compare.Args(), str(tmp_path))[0])


def test_byte_level_bpe_splits_words_as_each_familys_tokenizer():
    """keras-hub 0.32's byte-level BPE without TensorFlow matched its split regex as literal text, so nothing
    was split and BPE merged across words and numbers ("a b" one token, "1234" one token): ids the model never
    saw. common splits as each family's tokenizer.json: Llama 3 digits in threes, Qwen one at a time, GPT-2
    whole numbers; words never merge with the next."""
    import common  # noqa: F401  (its fix is installed when it is imported)
    import keras_hub.models as m
    from tokenizers import pre_tokenizers

    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    pieces = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["12", "123", "1234", "aĠ", "aĠb"] + specials
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = ["1 2", "12 3", "123 4", "a Ġ", "aĠ b"]  # "1234" and "a b" are one token each if nothing splits
    expected = {
        m.Llama3Tokenizer: ["123", "4", "Ġ", "a", "Ġ", "b"],
        m.QwenTokenizer: ["1", "2", "3", "4", "Ġ", "a", "Ġ", "b"],
        m.Qwen3Tokenizer: ["1", "2", "3", "4", "Ġ", "a", "Ġ", "b"],
        m.GPT2Tokenizer: ["1234", "Ġ", "a", "Ġ", "b"],
    }
    for cls, tokens in expected.items():
        tokenizer = cls(vocabulary=vocab, merges=merges)
        assert [pieces[int(i)] for i in tokenizer.tokenize("1234 a b")] == tokens, cls.__name__
