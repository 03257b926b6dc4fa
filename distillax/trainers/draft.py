"""The draft recipe (`trainer='draft'`): an EAGLE-3 head trained against a frozen target.

A recipe over distillation's: the teacher section names the target (a run, a Hugging Face
checkpoint or a preset), which runs frozen inside the step as a distillation teacher does; the
trained module is the head (models/eagle3.py), not a Transformer, built from the target's shape
and the `draft` section; the objective is distill/draft.py's. The head's embedding and (by
default) its LM head are the target's, copied at the start and frozen; the draft vocabulary is
the `draft.vocab_size` tokens most frequent among the training data's targets (counted over
`draft.vocab_batches` batches of the train iterator, ids below the tokenizer's size only),
stored with the head in its checkpoints so eval and export read the map the head trained with.

The data is the job's data as it is, or with `draft.regenerate` the target's own answers: before
training the target continues the train prompts (the `sequence_kd` section says how many, how
long and how sampled), each sample a prompt and the target's answer, trained on the answer, as
EAGLE-3 and SpecForge regenerate theirs so the head learns the text it will verify. The file is
sequence-level KD's (trainers/teacher_samples.py: written once, reused on resume); the target
that writes it is the one the step then runs, loaded once.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax import partitioning as pt
from distillax.data import batch as batch_spec
from distillax.distill.draft import TEACHER, DraftSettings, make_draft_objective
from distillax.errors import ConfigError, UserError
from distillax.framework import flops
from distillax.framework.step import Objective
from distillax.models.eagle3 import Eagle3Config, Eagle3Head
from distillax.models.init import INIT_COMPILE_OPTIONS
from distillax.trainers import sources as src
from distillax.trainers.distill.recipe import DistillRecipe
from distillax.trainers.registry import register
from distillax.trainers.teacher_samples import TeacherSamples, check_sample_settings


def frequent_ids(batches, vocab: int, limit: int) -> np.ndarray:
  """The `vocab` ids below `limit` most frequent among the batches' kept targets (ties: the
  lower id), ascending."""
  counts = np.zeros((limit,), np.int64)
  for batch in batches:
    targets = np.asarray(batch[batch_spec.TARGETS]).reshape(-1)
    kept = np.asarray(batch[batch_spec.LOSS_MASK]).reshape(-1) > 0
    ids = targets[kept & (targets < limit)]
    counts += np.bincount(ids, minlength=limit)[:limit]
  order = np.lexsort((np.arange(limit), -counts))  # most frequent first, lower id on ties
  return np.sort(order[:vocab]).astype(np.int32)


def settings_from_config(c) -> DraftSettings:
  if int(c.ttt_steps) < 1:
    raise ConfigError(f"draft.ttt_steps={c.ttt_steps} must be >= 1 (the tokens the head learns "
                      f"to propose), e.g. --config.draft.ttt_steps=3")
  if not 0 < float(c.ttt_decay) <= 1:
    raise ConfigError(f"draft.ttt_decay={c.ttt_decay} must be in (0, 1]")
  return DraftSettings(ttt_steps=int(c.ttt_steps), decay=float(c.ttt_decay))


@register("draft")
class DraftRecipe(DistillRecipe):
  """An EAGLE-3 head (the student) against the frozen target (the teacher)."""

  student_path = None  # the head's frozen parts (embedding, LM head, vocabulary) are stored
  rollback_metrics = ("eval_loss", "eval_objective")
  router_losses = False
  sliced_loss = False
  vocab_from_checkpoint = False  # load_draft_run: the restored map replaces draft_ids()

  def __init__(self, config, **kwargs):
    if "draft" not in config:
      raise ConfigError("trainer='draft' needs the draft section; use "
                        "distillax/configs/draft_eagle3.py")
    student = config.get("student") or {}
    if config.train.get("init_from") or student.get("hf_path") or tuple(
        (student.get("from_teacher") or {}).get("layers", ())):
      raise ConfigError("trainer='draft' starts its head from the target (teacher section): "
                        "clear train.init_from, student.hf_path and student.from_teacher.layers "
                        "(a draft run resumes from its own workdir)")
    super().__init__(config, **kwargs)
    if self.transforms.qat is not None or self.transforms.lora is not None:
      raise ConfigError("trainer='draft' trains a full-precision head: clear qat.rules and "
                        "lora.module_regex")
    if self.teacher_model_config is None:
      raise ConfigError("trainer='draft' runs its target in the step: name teacher.workdir, "
                        "teacher.hf_path or teacher.preset, not teacher.cache_dir")
    c = config.draft
    self.settings = settings_from_config(c)
    tokens = int(self.tokenizer.vocab_size)
    vocab = int(c.vocab_size) or tokens
    if vocab > tokens:
      raise ConfigError(f"draft.vocab_size={vocab} is more than the tokenizer's {tokens} ids; "
                        f"use at most {tokens} (0 = all of them)")
    self.head_config = Eagle3Config.for_target(self.teacher_model_config, tuple(c.aux_layers),
                                               vocab, bool(c.train_lm_head))
    self.regenerated = None  # with draft.regenerate: the sample file the target writes first
    self._written_by = None  # the target that wrote it in this session, until the step takes it
    if bool(c.get("regenerate", False)):  # a run saved before the field: its data as it is
      if "sequence_kd" not in config:
        raise ConfigError("draft.regenerate=True reads the sequence_kd section (how many prompts "
                          "the target continues, and how): use distillax/configs/draft_eagle3.py")
      check_sample_settings(config.sequence_kd, self.teacher_model_config,
                            "draft.regenerate=True", who="target")
      self.regenerated = TeacherSamples(self, who="target", answers_only=True)
      self.regenerated.check_existing()
      self.data_splits = ("eval",)  # data's train split holds prompts: answers are the target's

  def objective(self, *, train: bool = False) -> Objective:
    del train
    return make_draft_objective(self.settings)

  def strategy(self):
    raise ConfigError("trainer='draft' has no distillation strategy: its objective is the "
                      "EAGLE-3 head's (distill/draft.py)")

  def sliced_strategy(self) -> bool:
    return False

  def trainable(self):
    return nnx.Param

  def train_iterator(self):
    if self.regenerated is None:
      return super().train_iterator()
    return self.regenerated.train_iterator(self._target_for_samples)

  def _target_for_samples(self):
    """The target, loaded to write the samples and kept for the step (`load_teacher`), so a
    regenerating run loads it once."""
    self._written_by = super().load_teacher()
    return self._written_by

  def load_teacher(self):
    """The frozen target: the one that wrote the samples in this session (handed over once),
    else loaded from its source."""
    target, self._written_by = self._written_by, None
    return target if target is not None else super().load_teacher()

  def draft_ids(self) -> np.ndarray:
    """The draft vocabulary's target ids (all tokenizer ids when it is not reduced). A head
    restored for eval or export reads its map from the checkpoint: the ids here are only its
    shape, so no train data is read (nor regenerated, were the sample file gone)."""
    cfg, tokens = self.head_config, int(self.tokenizer.vocab_size)
    if cfg.draft_vocab_size >= tokens or self.vocab_from_checkpoint:
      return np.arange(cfg.draft_vocab_size, dtype=np.int32)
    batches = itertools.islice(self.train_iterator(), int(self.config.draft.vocab_batches))
    return frequent_ids(batches, cfg.draft_vocab_size, tokens)

  def build(self, *, abstract: bool, quantize: bool = True):
    del quantize
    seed = int(self.config.seed)
    make = lambda: Eagle3Head(self.head_config, rngs=nnx.Rngs(seed + 2))
    if abstract:
      return nnx.eval_shape(make), {
          TEACHER: self.teacher_source.abstract(self.teacher_model_config, seed)}
    target = self.load_teacher()
    head = created_head(self.head_config, target, self.draft_ids(), self.mesh, self.rules, seed)
    return head, {TEACHER: target}

  def export_model(self, student):
    return student

  def step_flops(self) -> float:
    return draft_step_flops(self.head_config, self.teacher_model_config, self.batch_size,
                            self.seq_len, self.settings.ttt_steps)


def load_draft_run(workdir: str, field: str = "--workdir", *, mesh=None, rules=None):
  """(head, target, recipe) of a draft run's newest checkpoint: the head with the vocabulary
  map it trained with, the target from the run's teacher source; on `mesh`/`rules` (default:
  the run's own)."""
  from distillax.trainers.saved import restore_run_state
  from distillax.trainers.sources import load_run_config
  config = load_run_config(workdir, field)
  if str(config.get("trainer")) != "draft":
    raise UserError(f"{field} {workdir} is a trainer={config.get('trainer')!r} run, not an "
                    f"EAGLE-3 head (trainer='draft', distillax/configs/draft_eagle3.py)")
  recipe = DraftRecipe(config, workdir=workdir, mesh=mesh, rules=rules)
  recipe.vocab_from_checkpoint = True
  engine = recipe.build_engines(compile_now=False).main
  state = restore_run_state(workdir, recipe, engine)
  head, extras = engine.layout.defs.merge(state.params, state.frozen)
  return head, extras[TEACHER], recipe


