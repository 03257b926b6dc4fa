"""Distillation helps where it should.

Efficacy: a random first-order Markov chain over a small vocabulary. The teacher is a Transformer
built to represent the chain exactly (one-hot embeddings, blocks that add nothing, lm_head =
log P / sqrt(D)); the student sees only a few sampled sequences. With the same batches, steps and
initial weights, the student trained with LogitKD generalises to fresh sequences much better than
the same student trained on the samples alone (which overfits them).
"""


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax.distill import LogitKD, make_distill_objective
from distillax.framework import optim
from distillax.framework.evaluation import evaluate
from distillax.models.config import TransformerConfig
from distillax.models.init import abstract_model, create_model
from distillax.models.transformer import Transformer
from distillax.trainers import lm_objective
from tests.support.engines import mesh_and_rules, tiny_engine

V, L, B = 32, 32, 8  # vocabulary, sequence length, batch
TRAIN_SEQUENCES, VAL_SEQUENCES, STEPS, EVAL_EVERY = 16, 64, 60, 10


def markov_chain(seed=0):
  """Rows of P are next-token distributions: Dirichlet(0.3), so a few tokens dominate each."""
  return np.random.default_rng(seed).dirichlet(np.full(V, 0.3), size=V)


def sample_sequences(P, count, seed):
  rng = np.random.default_rng(seed)
  x = np.zeros((count, L + 1), np.int64)
  x[:, 0] = rng.integers(0, V, count)
  cdf = np.cumsum(P, axis=1)
  for t in range(L):
    x[:, t + 1] = np.minimum((rng.random(count)[:, None] > cdf[x[:, t]]).sum(1), V - 1)
  return x


def as_batch(seqs):
  n = len(seqs)
  return {"inputs_BxL": seqs[:, :-1].astype(np.int32), "targets_BxL": seqs[:, 1:].astype(np.int32),
          "segment_ids_BxL": np.ones((n, L), np.int32),
          "positions_BxL": np.tile(np.arange(L, dtype=np.int32), (n, 1)),
          "loss_mask_BxL": np.ones((n, L), np.float32)}


def chain_teacher(P) -> Transformer:
  """A one-layer Transformer whose next-token distribution is exactly row P[current token]."""
  cfg = TransformerConfig(vocab_size=V, embed_dim=V, num_layers=1, num_heads=2, num_kv_heads=1,
                          head_dim=8, mlp_dim=16, max_seq_len=64)
  graph, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))

  def value(path, x):
    name = jax.tree_util.keystr(path)
    if name.endswith("['scale']"):
      return np.ones(x.shape, np.float32)  # RMS norms: e_x -> sqrt(D) e_x
    if "embedding" in name:
      return np.eye(V, dtype=np.float32)
    if "lm_head" in name:
      return (np.log(P) / np.sqrt(V)).astype(np.float32)
    return np.zeros(x.shape, np.float32)  # attention and MLP add nothing to the residual

  values = jax.tree_util.tree_map_with_path(value, nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, values))
  return nnx.merge(graph, state)


def train_curve(objective, extras, train_seqs, val_batches):
  """Eval hard-label CE every EVAL_EVERY steps of the real compiled step, on one device."""
  student_cfg = TransformerConfig(vocab_size=V, embed_dim=32, num_layers=1, num_heads=2,
                                  num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=64)
  mesh, rules = mesh_and_rules("dp", 1, devices=jax.devices()[:1])
  opt = optim.default_optimizer_config()
  opt.learning_rate, opt.warmup_steps = 3e-3, 5
  engine = tiny_engine(abstract_model(student_cfg), as_batch(train_seqs[:B]), mesh, rules,
                       steps=STEPS, objective=objective, extras=extras, opt=opt)
  state = engine.init_state(create_model(student_cfg, mesh=mesh, rules=rules, seed=3), extras, 0)
  curve = []
  for step in range(STEPS):
    start = (step * B) % len(train_seqs)  # the same batches, in the same order, for both runs
    batch = engine.runner.place_batch(as_batch(train_seqs[start:start + B]))
    state, _ = engine.runner(state, batch)
    if (step + 1) % EVAL_EVERY == 0:
      result = evaluate(engine, state, val_batches)
      curve.append(result["eval_loss"])  # next-token CE, whatever the objective
  return curve


def test_logit_kd_beats_training_from_scratch_on_the_same_tokens():
  P = markov_chain()
  train_seqs = sample_sequences(P, TRAIN_SEQUENCES, seed=1)
  val_seqs = sample_sequences(P, VAL_SEQUENCES, seed=2)
  val_batches = [as_batch(val_seqs[i:i + B]) for i in range(0, VAL_SEQUENCES, B)]
  teacher = chain_teacher(P)
  # The teacher knows the chain: its log-probabilities are log P of the current token's row.
  inputs = val_batches[0]["inputs_BxL"]
  teacher_logp = jax.nn.log_softmax(teacher(jnp.asarray(inputs)).logits_BxLxV)
  np.testing.assert_allclose(np.asarray(teacher_logp), np.log(P)[inputs], atol=2e-3)
  true_ce = -np.mean(np.log(P[val_seqs[:, :-1], val_seqs[:, 1:]]))  # the floor on this data

  scratch = train_curve(lm_objective, {}, train_seqs, val_batches)
  distilled = train_curve(make_distill_objective(LogitKD()), {"teacher": teacher}, train_seqs,
                          val_batches)
  # Better than scratch at its best point, by a wide margin, and not better than the truth.
  assert distilled[-1] < min(scratch) - 0.2, (distilled, scratch, true_ce)
  assert distilled[-1] > true_ce - 0.1, (distilled, true_ce)
  assert all(d < s for d, s in zip(distilled, scratch)), (distilled, scratch)
