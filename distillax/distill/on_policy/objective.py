"""On-policy distillation as a step objective: the student writes, the teacher grades each token.

Inside the compiled train step, two batches:

  1. the sampling batch, once per step (the objective's `prepare`, framework/step.py): the
     student samples `num_samples` completions of every prompt of the step at once, with the
     step's weights (the fake-quantized forward under QAT, adapters under LoRA), through the
     same KV-cached decode as models/sampler.py (`decode`), behind stop_gradient: no gradient
     flows through sampling. A decode step reads the weights once for all its rows, so the
     more rows sample together, the nearer the chip's bandwidth runs them;
  2. the update micro-batches (train.accum_steps of them, gradient accumulation): per
     micro-batch of those samples, teacher and student each score prompt + completion in one
     forward; only completion tokens count (prompt, padding and everything after a row's stop
     token are masked); the loss is `GeneralizedJSD` or `SampledTokenKL` (losses.py) over those
     tokens, through the same shared, chunked pass over the vocabulary as every logit loss.

Every sample of a step comes from the weights that step updates, so the run stays strictly
on-policy whatever the number of micro-batches, and the step's loss, gradients and update are
those of the same samples learned in one micro-batch (sums over tokens, framework/step.py).
Sampling runs before any micro-batch's activations exist: its KV cache's memory (bf16 at the
compute dtype, P + max_new_tokens long, the widths the step really runs) is free again for them.

Randomness: the sampling key of a row is the step's key folded with the row's global id
(`row_ids_B` in the batch) and its sample number, so every backend and data-parallel layout
draws the same samples (the objective is built with `rng_per_worker=False`, see
framework/step.py), and a resumed run (the step's key is a function of the checkpointed RNG and
the step) draws exactly what an uninterrupted one would.

`lmbda` mixing (GKD): with probability lmbda a step is on-policy (all its micro-batches),
otherwise the data's own completions are teacher-forced through `off_policy` (the distill
objective) and nothing is sampled; lmbda = 0 is the off-policy objective itself (no sampling is
even traced), lmbda = 1 never consults it.

The batch (trainers/on_policy/recipe.py builds it) carries the packed keys of the distill objective and
  prompt_tokens_BxP  int32  prompts, right-padded with pad_id
  prompt_lengths_B   int32  each prompt's real length (>= 1; 0 marks a row that counts nothing)
  row_ids_B          int32  the row's index in the global batch
  prompt_teacher_B   int32  several teachers routed (multi_teacher.py): each prompt's teacher,
                            which grades every token of that prompt's completions

Several teachers (`teachers`: a TeacherMix, their models under its keys in the extras) score a
rollout side by side: mixture grades each token by sum_i w_i softmax(t_i / T), routing by the
prompt's own teacher only (TEACHER_INDEX of the scoring batch, from prompt_teacher_B).

Reported (per-token means over the completion tokens, as `ratios` of framework.step, so steps
that are off-policy report 0): reverse_kl (exact KL(student || teacher) at T = 1 over the full
vocabulary), teacher_nll and student_nll (of the sampled tokens), and per sampled sequence
completion_length and eos_rate (the share that stopped before max_new_tokens ran out), plus
on_policy (the share of (micro-)batches that sampled). An MoE student's router losses
(moe_aux_loss, router_z_loss, weighted into the loss by `router_loss_weights`) and expert loads
(expert_load_max_over_mean_l{i}, expert_tokens_dropped_l{i}) come from its scoring forward, as
in the distill objective.

Called whole (`Objective.__call__`: prepare, then the function), the objective samples and
learns from one batch, as a step of one micro-batch does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.framework import vocab_chunks
from distillax.distill.base import Strategy
from distillax.distill.divergences import kl
from distillax.distill.logits import STUDENT, TEACHER, TokenLogits
from distillax.distill.multi_teacher import TEACHER_INDEX, TeacherMix, teacher_set
from distillax.distill.objective import TEACHER as TEACHER_KEY, run_models
from distillax.distill.on_policy.losses import SAMPLE_LOGPROBS
from distillax.distill.on_policy.sliced import sliced_score_sums, sliced_scoring
from distillax.distill.student import unwrap_student
from distillax.errors import ConfigError
from distillax.data import batch as batch_spec
from distillax.framework.step import Objective, ObjectiveOutput
from distillax.models.moe import layer as moe
from distillax.models.sampler import (GenerationOutput, SamplingConfig, decode, right_align,
                                      weights_in_compute_dtype)

PROMPT_TOKENS = "prompt_tokens_BxP"
PROMPT_LENGTHS = "prompt_lengths_B"
ROW_IDS = "row_ids_B"
PROMPT_TEACHER = "prompt_teacher_B"  # routing: the index of each prompt's teacher
PROMPT_KEYS = (PROMPT_TOKENS, PROMPT_LENGTHS, ROW_IDS)
# What each on-policy (micro-)batch reports as ratios, whatever its branch.
TOKEN_METRICS = ("reverse_kl", "teacher_nll", "student_nll")
SEQUENCE_METRICS = ("completion_length", "eos_rate")
# The step's samples in its batch (what the objective's prepare adds, once per step): the
# scoring batch's keys under this prefix, per sampled row, so micro-batches split them.
ROLLOUT = "rollout/"
LENGTH_ROWS, ENDED_ROWS, REAL_ROWS = (ROLLOUT + "length_N", ROLLOUT + "ended_N",
                                      ROLLOUT + "real_N")
SAMPLED_ROWS = ROLLOUT + "on_policy_N"  # 1 on every row when the step sampled, else 0


@dataclasses.dataclass(frozen=True)
class OnPolicySettings:
  """How the student samples, and how often (hashable: the step closes over it)."""

  max_new_tokens: int
  num_samples: int = 1
  temperature: float = 1.0
  top_k: int | None = None
  top_p: float | None = None
  eos_id: int | None = None
  stop_ids: tuple[int, ...] = ()
  pad_id: int = 0
  lmbda: float = 1.0
  cache_dtype: str | None = None
  vocab_limit: int | None = None  # the tokenizer's vocab_size: padded rows are never sampled
  # Sample from a copy of the matmul weights in the compute dtype, cast once before the decode
  # loop (models/sampler.weights_in_compute_dtype): for a plain student only (not QAT, LoRA).
  cast_weights: bool = False

  def __post_init__(self):
    if self.num_samples < 1:
      raise ConfigError(f"on_policy.num_samples={self.num_samples} must be >= 1")
    if not 0.0 <= self.lmbda <= 1.0:
      raise ConfigError(f"on_policy.lmbda={self.lmbda!r} must be in [0, 1] (the share of steps "
                        f"on the student's own samples)")
    self.sampling()  # checks the sampling fields

  def sampling(self) -> SamplingConfig:
    return SamplingConfig(int(self.max_new_tokens), float(self.temperature), self.top_k,
                          self.top_p, self.eos_id, int(self.pad_id), tuple(self.stop_ids),
                          self.vocab_limit)

  @property
  def stops(self) -> tuple[int, ...]:
    return tuple(dict.fromkeys(([] if self.eos_id is None else [self.eos_id])
                               + list(self.stop_ids)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
  """Sampled completions of prompts repeated num_samples times (N = B * num_samples rows)."""

  prompt_NxP: jax.Array
  prompt_lengths_N: jax.Array
  generated: GenerationOutput


def frozen_copy(model: nnx.Module) -> nnx.Module:
  """The module over its arrays behind stop_gradient: what samples, so nothing it computes
  carries a gradient back to the parameters."""
  graph, state = nnx.split(model)
  return nnx.merge(graph, jax.tree.map(jax.lax.stop_gradient, state))


def row_keys(key: jax.Array, row_ids_B: jax.Array, num_samples: int) -> jax.Array:
  """(B * num_samples,) keys: sample s of global row r uses fold_in(key, r * num_samples + s)."""
  ids_N = (row_ids_B[:, None] * num_samples + jnp.arange(num_samples)[None]).reshape(-1)
  return jax.vmap(jax.random.fold_in, (None, 0))(key, ids_N)


def sample_rollout(model: nnx.Module, batch: Mapping[str, jax.Array], key: jax.Array,
                   settings: OnPolicySettings) -> Rollout:
  """The student's completions of the batch's prompts, sampled without gradient."""
  S = int(settings.num_samples)
  prompt_NxP = jnp.repeat(batch[PROMPT_TOKENS].astype(jnp.int32), S, axis=0)
  lengths_N = jnp.repeat(batch[PROMPT_LENGTHS].astype(jnp.int32), S, axis=0)
  keys_N = row_keys(key, batch[ROW_IDS].astype(jnp.int32), S)
  model = frozen_copy(model)
  if settings.cast_weights:
    model = weights_in_compute_dtype(model)
  generated = decode(model, prompt_NxP, jnp.maximum(lengths_N, 1), keys_N,
                     settings.sampling(), settings.cache_dtype)
  return Rollout(prompt_NxP, lengths_N, generated)


def scoring_batch(rollout: Rollout, pad_id: int) -> dict[str, jax.Array]:
  """Prompt + completion as one packed batch of N rows and W - 1 = P + T - 1 inputs: the prompt
  right-aligned (as the sampler ran it), the completion after it; the loss mask keeps the
  completion's counted tokens (up to and including its stop token) and nothing else."""
  prompt_NxP, lengths_N, gen = rollout.prompt_NxP, rollout.prompt_lengths_N, rollout.generated
  N, P = prompt_NxP.shape
  T = gen.tokens_BxT.shape[1]
  aligned_NxP, segments_NxP, positions_NxP = right_align(prompt_NxP, jnp.maximum(lengths_N, 1))
  tokens_NxW = jnp.concatenate([aligned_NxP, gen.tokens_BxT], axis=1)
  # Real inputs: the prompt and the completion up to (not including) its last counted token,
  # which predicts nothing; what follows a stop token and empty rows get segment 0, so a
  # mixture of experts' router statistics count real tokens only. Causal attention keeps
  # every counted position's value whatever the later segments are.
  slot = jnp.arange(P + T - 1)[None]
  real = (slot < P - 1 + gen.lengths_B[:, None]) & (lengths_N[:, None] > 0)
  segments_NxW = jnp.concatenate([segments_NxP, jnp.ones((N, T), jnp.int32)], axis=1)
  segments_NxW = segments_NxW * jnp.pad(real, ((0, 0), (0, 1))).astype(jnp.int32)
  positions_NxW = jnp.concatenate(
      [positions_NxP, jnp.maximum(lengths_N, 1)[:, None] + jnp.arange(T, dtype=jnp.int32)], 1)
  counted = (slot >= P - 1) & real
  sample_logp_NxW = jnp.concatenate([jnp.zeros((N, P - 1)), gen.sample_logprobs_BxT], axis=1)
  del pad_id  # padding after a stop token is the sampler's pad_id already; it is masked
  return {batch_spec.INPUTS: tokens_NxW[:, :-1], batch_spec.TARGETS: tokens_NxW[:, 1:],
          batch_spec.SEGMENT_IDS: segments_NxW[:, :-1],
          batch_spec.POSITIONS: positions_NxW[:, :-1],
          batch_spec.LOSS_MASK: counted.astype(jnp.float32),
          SAMPLE_LOGPROBS: sample_logp_NxW.astype(jnp.float32)}


