"""Where a live teacher's logit distillation runs on a TPU under train.loss_impl='auto': on the
vocabulary-chunk engine (framework/vocab_chunks.py) at large chunks, not over vocabulary slices.

Why. The slices recompute both models' logits in the backward pass (framework/vocab_slices.py),
the teacher's too: a (tokens, V) matmul at the teacher's width. The chunk engine forms the
gradient in the forward pass while a chunk's logits are at hand, each model's logits made once,
but it reads and writes the output layer's fp32 weight gradient once per chunk. At its default
budget (vocab_chunks.CHUNK_BUDGET_BYTES: ~220 positions of V 151,936 at 4 rows) that traffic
made it the slower engine; at chunks of about a thousand tokens it is eight passes a step. On a
TPU v5e the train step of KD from a Qwen3-1.7B-shaped teacher into the 0.6B-shaped student at
4 x 2048 took 607.3 ms with 1,024-token chunks against 616.1 over slices, 624.9 with 512-token
chunks and 702.0 at the default budget; with the teacher's matmuls in int8 540.8 against 563.3;
from a 16-expert MoE teacher 519.4 against 527.6 (benchmarks/results/tpu/levers_call54_moe.jsonl,
levers_call55_real.jsonl, levers_call55_kd_chunks.jsonl). Next-token CE alone has no teacher
logits to save and stays on the slices: the chunk engine at 2,048-token chunks was slower there
(544.6 against 527.8 ms for the 0.6B student's train step, levers_call54_real.jsonl).

Writing each chunk's gradient of the student's logits in bfloat16 (the MXU reads it so at the
default precision) was slower on the chip: 610.3 against 607.3 ms, the MoE teacher's 519.3
against 517.3 (levers_call60_real.jsonl, levers_call60_moe.jsonl).

So the rule covers what was measured: a train objective (an eval's metrics stay on the slices)
of LogitKDs over the whole vocabulary from one teacher model run in the step, compiled for a
TPU. A top-k, a cache, several teachers and an explicit train.loss_impl='sliced' keep the slices.
"""

from __future__ import annotations

import dataclasses

from distillax.distill.logit_kd import LogitKD
from distillax.distill.teacher_head import TeacherHead
from distillax.framework import vocab_chunks
from distillax.models.attention import impl

# fp32 logits of one model per chunk on one device: 1,024 tokens of a 151,936-column vocabulary
# at 4 rows a device (n = 8 chunks of 256 positions at length 2048), what the chip measured.
TPU_CHUNK_BUDGET_BYTES = 640 * 2**20


def may_take_chunks(token_leaves, teachers, train: bool) -> bool:
  """Whether the objective's logit terms are ones the rule covers (static: its strategy)."""
  return train and teachers is None and bool(token_leaves) and all(
      isinstance(leaf, LogitKD) and leaf.top_k is None for _, leaf in token_leaves)


def chunk_tokens(inputs) -> int | None:
  """The chunk size (tokens of the global batch) for this traced step, or None to keep the
  slices: a TPU compile, with a teacher model run in the step (not a hidden-state cache's
  head) whose logits are to be made."""
  teacher = inputs.teacher_model
  if impl.compile_platform() != "tpu" or teacher is None or isinstance(teacher, TeacherHead):
    return None
  B, L = inputs.mask_BxL.shape
  vocab = inputs.student_model.config.vocab_size
  return B * vocab_chunks.auto_chunk_len(B, L, vocab, budget_bytes=TPU_CHUNK_BUDGET_BYTES)


def over_chunks(inputs):
  """`inputs` with the chunk engine's chunk size for this traced step (`chunk_tokens`), or None
  to keep the slices."""
  tokens = chunk_tokens(inputs)
  return None if tokens is None else dataclasses.replace(inputs, chunk_size=tokens)