def created_head(config: Eagle3Config, target, d2t_ids, mesh, rules, seed: int) -> Eagle3Head:
  """A fresh head started from `target` (init_from_target), created already sharded on `mesh`
  by one compiled program (an eager build dispatches every op on every device)."""
  make = lambda: Eagle3Head(config, rngs=nnx.Rngs(seed + 2))
  graph, abstract = nnx.split(nnx.eval_shape(make))
  shardings = pt.tree_shardings(nnx.to_pure_dict(abstract), pt.logical_tree(abstract), mesh,
                                rules)
  t_graph, t_state = nnx.split(target)

  @functools.partial(jax.jit, out_shardings=shardings,
                     compiler_options=INIT_COMPILE_OPTIONS)
  def values(t_state, d2t):
    head = init_from_target(make(), nnx.merge(t_graph, t_state), d2t)
    return nnx.to_pure_dict(nnx.state(head))

  with jax.set_mesh(mesh):
    nnx.replace_by_pure_dict(abstract, values(t_state, jnp.asarray(d2t_ids, jnp.int32)))
  return nnx.merge(graph, abstract)


def init_from_target(head: Eagle3Head, target, d2t_ids) -> Eagle3Head:
  """`head` with the target's embedding, its output layer's columns of the draft ids as the LM
  head, its final norm's scale as the head's, and the draft vocabulary's map."""
  d2t = jnp.asarray(d2t_ids, jnp.int32)
  head.embedding[...] = target.embedder.embedding[...].astype(head.embedding[...].dtype)
  w_DxV = jnp.take(target.output_weight_DxV(), d2t, axis=1)
  head.lm_head[...] = w_DxV.astype(head.lm_head[...].dtype)
  head.final_norm.scale[...] = target.final_norm.scale[...].astype(head.final_norm.scale.dtype)
  head.d2t[...] = d2t
  return head


