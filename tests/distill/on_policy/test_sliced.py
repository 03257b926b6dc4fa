"""On-policy scoring over vocabulary slices (distill/on_policy/sliced.py) against the whole-logits
scoring (jax.nn.log_softmax and autodiff through both models' full logits) and the chunk
engine: GeneralizedJSD at beta 0 (forward KL), between (the jsd's second pass) and 1 (reverse
KL), SampledTokenKL (framework/slice_targets.py), at two temperatures, a plain and a
LoRA-adapted student; the loss, the reverse_kl / teacher_nll / student_nll ratios and every
trained gradient. And which leaves the slices score."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.distill.multi_teacher import TEACHER_INDEX, TeacherMix, teacher_set
from distillax.distill.on_policy.losses import SAMPLE_LOGPROBS, GeneralizedJSD, SampledTokenKL
from distillax.distill.on_policy.objective import TOKEN_METRICS, score_rollout
from distillax.distill.on_policy.sliced import divergence_of, sliced_scoring
from distillax.framework import token_loss_impl, vocab_chunks, vocab_slices
from distillax.quant import LoRAParam, apply_lora
from distillax.quant.lora import lora_weights
from tests.distill import helpers as h
from tests.support import chip
from tests.support.models import NORMS_NEAR_ONE, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def models():
  """(student, teacher, a scoring batch with the sampler's log-probabilities of its targets)."""
  student, teacher = h.make_models(3)
  batch = h.to_jnp(h.make_batch(B=3, L=9, seed=2))
  sampler = jnp.log(jax.random.uniform(jax.random.key(5), (3, 9), minval=0.01, maxval=0.3))
  return student, teacher, {**batch, SAMPLE_LOGPROBS: sampler}


def _score(leaf, student, teacher, batch, trained=nnx.Param, **kwargs):
  """(output, gradients of the `trained` parameters by path) of score_rollout's loss sum."""
  graph, diff, rest = nnx.split(student, trained, ...)

  def loss(diff):
    out = score_rollout(leaf, nnx.merge(graph, diff, rest), {"teacher": teacher}, batch,
                        **kwargs)
    return out.loss_sum, out

  with token_loss_impl.recorded_choices() as ran:
    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(diff)
  return [k.split(" (")[0] for k in ran], out, nnx.to_pure_dict(grads)


def _assert_same(out, grads, want_out, want_grads):
  chip.assert_close(out.loss_sum, want_out.loss_sum, rtol=1e-5)
  assert float(out.tokens) == float(want_out.tokens)
  assert sorted(out.ratios) == sorted(want_out.ratios) and set(TOKEN_METRICS) <= set(out.ratios)
  for k in out.ratios:
    chip.assert_close(out.ratios[k][0], want_out.ratios[k][0], rtol=1e-5, err_msg=k)
  assert sorted(out.sums) == sorted(want_out.sums)
  for k in out.sums:
    chip.assert_close(out.sums[k], want_out.sums[k], rtol=1e-5, err_msg=k)
  flat, want_flat = (jax.tree_util.tree_leaves_with_path(g) for g in (grads, want_grads))
  for (path, g), (_, w) in zip(flat, want_flat):
    scale = max(float(np.max(np.abs(w))), 1e-6)
    chip.assert_close(g, w, atol=1e-5 * scale, tpu=chip.F32_GRADS,
                      err_msg=jax.tree_util.keystr(path))
  assert len(jax.tree.leaves(grads)) == len(jax.tree.leaves(want_grads)) > 0


@pytest.mark.parametrize("leaf", [
    GeneralizedJSD(beta=0.0, temperature=2.0, weight=0.8),
    GeneralizedJSD(beta=0.3, temperature=1.5, weight=0.8),
    GeneralizedJSD(beta=1.0, temperature=1.0, weight=0.8),
    GeneralizedJSD(beta=0.5, temperature=1.0),
    SampledTokenKL(temperature=1.0, weight=0.8),
    SampledTokenKL(temperature=1.5),
], ids=["forward_kl_T2", "jsd_0.3_T1.5", "reverse_kl", "jsd_0.5", "sampled_kl", "sampled_kl_T1.5"])
def test_sliced_scoring_equals_whole_logits_and_the_chunk_engine(models, leaf, monkeypatch):
  """48 columns in slices of 20 (the last shifted back over 12 columns already seen): within
  1e-5 of the whole logits' (relative; gradients: of each array's scale), and the chunk
  engine's too."""
  student, teacher, batch = models
  monkeypatch.setattr(vocab_slices, "slice_size_for", lambda tokens, vocab, requested=0: 20)
  ran, out, grads = _score(leaf, student, teacher, batch, sliced=True)
  assert ran == ["sliced"]
  _, want_out, want = _score(leaf, student, teacher, batch, chunk_size=None)
  _assert_same(out, grads, want_out, want)
  ran, chunk_out, chunk = _score(leaf, student, teacher, batch, chunk_size=vocab_chunks.AUTO)
  assert ran == ["chunked"]
  _assert_same(out, grads, chunk_out, chunk)
  assert float(out.ratios["reverse_kl"][0]) > 0 and float(out.loss_sum) != 0


def test_a_lora_students_sliced_scoring_equals_whole_logits(models, monkeypatch):
  """The student's head and a query projection adapted (B given values): the adapters'
  gradients over slices of 20 equal the whole logits'."""
  student, teacher, batch = models
  student = apply_lora(student, module_regex="lm_head|layers/0/attn/q", rank=4,
                       alpha=8.0)
  for _, w in lora_weights(student):
    w.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(3), w.lora_b[...].shape)
  monkeypatch.setattr(vocab_slices, "slice_size_for", lambda tokens, vocab, requested=0: 20)
  leaf = GeneralizedJSD(beta=0.5, temperature=1.0)
  ran, out, grads = _score(leaf, student, teacher, batch, trained=LoRAParam, sliced=True)
  assert ran == ["sliced"]
  _, want_out, want = _score(leaf, student, teacher, batch, trained=LoRAParam, chunk_size=None)
  _assert_same(out, grads, want_out, want)