def route_scoring_batch(scoring: dict, batch: Mapping[str, jax.Array],
                        num_samples: int) -> dict:
  """`scoring` with TEACHER_INDEX (every token of a completion: its prompt's teacher) when the
  batch routes its prompts (PROMPT_TEACHER); unchanged otherwise."""
  if PROMPT_TEACHER not in batch:
    return scoring
  index_N = jnp.repeat(batch[PROMPT_TEACHER].astype(jnp.int32), int(num_samples), axis=0)
  shape = scoring[batch_spec.INPUTS].shape
  return {**scoring, TEACHER_INDEX: jnp.broadcast_to(index_N[:, None], shape)}


def completion_rows(rollout: Rollout, stops: tuple[int, ...]) -> dict[str, jax.Array]:
  """Per sampled row: its counted length, whether it ended on a stop token, whether it is real
  (each 0 for an empty row); completion_stats sums them."""
  gen, real_N = rollout.generated, (rollout.prompt_lengths_N > 0).astype(jnp.float32)
  last_N = jnp.take_along_axis(gen.tokens_BxT, jnp.maximum(gen.lengths_B - 1, 0)[:, None],
                               axis=1)[:, 0]
  ended_N = jnp.zeros_like(real_N, dtype=bool)
  for stop in stops:
    ended_N = ended_N | (last_N == stop)
  return {LENGTH_ROWS: gen.lengths_B * real_N, ENDED_ROWS: ended_N * real_N, REAL_ROWS: real_N}


