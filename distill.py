r"""On-policy distillation: the student samples, a frozen teacher of the same vocabulary grades every token.

Agarwal et al. 2024 (GKD, arXiv:2306.13649); TRL's DistillationTrainer: generalized JSD chosen by β
(0: forward KL, 1: reverse KL, the default). Data: `prompt` (string or chat messages).
    python distill.py --model qwen3.5_0.8b --teacher-model qwen3.5_9b --dataset my_prompts.jsonl
Offline toy (docs/distill.md: a teacher SFT'd for 150 steps, a student for 40; ~2 min on 2 CPU cores):
    python distill.py --model runs/student/model --teacher-model runs/teacher/model --max-steps 30 \
        --batch-size 32 --learning-rate 1e-4 --response-length 16 --max-prompt-length 64
"""

import math
import os
import time
from dataclasses import dataclass

import plumbing  # the run shell: shared flags, Run, the exit boundary (instant to import)
plumbing.answer_help(__name__, __file__)  # `python distill.py --help`: from Args' source, before the imports below

import common  # noqa: E402  (mesh, models, data files)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


@dataclass
class Args(plumbing.RolloutArgs):
    """The shared flags (plumbing.RolloutArgs: model, dtype, mesh, prompts, lengths, outputs, …) plus distillation's."""
    # model
    teacher_model: str | None = None
    """the frozen teacher: any --model form; its tokenizer's vocabulary must be the student's (any width or depth)
    (TRL's teacher_model_name_or_path)"""
    # rollouts
    response_length: int = 512
    """new tokens the student samples per completion (TRL DistillationConfig's max_completion_length: 512)"""
    top_p: float = 1.0
    """top-p: sample from the likeliest tokens that hold this probability mass (1.0 = off)"""
    top_k: int = 0
    """top-k: sample among the k likeliest tokens (0 = off); the loss stays over the whole vocabulary, as TRL's"""
    min_p: float | None = None
    """min-p: drop tokens less likely than min_p × the top token's probability (None = off)"""
    # algorithm
    beta: float = 1.0
    """β of the generalized JSD: 0 forward KL(teacher ‖ student), 1 reverse KL(student ‖ teacher) (TRL: 1.0),
    in between β·KL(p_T ‖ m) + (1 − β)·KL(p_S ‖ m), m = (1 − β)·p_S + β·p_T"""
    temperature: float = 1.0
    """τ: sampling temperature, and both models' logits are divided by it in the loss (TRL: 1.0)"""
    logits_chunk: int = 64
    """completion positions projected to [B, chunk, V] logits at a time (memory: 2 such blocks per model)"""
    # logging and outputs
    export_hf: bool = False
    """also write the final model as a Hugging Face checkpoint, tokenizer and chat template in <output-dir>/model_hf/"""


# ---------------------------------------------------------------------------
# ALGO LOGIC (the loss first: it is what this file is about): the generalized JSD on one chunk of logits,
# then the chunked projection of both models' hidden states that feeds it
# ---------------------------------------------------------------------------
def generalized_jsd(student_logits, teacher_logits, mask, beta, temperature):
    """Per-token divergence between the teacher's and the student's next-token distributions (docs/distill.md):
    logits [..., V] (float32, each model's soft-cap already applied), mask [...] -> [...], 0 where mask is False.

      β = 0 (eq. 1):  KL(p_T ‖ p_S) = Σ_v p_T (log p_T − log p_S)      forward: mass-covering
      β = 1 (eq. 2):  KL(p_S ‖ p_T) = Σ_v p_S (log p_S − log p_T)      reverse: mode-seeking
      else  (eq. 3):  β·KL(p_T ‖ m) + (1 − β)·KL(p_S ‖ m),  m = (1 − β)·p_S + β·p_T
    p = softmax(logits / τ) for both. As TRL's, β = 0 and 1 are their own cases: eq. 3 tends to 0 at either end.
    """
    s = jax.nn.log_softmax(student_logits / temperature, -1)  # log p_S [..., V]
    t = jax.nn.log_softmax(teacher_logits / temperature, -1)  # log p_T [..., V]
    if beta == 0:
        per_token = jnp.sum(jnp.exp(t) * (t - s), -1)
    elif beta == 1:
        per_token = jnp.sum(jnp.exp(s) * (s - t), -1)
    else:  # log m = log((1 − β)·p_S + β·p_T), stably in log space
        m = jnp.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        per_token = beta * jnp.sum(jnp.exp(t) * (t - m), -1) + (1 - beta) * jnp.sum(jnp.exp(s) * (s - m), -1)
    return jnp.where(mask, per_token, 0.0)


def distill_loss(divergence, mask):
    """Σ over completion tokens of the per-token divergence [B, R] ÷ the batch's completion tokens (eq. 4, as
    TRL's: every token of the batch weighs the same, a long completion counts more) -> (loss, metrics)."""
    loss = jnp.sum(jnp.where(mask, divergence, 0.0)) / jnp.maximum(mask.sum(), 1)
    return loss, {"train/loss": loss}
