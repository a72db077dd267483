"""LoRA below the scripts (common.load_model calls it; an algorithm file never imports it).

Contents:
- `enable_lora`: PEFT's LoraConfig on a KerasHub backbone: the layers --lora-target-modules names, A and B
- `quantize_base`: --quantize, QLoRA's frozen base: the layers under the adapters in int8 or int4
- `save_adapter`, `read_adapter`: the adapters in PEFT's files, out beside the merged model (common.save_model)
  and in (--lora-adapter)
"""

import json
import os
import re

import jax
import keras
import numpy as np

from interop import UsageError


def enable_lora(backbone, rank, alpha=None, target_modules=None, adapter=None):
    """LoRA as PEFT's LoraConfig: W + (alpha / rank)·A·B (alpha None: rank) on the Dense / EinsumDense layers
    named in `target_modules` (maybe comma-separated; None: KerasHub's default, query and value, PEFT's for
    these families; `all-linear`: attention q/k/v/o and the MLP, as PEFT's: all but the output head, here the
    embedding). Only A and B train: biases stay frozen (PEFT's bias="none"). adapter (--lora-adapter): a
    folder of PEFT's files instead, whose modules and update LoRA starts from (read_adapter)."""
    linear = [
        layer
        for layer in backbone._flatten_layers(include_self=False)  # as KerasHub's enable_lora
        if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense))
    ]
    names = {n for m in target_modules or backbone.default_lora_layer_names() for n in m.split(",") if n}
    peft = adapter and read_adapter(adapter, linear)  # {layer: (rank, alpha, A, B)} in Keras's form
    named = linear if "all-linear" in names else [layer for layer in linear if layer.name in names]
    chosen = list(peft) if adapter else named
    # none, or a name it lacks (KerasHub's defaults are its own)
    if not chosen or target_modules and names - {"all-linear"} - {layer.name for layer in linear}:
        raise UsageError(
            f"--lora-target-modules {' '.join(target_modules or [])}: not this model's; "
            f"all-linear or its layers {', '.join(sorted({layer.name for layer in linear}))}"
        )
    backbone.trainable = True
    for layer in backbone._flatten_layers(include_self=False):
        layer.trainable = False
    for layer in chosen:
        layer.trainable = True
        layer.enable_lora(*(peft[layer][:2] if adapter else (rank, alpha)))  # freezes the kernel
        if adapter:
            layer.lora_kernel_a.assign(peft[layer][2])
            layer.lora_kernel_b.assign(peft[layer][3])  # else A [..., r]: he_uniform, B [r, out]: 0
        if layer.bias is not None:
            layer.bias.trainable = False


def quantize_base(backbone, mode, distribution):
    """--quantize, QLoRA's frozen base (bitsandbytes' load_in_8bit / load_in_4bit): Keras's weight-only
    quantization of every Dense / EinsumDense layer (the attention and MLP projections; the embedding and the
    output head stay, as bitsandbytes keeps lm_head), int8 per output channel or int4 in blocks of 64 input
    rows (QLoRA's block), computed in the compute dtype with float32 scales; LoRA goes on top (enable_lora).
    The backbone, made on the host (its float weights need not fit the devices), is then laid out by the Keras
    `distribution`: its quantized kernels and scales as the weights they replace."""
    layers = backbone._flatten_layers(include_self=False)
    linear = [layer for layer in layers if type(layer) in (keras.layers.Dense, keras.layers.EinsumDense)]
    other = [  # weights of another layer type (a mixture of experts' stacked experts): Keras cannot quantize
        layer
        for layer in layers
        if layer not in linear and not isinstance(layer, keras.layers.Embedding)
        if any(len(w.shape) > 1 for w in layer._trainable_variables + layer._non_trainable_variables)
    ]
    if other:
        raise UsageError(
            f"--quantize {mode}: {type(backbone).__name__}'s {type(other[0]).__name__} layers hold weights "
            "Keras cannot quantize (only Dense and EinsumDense); train this model without --quantize"
        )
    config = (  # weights only: the activations stay in the compute dtype, as QLoRA's
        keras.quantizers.Int8QuantizationConfig(activation_quantizer=None)
        if mode == "int8"
        else keras.quantizers.Int4QuantizationConfig(block_size=64)
    )
    for layer in linear:
        if layer.variable_dtype != "float32":  # the scales are made in it: float32 ones
            layer.dtype_policy = f"mixed_{layer.compute_dtype}"
        layer.quantize(mode, config=config)
    for v in backbone.weights:  # keras 3.15 internals, as common.split_variables'
        x = np.asarray(v.value)  # each process holds it whole: it fills its own shards
        v._value = jax.make_array_from_callback(
            x.shape, distribution.get_variable_layout(v).backend_layout, x.__getitem__
        )


# KerasHub's layer names -> the Hugging Face modules PEFT adapts (target_modules) in each decoder layer
HF_MODULES = {
    "query": "self_attn.q_proj",
    "key": "self_attn.k_proj",
    "value": "self_attn.v_proj",
    "attention_output": "self_attn.o_proj",
    "ffw_gating": "mlp.gate_proj",  # Gemma's MLP
    "ffw_gating_2": "mlp.up_proj",
    "ffw_linear": "mlp.down_proj",
    "feedforward_gate_dense": "mlp.gate_proj",  # Llama 3's, Mistral's, Qwen's
    "feedforward_intermediate_dense": "mlp.up_proj",
    "feedforward_output_dense": "mlp.down_proj",
}