def stats_of_rows(rows: Mapping[str, jax.Array]) -> dict[str, tuple]:
  """completion_length and eos_rate as (numerator, denominator) sums of completion_rows."""
  real = jnp.sum(rows[REAL_ROWS])
  return {"completion_length": (jnp.sum(rows[LENGTH_ROWS]), real),
          "eos_rate": (jnp.sum(rows[ENDED_ROWS]), real)}


def completion_stats(rollout: Rollout, stops: tuple[int, ...]) -> dict[str, tuple]:
  """Per-sequence ratios: mean completion length and the share that ended on a stop token."""
  return stats_of_rows(completion_rows(rollout, stops))


def score_values(leaf: Strategy, logits: TokenLogits) -> dict[str, jax.Array]:
  """The loss term of `leaf` and the on-policy metrics, per completion token."""
  values = dict(leaf.shared_token_values(logits))
  metrics = {"reverse_kl": kl(logits.log_probs(STUDENT), logits.log_probs(TEACHER)),
             "teacher_nll": logits.nll(TEACHER), "student_nll": logits.nll(STUDENT)}
  values.update(jax.tree.map(jax.lax.stop_gradient, metrics))
  return values


def score_rollout(leaf: Strategy, student, extras, batch, *, chunk_size=vocab_chunks.AUTO,
                  teacher_key: str = TEACHER_KEY,
                  router_loss_weights: tuple[float, float] = (0.0, 0.0),
                  teachers: TeacherMix | None = None, sliced: bool = False) -> ObjectiveOutput:
  """Teacher and student on a scoring batch: the leaf's loss over the completion tokens; for a
  mixture-of-experts student also its router losses (weighted by `router_loss_weights`, per
  completion token like every term) and expert loads, from the routing of the scoring forward
  over the real tokens (prompt and completion). `teachers`: the teacher at `teacher_key` is a
  TeacherSet, whose side-by-side logits `teachers.combine` folds into one per chunk. `sliced`:
  over vocabulary slices where they score the leaf (sliced.py: either loss), else the chunk
  engine."""
  sliced = sliced and sliced_scoring(leaf)
  if sliced and chunk_size is None:
    chunk_size = vocab_chunks.AUTO  # the forward passes return hidden states, not logits
  inputs = run_models(leaf, student, extras, batch, chunk_size=chunk_size,
                      teacher_key=teacher_key)

  def values(s, t, tok):
    if teachers is not None:
      t = teachers.combine(t, tok)
    return score_values(leaf, TokenLogits(s, t, tok))

  loss_sum, sums = (sliced_score_sums(leaf, inputs, teachers) if sliced else
                    inputs.loss_and_sums(values, {leaf.name: float(leaf.weight)}))
  tokens = jnp.sum(inputs.mask_BxL)
  ratios = {k: (sums.pop(k), tokens) for k in TOKEN_METRICS}
  if inputs.student.router_stats is not None:
    extra, router_sums, router_ratios = moe.objective_terms(inputs.student.router_stats, tokens,
                                                            *router_loss_weights)
    loss_sum = loss_sum + extra
    sums.update(router_sums)
    ratios.update(router_ratios)
  return ObjectiveOutput(loss_sum=loss_sum, tokens=tokens, sums=sums, ratios=ratios)