@pytest.mark.parametrize("mode", ["mixture", "routing"])
@pytest.mark.parametrize("leaf", [GeneralizedJSD(beta=0.3, temperature=1.5), SampledTokenKL()],
                         ids=["jsd", "sampled_kl"])
def test_several_teachers_sliced_scoring_equals_the_chunk_engine(models, mode, leaf,
                                                                 monkeypatch):
  """Two teachers (the fixture's and another), mixed (weights 1 and 3) or routed per row, fold
  over slices of 20 as over token chunks: loss, ratios, sums and every gradient within 1e-5."""
  student, teacher, batch = models
  other = random_model(h.TEACHER_CONFIG, 321, NORMS_NEAR_ONE)
  monkeypatch.setattr(vocab_slices, "slice_size_for", lambda tokens, vocab, requested=0: 20)
  mix = TeacherMix(("a", "b"), mode, (1.0, 3.0), temperature=float(leaf.temperature))
  both = teacher_set({"teacher:a": teacher, "teacher:b": other}, mix, h.VOCAB)
  batch = {**batch, TEACHER_INDEX: jnp.repeat(jnp.array([1, 0, 1], jnp.int32)[:, None], 9, 1)}
  ran, out, grads = _score(leaf, student, both, batch, sliced=True, teachers=mix)
  assert ran == ["sliced"]
  _, want_out, want = _score(leaf, student, both, batch, chunk_size=vocab_chunks.AUTO,
                             teachers=mix)
  _assert_same(out, grads, want_out, want)


def test_what_the_slices_score():
  """Either loss (one teacher or several); beta's end points are the two KLs."""
  assert sliced_scoring(GeneralizedJSD()) and sliced_scoring(SampledTokenKL())
  assert [divergence_of(b) for b in (0.0, 0.3, 1.0)] == ["forward_kl", "jsd", "reverse_kl"]
