"""The on-policy figure: held-out prompts completed by the student, graded by the teacher.

`evaluate_on_policy(student, teacher, prompts, settings, seed=...)` samples one completion per
prompt with the student (a fixed seed, so evals compare across steps and runs), scores it with
both models in one forward each, and returns

  on_policy_teacher_nll        the teacher's NLL per completion token (how likely the teacher
                               finds what the student writes)
  on_policy_reverse_kl         KL(student || teacher) per completion token, full vocabulary
  on_policy_student_nll        the student's own NLL per token of its samples
  on_policy_completion_length  mean tokens per completion (stop token included)
  on_policy_eos_rate           share of completions that stopped before max_new_tokens
  on_policy_tokens             completion tokens scored

with the samples (prompt ids, completion ids) for a person to read. It is self-contained (any
student and teacher modules, any mesh): the trainer's eval calls it next to the validation
loss, the demo calls it on finished students.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax import partitioning as pt
from distillax.framework import vocab_chunks
from distillax.distill.multi_teacher import TeacherMix
from distillax.distill.on_policy.objective import (PROMPT_LENGTHS, PROMPT_TEACHER, PROMPT_TOKENS, ROW_IDS,
                                         OnPolicySettings, completion_stats,
                                         route_scoring_batch, sample_rollout, score_rollout,
                                         scoring_batch)
from distillax.distill.on_policy.losses import GeneralizedJSD
from distillax.distill.student import unwrap_student
from distillax.framework.backends import global_batch_placer

FIGURES = ("teacher_nll", "reverse_kl", "student_nll", "completion_length", "eos_rate")


def prompt_arrays(prompts, width: int, pad_id: int, rows: int | None = None,
                  first_row: int = 0) -> dict[str, np.ndarray]:
  """The prompt keys of a batch: `prompts` (token id arrays, each at most `width` long)
  right-padded to `width`, in `rows` rows (default len(prompts)); rows past the prompts are
  empty (length 0: they count nothing). row_ids count from `first_row`."""
  rows = len(prompts) if rows is None else int(rows)
  tokens = np.full((rows, width), pad_id, np.int32)
  lengths = np.zeros((rows,), np.int32)
  for i, p in enumerate(prompts[:rows]):
    tokens[i, :len(p)] = p
    lengths[i] = len(p)
  return {PROMPT_TOKENS: tokens, PROMPT_LENGTHS: lengths,
          ROW_IDS: np.arange(first_row, first_row + rows, dtype=np.int32)}


@dataclasses.dataclass
class OnPolicyEval:
  figures: dict[str, float]
  samples: list[tuple[list[int], list[int]]]  # (prompt ids, completion ids) per prompt


@functools.lru_cache(maxsize=16)
def _program(settings: OnPolicySettings, chunk_size, teachers, mesh, rules, s_graph, t_graph,
             sliced: bool = False):
  """The jitted eval program of these static facts, shared process-wide: every trainer eval
  and every demo row with the same models' structure, settings and mesh reuses one traced and
  lowered program (jit's own cache keys on the function object, so a fresh `jax.jit` per
  evaluator traced and lowered the same program again; the persistent cache only skips the
  backend compile). Holds graph definitions only, never weights."""
  leaf = GeneralizedJSD(beta=1.0, temperature=1.0, name="on_policy_reverse_kl")

  def run(s_state, t_state, batch, key):
    student, teacher = nnx.merge(s_graph, s_state), nnx.merge(t_graph, t_state)
    rollout = sample_rollout(unwrap_student(student)[0], batch, key, settings)
    scoring = route_scoring_batch(scoring_batch(rollout, settings.pad_id), batch, 1)
    out = score_rollout(leaf, student, {"teacher": teacher}, scoring, chunk_size=chunk_size,
                        teachers=teachers, sliced=sliced)
    ratios = {**out.ratios, **completion_stats(rollout, settings.stops)}
    return ratios, rollout.generated.tokens_BxT, rollout.generated.lengths_B, out.tokens

  if mesh is None:
    return jax.jit(run)

  def with_rules(*args):
    with pt.use_rules(mesh, rules):
      return run(*args)
  return jax.jit(with_rules)


class OnPolicyEvaluator:
  """`evaluate_on_policy` over programs compiled once per model structure, settings and mesh
  (`_program`, shared by every evaluator of the process). `teachers`: the teacher is a
  TeacherSet of several, mixed (at T = 1) or routed per prompt. `sliced`: scored over
  vocabulary slices (sliced.py), as train.loss_impl='sliced' scores training's."""

  def __init__(self, settings: OnPolicySettings, *, mesh=None, rules=None,
               chunk_size: int | None = vocab_chunks.AUTO, teachers: TeacherMix | None = None,
               sliced: bool = False):
    self.settings = dataclasses.replace(settings, num_samples=1)
    self.mesh, self.rules, self.chunk_size, self.sliced = mesh, rules, chunk_size, sliced
    self.teachers = None if teachers is None else dataclasses.replace(teachers, temperature=1.0)

  def __call__(self, student, teacher, prompts, *, seed: int = 0,
               prompt_teachers=None) -> OnPolicyEval:
    """`prompt_teachers`: routing, the teacher index of each prompt."""
    s_graph, s_state = nnx.split(student)
    t_graph, t_state = nnx.split(teacher)
    program = _program(self.settings, self.chunk_size, self.teachers, self.mesh, self.rules,
                       s_graph, t_graph, self.sliced)
    rows = len(prompts)
    if self.mesh is not None:  # whole rows per data-parallel worker
      data = int(self.mesh.shape.get("data", 1))
      rows = -(-rows // data) * data
    width = max(len(p) for p in prompts)
    batch = prompt_arrays(prompts, width, self.settings.pad_id, rows)
    if prompt_teachers is not None:
      batch[PROMPT_TEACHER] = np.zeros((rows,), np.int32)
      batch[PROMPT_TEACHER][:len(prompts)] = prompt_teachers
    if self.mesh is not None:
      batch = global_batch_placer(self.mesh, self.rules)(batch)
    ratios, tokens, lengths, count = jax.device_get(
        program(s_state, t_state, batch, jax.random.key(seed)))
    figures = {f"on_policy_{k}": float(n) / max(float(d), 1.0) for k, (n, d) in ratios.items()
               if k in FIGURES}
    figures["on_policy_tokens"] = float(count)
    samples = [(list(map(int, p)), tokens[i, :lengths[i]].tolist())
               for i, p in enumerate(prompts)]
    return OnPolicyEval(figures, samples)


def evaluate_on_policy(student: nnx.Module, teacher: nnx.Module, prompts,
                       settings: OnPolicySettings, *, seed: int = 0, mesh=None, rules=None,
                       chunk_size: int | None = vocab_chunks.AUTO) -> OnPolicyEval:
  """One-off on-policy eval (see the module doc); keep an OnPolicyEvaluator to reuse its
  compiled program. `prompts`: token id arrays (each at least one token)."""
  return OnPolicyEvaluator(settings, mesh=mesh, rules=rules, chunk_size=chunk_size)(
      student, teacher, prompts, seed=seed)


__all__ = ["FIGURES", "OnPolicyEval", "OnPolicyEvaluator", "evaluate_on_policy",
           "prompt_arrays"]