def axes(layer):
    """A Dense / EinsumDense layer's kernel axes but its last (its LoRA A's): those the input contracts, and
    the output's others (the heads of a [heads, D, head_dim] query kernel), each in the kernel's order."""
    kernel, inputs = (
        layer.equation.split("->")[0].split(",")[::-1] if hasattr(layer, "equation") else ("io", "i")
    )
    contracted = [i for i, c in enumerate(kernel[:-1]) if c in inputs]
    return contracted, [i for i in range(len(kernel) - 1) if i not in contracted]


def peft_module(layer):
    """The layer's module name in PEFT's files, e.g. base_model.model.model.layers.3.self_attn.q_proj."""
    return f"base_model.model.model.layers.{re.search('[0-9]+', layer.path)[0]}.{HF_MODULES[layer.name]}"


def save_adapter(backbone, path):
    """The adapters into `path` as PEFT saves a LoraConfig's, for PeftModel.from_pretrained on the Hugging Face
    base: adapter_model.safetensors (lora_A [R, in], lora_B [out, R] under Hugging Face's module names, float32)
    and adapter_config.json; PEFT's update (lora_alpha / R)·B·A is the one trained, exactly. Keras's A on a
    query/key/value kernel ([heads, D, head_dim] or [D, heads, head_dim]) is one per head, with one B
    [r, head_dim] for all heads: PEFT's form of that update has rank R = heads × r (A: the heads' stacked,
    B: block-diagonal), in rank_pattern and alpha_pattern. A layer without a name here: nothing written."""
    from safetensors.numpy import save_file

    layers = [
        layer for layer in backbone._flatten_layers(include_self=False) if getattr(layer, "lora_enabled", 0)
    ]
    if not layers or any(layer.name not in HF_MODULES for layer in layers):
        return
    tensors, ranks = {}, {}
    for layer in layers:
        a = np.asarray(layer.lora_kernel_a.value, np.float32)  # the kernel's axes but its last, then r
        b = np.asarray(layer.lora_kernel_b.value, np.float32)  # [r, the kernel's last axis]
        contracted, heads = axes(layer)
        g = int(np.prod([a.shape[i] for i in heads]))
        module = peft_module(layer)
        a = np.transpose(a, [*heads, a.ndim - 1, *contracted]).reshape(g * layer.lora_rank, -1)
        b = np.kron(np.eye(g, dtype=np.float32), b.T)  # block-diagonal
        # [(head, r), in] and [(head, out), (head, r)], in C order: safetensors writes a buffer as it lies
        tensors[module + ".lora_A.weight"] = np.ascontiguousarray(a)
        tensors[module + ".lora_B.weight"] = np.ascontiguousarray(b)
        ranks[HF_MODULES[layer.name].split(".")[1]] = (g * layer.lora_rank, g * layer.lora_alpha)
    rank, alpha = layers[0].lora_rank, layers[0].lora_alpha
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(ranks),
        "rank_pattern": {m: r for m, (r, _) in ranks.items() if r != rank},
        "alpha_pattern": {m: a for m, (r, a) in ranks.items() if r != rank},
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "base_model_name_or_path": None,
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def read_adapter(path, linear):
    """--lora-adapter: the LoRA adapter PEFT (or TRL) wrote for this model's Hugging Face form ->
    {layer of `linear`: (rank, alpha, A, B)} in Keras's form, the update exactly PEFT's (lora_alpha / r)·B·A:
    save_adapter's inverse, PEFT's rank r being Keras's heads × r on a query/key/value kernel (A: each head's
    block on the diagonal; B: the heads' rows stacked). Not plain LoRA, or a module this model lacks: one line."""
    from safetensors.numpy import load_file

    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise UsageError(
            f"--lora-adapter {path}: no adapter_config.json there (a folder PEFT's save_pretrained wrote)"
        )
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise UsageError(
            f"--lora-adapter {path}: not a plain LoRA adapter (PEFT's LORA, without DoRA or rsLoRA)"
        )
    found = {}
    for layer in linear:
        key = layer.name in HF_MODULES and peft_module(layer)
        if not key or key + ".lora_A.weight" not in tensors:
            continue
        a, b = tensors[key + ".lora_A.weight"], tensors[key + ".lora_B.weight"]  # [r, in], [out, r]
        short, r = key.rsplit(".", 1)[1], a.shape[0]
        alpha = config["alpha_pattern"].get(short, config["lora_alpha"])
        scale = alpha / config["rank_pattern"].get(short, config["r"])
        contracted, heads = axes(layer)
        shape = layer.kernel.shape
        g = int(np.prod([shape[i] for i in heads]))
        a = np.einsum(
            "...j,gh->...ghj", a.T.reshape(*[shape[i] for i in contracted], r), np.eye(g, dtype=a.dtype)
        )
        a = a.reshape(*[shape[i] for i in contracted + heads], g * r)  # [in..., heads..., (head, r)]
        a = np.transpose(a, [*np.argsort(contracted + heads), len(shape) - 1])  # the kernel's order
        found[layer] = (g * r, scale * g * r, a, b.reshape(g, -1, r).transpose(0, 2, 1).reshape(g * r, -1))
    if 2 * len(found) != len(tensors):
        raise UsageError(
            f"--lora-adapter {path}: {len(tensors) // 2 - len(found)} of its modules are not this model's"
        )
    return found
