"""The draft kind of benchmarks/lib/lever_grid.py: the EAGLE-3 head's train step (the objective
of distill/draft.py, as `trainer='draft'` runs it) against a pair's teacher as the frozen target.

A variant `draft:none:BATCH[:ttt=3][:draft_vocab=32000]`: the head over the teacher's shape
(target layers as configs/draft_eagle3.py picks them), its embedding and LM head copied from the
teacher (frozen), `ttt` steps of training-time test, a draft vocabulary of the teacher's first
`draft_vocab` ids (the benchmark's batches are random ids: which ids are kept does not change
the work). The tiny pair keeps at most 64 draft ids. Model FLOPs: trainers/draft.py's
draft_step_flops (the target's forward with its output layer at the draft ids once per TTT
step, the head's forward and backward at every step).
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from distillax.distill.draft import DraftSettings, make_draft_objective
from distillax.models.eagle3 import Eagle3Config, Eagle3Head
from distillax.trainers.draft import draft_step_flops, init_from_target

KIND = "draft"
TINY_VOCAB = 64  # draft ids of the tiny pair


def settings(v) -> DraftSettings:
  return DraftSettings(ttt_steps=int(v.option("ttt", 3)))


def head_config(v, teacher_cfg, tiny: bool) -> Eagle3Config:
  vocab = int(v.option("draft_vocab", 32000))
  vocab = min(vocab, TINY_VOCAB if tiny else teacher_cfg.vocab_size)
  return Eagle3Config.for_target(teacher_cfg, (), vocab)


def objective(v):
  return make_draft_objective(settings(v))


def abstract_head(config: Eagle3Config):
  return nnx.eval_shape(lambda: Eagle3Head(config, rngs=nnx.Rngs(0)))


def make_head(config: Eagle3Config, teacher):
  """The head as the recipe starts it: random layer, the teacher's embedding and columns."""
  head = Eagle3Head(config, rngs=nnx.Rngs(0))
  return init_from_target(head, teacher, np.arange(config.draft_vocab_size, dtype=np.int32))


def step_flops(v, config: Eagle3Config, teacher_cfg) -> float:
  return draft_step_flops(config, teacher_cfg, v.batch, v.seq_len, settings(v).ttt_steps)
