"""The on-policy eval figure against each completion scored alone: the teacher's NLL and the
exact reverse KL per completion token, and the same completions for the same seed."""

import jax.numpy as jnp
import numpy as np
import pytest

from distillax.distill.on_policy.objective import OnPolicySettings
from distillax.distill.on_policy import eval as on_policy_eval
from distillax.distill.on_policy.eval import OnPolicyEvaluator
from tests.distill import helpers as h

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_figures_equal_each_completion_scored_alone():
  student, teacher = h.make_models(4)
  prompts = [np.array([5, 9, 13, 4], np.int32), np.array([7], np.int32),
             np.array([8, 20, 30], np.int32)]
  settings = OnPolicySettings(max_new_tokens=7, eos_id=3, stop_ids=(11,), pad_id=0,
                              temperature=1.5)
  evaluator = OnPolicyEvaluator(settings)
  result = evaluator(student, teacher, prompts, seed=3)
  # Each prompt + completion alone, right-padded to one width: under causal attention a row's
  # logits up to its last token ignore the padding after it, and one forward per model over
  # the three rows is three times cheaper than three (op by op, uncompiled).
  seqs = [np.concatenate([p, c]) for p, (_, c) in zip(prompts, result.samples)]
  padded = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
  for i, seq in enumerate(seqs):
    padded[i, :len(seq)] = seq
  teacher_logits = np.asarray(teacher(jnp.asarray(padded)).logits_BxLxV)
  student_logits = np.asarray(student(jnp.asarray(padded)).logits_BxLxV)
  nll, rkl, tokens, ended = 0.0, 0.0, 0, 0
  for i, (prompt, (p_ids, completion)) in enumerate(zip(prompts, result.samples)):
    assert p_ids == prompt.tolist() and 1 <= len(completion) <= 7
    ended += completion[-1] in (3, 11)
    rows = slice(len(prompt) - 1, len(prompt) + len(completion) - 1)
    log_p = h.np_log_softmax(teacher_logits[i][rows])
    log_q = h.np_log_softmax(student_logits[i][rows])
    nll -= np.take_along_axis(log_p, np.asarray(completion)[:, None], 1).sum()
    rkl += (np.exp(log_q) * (log_q - log_p)).sum()
    tokens += len(completion)
  f = result.figures
  assert f["on_policy_tokens"] == tokens
  np.testing.assert_allclose(f["on_policy_teacher_nll"], nll / tokens, rtol=1e-5)
  np.testing.assert_allclose(f["on_policy_reverse_kl"], rkl / tokens, rtol=1e-5)
  np.testing.assert_allclose(f["on_policy_completion_length"], tokens / 3, rtol=1e-6)
  np.testing.assert_allclose(f["on_policy_eos_rate"], ended / 3, rtol=1e-6)
  # A second evaluator (as every trainer engine and demo report builds its own) runs the first
  # one's jitted program: same settings and models' structure, no new trace.
  programs = on_policy_eval._program.cache_info()
  again = OnPolicyEvaluator(settings)(student, teacher, prompts, seed=3)
  assert again.samples == result.samples and again.figures == f
  shared = on_policy_eval._program.cache_info()
  assert (shared.hits, shared.misses) == (programs.hits + 1, programs.misses)
