"""train.loss_impl='auto' on a TPU (distill/tpu_chunks.py): a live teacher's LogitKDs take the
chunk engine at large chunks in a train objective, the same numbers as over slices; an eval, a
CPU compile, a top-k, several teachers or a hidden-state cache keep the slices; the chunk the
chip measured (8 chunks of 256 positions at 4 x 2048, V 151,936); the distill recipe's choice."""

import math
import types

import numpy as np
import pytest

from distillax.distill import LogitKD, make_distill_objective, tpu_chunks
from distillax.distill.teacher_head import TeacherHead
from distillax.framework import token_loss_impl, vocab_chunks
from distillax.models.attention import impl
from tests.distill import helpers as h
from tests.distill.test_multi_teacher import _assert_same, _value_and_grads

STRATEGY = LogitKD(temperature=2.0, alpha=0.7) + LogitKD(temperature=1.0, alpha=0.5,
                                                           divergence="reverse_kl", name="rev")


def _run(strategy, student, extras, batch, **kwargs):
  """(output, gradients) of the objective and the engines its token losses ran on."""
  with token_loss_impl.recorded_choices() as ran:
    got = _value_and_grads(make_distill_objective(strategy, sliced=True, **kwargs), student,
                           extras, batch)
  return got, [k.split(" (")[0] for k in ran]


@pytest.mark.parametrize("strategy", [LogitKD(temperature=2.0, alpha=0.7), STRATEGY],
                         ids=["one_logit_kd", "two_logit_kds"])
def test_a_tpu_train_objective_takes_chunks_with_the_slices_numbers(strategy, monkeypatch):
  """36 token rows, some masked: compiled for a TPU the train objective runs the chunk engine,
  and its loss, sums and every gradient are within 1e-5 of the slices' (the CPU's choice)."""
  student, teacher = h.make_models(0)
  batch = h.to_jnp(h.make_batch(B=4, L=9))
  extras = {"teacher": teacher}
  monkeypatch.setattr(impl, "compile_platform", lambda: "cpu")
  want, ran = _run(strategy, student, extras, batch, metrics=False, chunks_on_tpu=True)
  assert ran == ["sliced"]
  monkeypatch.setattr(impl, "compile_platform", lambda: "tpu")
  got, ran = _run(strategy, student, extras, batch, metrics=False, chunks_on_tpu=True)
  assert ran == ["chunked"]
  _assert_same(got, want)


def test_what_keeps_the_slices_on_a_tpu(monkeypatch):
  """An eval objective, 'sliced' chosen by hand (chunks_on_tpu False) and a top-k keep the
  slices on a TPU compile."""
  student, teacher = h.make_models(0)
  batch = h.to_jnp(h.make_batch(B=4, L=9))
  extras = {"teacher": teacher}
  monkeypatch.setattr(impl, "compile_platform", lambda: "tpu")
  for strategy, kwargs in ((STRATEGY, {"metrics": True, "chunks_on_tpu": True}),
                           (STRATEGY, {"metrics": False, "chunks_on_tpu": False}),
                           (LogitKD(temperature=2.0, top_k=8),
                            {"metrics": False, "chunks_on_tpu": True})):
    assert _run(strategy, student, extras, batch, **kwargs)[1] == ["sliced"], kwargs


def test_which_strategies_and_teachers_the_rule_covers(monkeypatch):
  kd = [(1.0, LogitKD(temperature=2.0))]
  assert tpu_chunks.may_take_chunks(kd, None, train=True)
  assert not tpu_chunks.may_take_chunks(kd, None, train=False)  # an eval's metrics
  assert not tpu_chunks.may_take_chunks(kd, object(), train=True)  # several teachers
  assert not tpu_chunks.may_take_chunks([(1.0, LogitKD(top_k=4))], None, train=True)
  assert not tpu_chunks.may_take_chunks([], None, train=True)
  student, teacher = h.make_models(0)
  inputs = types.SimpleNamespace(mask_BxL=np.ones((4, 2048)), student_model=student,
                                 teacher_model=teacher)
  monkeypatch.setattr(impl, "compile_platform", lambda: "tpu")
  assert tpu_chunks.chunk_tokens(inputs) is not None
  head = TeacherHead.__new__(TeacherHead)  # a hidden-state cache's head: no teacher forward
  assert tpu_chunks.chunk_tokens(types.SimpleNamespace(**{**vars(inputs), "teacher_model": head})
                                 ) is None
  monkeypatch.setattr(impl, "compile_platform", lambda: "cpu")
  assert tpu_chunks.chunk_tokens(inputs) is None


def test_the_chunk_the_chip_measured(monkeypatch):
  """At 4 x 2048 over V 151,936 on one chip: 640 MiB of fp32 logits is 276 positions a row, so
  the engine takes 8 chunks of 256 positions, the 1,024-token chunks of the chip's KD rows."""
  monkeypatch.setattr(impl, "compile_platform", lambda: "tpu")
  inputs = types.SimpleNamespace(
      mask_BxL=np.ones((4, 2048)), teacher_model=object(),
      student_model=types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=151936)))
  tokens = tpu_chunks.chunk_tokens(inputs)
  assert tokens == 4 * 276
  n = math.ceil(2048 / vocab_chunks.chunk_len(tokens, 4, 2048, 151936))
  assert (n, math.ceil(2048 / n)) == (8, 256)
