"""Cross-tokenizer on-policy distillation: the student's own samples, graded by a teacher with
another tokenizer, through the off-policy cross-tokenizer loss.

The same-tokenizer on-policy objective (on_policy/objective.py) samples inside the step. Here the teacher
cannot read the student's ids: its tokens of the sampled text, and the byte alignment of the two,
are built on the host (data.cross_tokenizer_samples) between sampling and scoring. So a step is
two programs on the mesh with the host in between (trainers/on_policy/host_step.py):

  1. `sample_completions`: the student samples the step's whole batch at once, with the key the
     same-tokenizer step samples with (the step's key folded with 1, then per row and sample,
     whatever the micro-batches): a cross-tokenizer run draws what a same-tokenizer one would;
  2. the host turns the samples into the teacher's rows and the alignment;
  3. the train step: `make_cross_tokenizer_on_policy_objective` rebuilds on-policy's scoring
     batch from the samples and runs the cross-tokenizer objective
     (objective.py: exact KL on one-to-one groups, GOLD span KL and ULD where
     the cuts differ, hard CE) on it, with only the completion's tokens trained.

With one tokenizer on both sides, alpha = 1 and T = 1 the loss is the forward KL over the
completion tokens: on-policy's GeneralizedJSD with beta = 0.

Batch keys, besides on-policy's prompt keys ([B, P], [B]):
  completion_tokens_BxSxT   int32  the S samples of each prompt, pad after the stop token
  completion_lengths_BxS    int32  counted tokens of each sample (stop token included)
and data.cross_tokenizer_rows' teacher and group keys, [B, S, ...] (cross_tokenizer_samples).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distillax.data.cross_tokenizer import rows
from distillax.distill.on_policy.objective import (PROMPT_LENGTHS, PROMPT_TOKENS, ROW_IDS, OnPolicySettings,
                                         Rollout, completion_stats, frozen_copy, row_keys,
                                         scoring_batch)
from distillax.framework.step import Objective, ObjectiveOutput
from distillax.models.sampler import GenerationOutput, decode

COMPLETION_TOKENS = "completion_tokens_BxSxT"
COMPLETION_LENGTHS = "completion_lengths_BxS"
SAMPLED_KEYS = (*rows.TEACHER_KEYS, rows.TEACHER_GROUP, rows.STUDENT_GROUP, rows.GROUP_KIND)


def sampling_keys(step_rng: jax.Array, row_ids_B: jax.Array, num_samples: int) -> jax.Array:
  """(B * num_samples,) keys: those of the same-tokenizer step, which samples its whole batch
  with fold_in(step key, 1), then per row and sample (on_policy.row_keys), whatever the
  micro-batches it learns in."""
  return row_keys(jax.random.fold_in(step_rng, 1), row_ids_B, num_samples)


def sample_completions(model, batch, step_rng: jax.Array,
                       settings: OnPolicySettings) -> GenerationOutput:
  """The student's completions of the batch's prompts ([B * S] rows, prompt-major), drawn as
  the same-tokenizer on-policy step draws them."""
  S = int(settings.num_samples)
  prompt_NxP = jnp.repeat(batch[PROMPT_TOKENS].astype(jnp.int32), S, axis=0)
  lengths_N = jnp.repeat(batch[PROMPT_LENGTHS].astype(jnp.int32), S, axis=0)
  keys_N = sampling_keys(step_rng, batch[ROW_IDS].astype(jnp.int32), S)
  return decode(frozen_copy(model), prompt_NxP, jnp.maximum(lengths_N, 1), keys_N,
                settings.sampling(), settings.cache_dtype)


def sampled_rollout(batch, num_samples: int) -> Rollout:
  """The batch's prompts and samples as on-policy's Rollout (N = B * S rows)."""
  S = int(num_samples)
  tokens_NxT = batch[COMPLETION_TOKENS].reshape(-1, batch[COMPLETION_TOKENS].shape[-1])
  zeros_NxT = jnp.zeros(tokens_NxT.shape, jnp.float32)
  generated = GenerationOutput(tokens_NxT.astype(jnp.int32),
                               batch[COMPLETION_LENGTHS].reshape(-1).astype(jnp.int32),
                               zeros_NxT, zeros_NxT)
  return Rollout(jnp.repeat(batch[PROMPT_TOKENS].astype(jnp.int32), S, axis=0),
                 jnp.repeat(batch[PROMPT_LENGTHS].astype(jnp.int32), S, axis=0), generated)


def make_cross_tokenizer_on_policy_objective(cross_objective, settings: OnPolicySettings
                                             ) -> Objective:
  """The train step's objective: `cross_objective` (cross_tokenizer_objective) on the scoring
  batch of the batch's samples, with the completion statistics of on-policy."""

  def objective(student, extras, batch, rng) -> ObjectiveOutput:
    rollout = sampled_rollout(batch, settings.num_samples)
    scored = scoring_batch(rollout, settings.pad_id)
    for key in SAMPLED_KEYS:
      scored[key] = batch[key].reshape((-1,) + batch[key].shape[2:])
    out = cross_objective(student, extras, scored, rng)
    out.ratios.update(completion_stats(rollout, settings.stops))
    return out

  # The draws were made before the step (sample_completions); nothing here depends on a worker.
  return Objective(objective, rng_per_worker=False)


__all__ = ["COMPLETION_LENGTHS", "COMPLETION_TOKENS", "SAMPLED_KEYS",
           "make_cross_tokenizer_on_policy_objective", "sample_completions", "sampled_rollout",
           "sampling_keys"]