def head_params(config: Eagle3Config) -> dict[str, int]:
  """Parameters of the head: trained (fc, the layer, norms; the LM head when trained), served
  (all of it but the embedding, which is the target's table) and matmul (what its FLOPs
  multiply: fc, q/k/v/o, the MLP, the LM head)."""
  c = config.layer
  D, H, G, K, F = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim
  A = len(config.aux_layers)
  matmul = A * D * D + 2 * D * (H + 2 * G) * K + H * K * D + 3 * D * F
  norms = 4 * D + (2 * K if c.qk_norm else 0)
  lm_head = D * config.draft_vocab_size
  return {"trained": matmul + norms + (lm_head if config.train_lm_head else 0),
          "served": matmul + norms + lm_head, "matmul": matmul + lm_head}


def head_flops_per_token(config: Eagle3Config, context: int) -> float:
  """Forward FLOPs of one head pass (one proposed token) attending to `context` positions:
  2 per multiply-add of its matmuls (fc, the layer, the LM head over the draft vocabulary) and
  of the attention's scores and weighted sums. fc is counted in every pass, an upper bound at
  inference (where it runs once per verified position, not per proposal)."""
  c = config.layer
  return 2.0 * head_params(config)["matmul"] + 4.0 * c.num_heads * c.head_dim * context


def draft_step_flops(config: Eagle3Config, target, batch: int, seq_len: int,
                     steps: int) -> float:
  """Model FLOPs of one draft step: the target's forward (its output layer at the draft ids
  only, once per TTT step); the head's fc once per position, forward and weight gradient (its
  input, the target's layers, takes no gradient); and at each TTT step the rest of the head's
  forward and backward (3x), attention over half the context on average (causal)."""
  tokens = batch * seq_len
  fc = 2.0 * len(config.aux_layers) * config.layer.embed_dim ** 2
  per_step = head_flops_per_token(config, seq_len // 2 + steps) - fc
  head = 2.0 * fc + 3.0 * steps * per_step
  body = flops.forward_flops_breakdown(target, batch, seq_len)
  teacher = body["total"] - body["logits"] + steps * 2.0 * tokens * target.embed_dim * (
      config.draft_vocab_size)
  return teacher + tokens * head


__all__ = ["DraftRecipe", "draft_step_flops", "frequent_ids", "head_flops_per_token",
           "head_params", "init_from_target", "load_draft_run"]