def _with_keys(out: ObjectiveOutput, sums: Mapping, ratios: Mapping, on: float) -> ObjectiveOutput:
  """`out` with zeros for the sums and ratios the other branch reports (lax.cond needs one
  structure), and the on_policy share."""
  zero = jnp.zeros((), jnp.float32)
  all_sums = {k: out.sums.get(k, zero) for k in sums}
  all_ratios = {k: out.ratios.get(k, (zero, zero)) for k in ratios}
  all_ratios["on_policy"] = (jnp.asarray(on, jnp.float32), jnp.ones((), jnp.float32))
  return ObjectiveOutput(loss_sum=out.loss_sum, tokens=out.tokens, sums=all_sums,
                         ratios=all_ratios)


def make_prepare(settings: OnPolicySettings, sampling_context: Callable) -> Callable:
  """The objective's prepare: (student, extras, whole batch, step key) -> the step's samples as
  scoring arrays under ROLLOUT (per sampled row) and their per-row statistics."""

  def sample(student, batch, rng) -> dict[str, jax.Array]:
    model, _ = unwrap_student(student)
    with sampling_context():
      rollout = sample_rollout(model, batch, jax.random.fold_in(rng, 1), settings)
    scoring = route_scoring_batch(scoring_batch(rollout, settings.pad_id), batch,
                                  settings.num_samples)
    rows = completion_rows(rollout, settings.stops)
    return {**{ROLLOUT + k: v for k, v in scoring.items()}, **rows,
            SAMPLED_ROWS: jnp.ones_like(rows[REAL_ROWS])}

  def prepare(student, extras, batch, rng) -> dict[str, jax.Array]:
    """The step's whole sampling batch, drawn at once with the step's weights; with lmbda < 1
    only on the lmbda share of steps (the rest get zeros of the same shapes)."""
    del extras
    if settings.lmbda == 1.0:
      return sample(student, batch, rng)
    shapes = jax.eval_shape(sample, student, batch, rng)
    use = jax.random.bernoulli(jax.random.fold_in(rng, 2), settings.lmbda)
    return jax.lax.cond(use, lambda: sample(student, batch, rng),
                        lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))

  return prepare


def make_on_policy_objective(leaf: Strategy, settings: OnPolicySettings, *,
                             off_policy: Objective | None = None,
                             chunk_size: int | None = vocab_chunks.AUTO,
                             teacher_key: str = TEACHER_KEY,
                             sampling_context: Callable | None = None,
                             router_loss_weights: tuple[float, float] = (0.0, 0.0),
                             teachers: TeacherMix | None = None, sliced: bool = False
                             ) -> Objective:
  """The step objective (see the module doc). `leaf`: GeneralizedJSD or SampledTokenKL;
  `off_policy`: the teacher-forced objective of the (1 - lmbda) share (needed when lmbda < 1);
  `sampling_context`: a context manager factory sampling runs under (e.g. adapter dropout off);
  `router_loss_weights`: (Switch load-balancing, router z-loss) weights of an MoE student;
  `teachers`: several teachers (their extras under `teachers.keys`), mixed or routed per prompt
  at the leaf's temperature; `sliced`: score over vocabulary slices where they compute the leaf
  (score_rollout)."""
  sampling_context = sampling_context or contextlib.nullcontext
  vocab_chunks.check_chunk_size(chunk_size)
  if settings.lmbda < 1.0 and off_policy is None:
    raise ConfigError(f"on_policy.lmbda={settings.lmbda} < 1 mixes in the data's own "
                      f"completions, which needs the off-policy (distill) objective")
  if settings.lmbda == 0.0:
    return off_policy
  if teachers is not None:  # the mixture is the teacher the leaf reads, at the leaf's temperature
    teachers = dataclasses.replace(teachers, temperature=float(leaf.temperature))

  prepare = make_prepare(settings, sampling_context)

  def on_policy(student, extras, batch, rng) -> ObjectiveOutput:
    """One micro-batch of the step's samples, scored and learned from."""
    del rng
    model, _ = unwrap_student(student)
    scoring = {k[len(ROLLOUT):]: v for k, v in batch.items()
               if k.startswith(ROLLOUT) and k not in ROW_KEYS}
    if teachers is not None:
      extras = {**extras, teacher_key: teacher_set(extras, teachers, model.config.vocab_size)}
    out = score_rollout(leaf, student, extras, scoring, chunk_size=chunk_size,
                        teacher_key=teacher_key, router_loss_weights=router_loss_weights,
                        teachers=teachers, sliced=sliced)
    out.ratios.update(stats_of_rows(batch))
    return out

  def objective(student, extras, batch, rng) -> ObjectiveOutput:
    if settings.lmbda == 1.0:
      out = on_policy(student, extras, batch, rng)
      return _with_keys(out, out.sums, out.ratios, 1.0)
    shapes = [jax.eval_shape(f, student, extras, batch, rng) for f in (on_policy, off_policy)]
    sums = {k: None for s in shapes for k in s.sums}
    ratios = {k: None for s in shapes for k in s.ratios}
    return jax.lax.cond(batch[SAMPLED_ROWS][0] > 0,
                        lambda: _with_keys(on_policy(student, extras, batch, rng), sums,
                                           ratios, 1.0),
                        lambda: _with_keys(off_policy(student, extras, batch, rng), sums,
                                           ratios, 0.0))

  return Objective(objective, rng_per_worker=False, prepare=prepare)


ROW_KEYS = (LENGTH_ROWS, ENDED_ROWS, REAL_ROWS, SAMPLED_ROWS)


__all__ = ["OnPolicySettings", "PROMPT_KEYS", "PROMPT_LENGTHS", "PROMPT_TEACHER", "PROMPT_TOKENS",
           "ROLLOUT", "ROW_IDS", "Rollout", "completion_rows", "completion_stats", "frozen_copy",
           "make_on_policy_objective", "make_prepare", "route_scoring_batch", "row_keys",
           "sample_rollout", "score_rollout", "scoring_batch"]
