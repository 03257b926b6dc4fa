"""Tiny student and teacher, batches and float64 numpy references for the distillation tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from distillax.distill import DistillInputs
from distillax.models.config import TransformerConfig
from distillax.models.transformer import ModelOutput
from tests.support.models import NORMS_NEAR_ONE, random_model

VOCAB = 48
# A teacher twice as wide with twice the heads and one more layer than the student, as in practice.
TEACHER_CONFIG = TransformerConfig(vocab_size=VOCAB, embed_dim=32, num_layers=3, num_heads=4,
                                   num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=32)
STUDENT_CONFIG = TransformerConfig(vocab_size=VOCAB, embed_dim=16, num_layers=2, num_heads=2,
                                   num_kv_heads=1, head_dim=8, mlp_dim=32, max_seq_len=32)


def make_models(seed: int = 0, student_config=STUDENT_CONFIG, teacher_config=TEACHER_CONFIG):
  """(student, teacher) with norm scales near 1 and fan-in scaled matrices, seeds apart."""
  return (random_model(student_config, seed + 200, NORMS_NEAR_ONE),
          random_model(teacher_config, seed + 100, NORMS_NEAR_ONE))


def make_batch(B: int = 2, L: int = 9, seed: int = 0, vocab: int = VOCAB):
  """A packed batch: row 0 holds two documents, row 1 one document then padding."""
  rng = np.random.default_rng(seed)
  inputs = rng.integers(0, vocab, (B, L)).astype(np.int32)
  targets = rng.integers(0, vocab, (B, L)).astype(np.int32)
  segments = np.ones((B, L), np.int32)
  positions = np.tile(np.arange(L, dtype=np.int32), (B, 1))
  cut = L // 2
  segments[0, cut:] = 2
  positions[0, cut:] = np.arange(L - cut)
  segments[1, L - 3:] = 0  # padding
  positions[1, L - 3:] = 0
  mask = ((segments > 0) & (rng.random((B, L)) > 0.1)).astype(np.float32)
  return {"inputs_BxL": inputs, "targets_BxL": targets, "segment_ids_BxL": segments,
          "positions_BxL": positions, "loss_mask_BxL": mask}


def to_jnp(batch):
  return {k: jnp.asarray(v) for k, v in batch.items()}


def f64(x):
  return np.asarray(x, np.float64)


def np_log_softmax(x):
  x = f64(x)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_kl(p, q):
  """KL(p || q) over the last axis, with 0 log 0 = 0."""
  safe_p = np.where(p > 0, p, 1.0)
  return np.sum(np.where(p > 0, p * (np.log(safe_p) - np.log(np.where(p > 0, q, 1.0))), 0.0), -1)


def np_divergence(kind, p_teacher, q_student, beta=0.5):
  if kind == "forward_kl":
    return np_kl(p_teacher, q_student)
  if kind == "reverse_kl":
    return np_kl(q_student, p_teacher)
  m = beta * p_teacher + (1 - beta) * q_student
  return beta * np_kl(p_teacher, m) + (1 - beta) * np_kl(q_student, m)


def np_logit_kd(s_logits, t_logits, targets, *, temperature=2.0, alpha=0.7, divergence="forward_kl",
                beta=0.5, top_k=None):
  """Per-token (loss, divergence), float64, written from the definitions (flattened tokens)."""
  s_logits, t_logits = f64(s_logits), f64(t_logits)
  V = s_logits.shape[-1]
  p = np.exp(np_log_softmax(t_logits / temperature))
  q = np.exp(np_log_softmax(s_logits / temperature))
  if top_k is not None and top_k < V:
    idx = np.argsort(-t_logits, axis=-1, kind="stable")[:, :top_k]
    p_top = np.take_along_axis(p, idx, -1)
    q_top = np.take_along_axis(q, idx, -1)
    p = np.concatenate([p_top, 1 - p_top.sum(-1, keepdims=True)], -1)
    q = np.concatenate([q_top, 1 - q_top.sum(-1, keepdims=True)], -1)
  div = np_divergence(divergence, p, q, beta)
  ce = -np.take_along_axis(np_log_softmax(s_logits), targets[:, None].astype(int), -1)[:, 0]
  return alpha * temperature ** 2 * div + (1 - alpha) * ce, div


def np_metrics(s_logits, t_logits, targets, mask):
  """hard_ce, teacher_ce, top1_agreement, logit_cosine sums over tokens where mask > 0."""
  s, t, keep = f64(s_logits), f64(t_logits), np.asarray(mask) > 0
  nll = lambda x: -np.take_along_axis(np_log_softmax(x), targets[:, None].astype(int), -1)[:, 0]
  cos = (s * t).sum(-1) / np.sqrt((s * s).sum(-1) * (t * t).sum(-1))
  agree = (s.argmax(-1) == t.argmax(-1)).astype(np.float64)
  return {"hard_ce": nll(s)[keep].sum(), "teacher_ce": nll(t)[keep].sum(),
          "top1_agreement": agree[keep].sum(), "logit_cosine": cos[keep].sum()}


def np_attention_term(kind, s_probs, t_probs, layer_map, mask):
  """sum over mapped layers of mean over student heads of the per-row distance, masked sum."""
  s_probs, t_probs = f64(s_probs), f64(t_probs)
  total = 0.0
  hs, ht = s_probs.shape[2], t_probs.shape[2]
  g = ht // hs
  for s_layer, t_layer in layer_map.items():
    for h in range(hs):
      p = t_probs[t_layer][:, h * g:(h + 1) * g].mean(1)  # (B, L, S)
      q = s_probs[s_layer][:, h]
      row = np_kl(p, q) if kind == "kl" else ((q - p) ** 2).sum(-1)
      total += (row * (np.asarray(mask) > 0)).sum() / hs
  return total


def np_feature_term(kind, s_feats, t_feats, mask):
  """Per-token distance of equal-width features, masked sum."""
  s, t = f64(s_feats), f64(t_feats)
  if kind == "cosine":
    d = 1 - (s * t).sum(-1) / (np.linalg.norm(s, axis=-1) * np.linalg.norm(t, axis=-1))
  else:
    d = ((s - t) ** 2).mean(-1)
  return (d * (np.asarray(mask) > 0)).sum()


def np_pool(t_feats, width):
  t = f64(t_feats)
  out = np.zeros(t.shape[:-1] + (width,))
  g = t.shape[-1] // width
  for j in range(width):
    out[..., j] = t[..., j * g:(j + 1) * g].mean(-1)
  return out


# Strategy inputs without models (attention, features): random hidden states and causal attention.
B, L = 2, 6


def causal_probs(rng, layers, heads):
  logits = rng.normal(size=(layers, B, heads, L, L)) * 2
  causal = np.tril(np.ones((L, L), bool))
  logits = np.where(causal, logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  return (p / p.sum(-1, keepdims=True)).astype(np.float32)


def make_inputs(seed=0, s_heads=2, t_heads=4, s_layers=2, t_layers=3, ds=4, dt=8,
                projections=None):
  rng = np.random.default_rng(seed)
  mask = np.ones((B, L), np.float32)
  mask[1, -2:] = 0
  s_hidden = rng.normal(size=(s_layers + 1, B, L, ds)).astype(np.float32)
  t_hidden = rng.normal(size=(t_layers + 1, B, L, dt)).astype(np.float32)
  out = lambda hid, probs: ModelOutput(
      logits_BxLxV=jnp.zeros((B, L, 3)), final_hidden_BxLxD=jnp.asarray(hid[-1]),
      hidden_states=jnp.asarray(hid), attention_probs=jnp.asarray(probs))
  s_probs = causal_probs(rng, s_layers, s_heads)
  t_probs = causal_probs(rng, t_layers, t_heads)
  batch = {"inputs_BxL": jnp.zeros((B, L), jnp.int32), "targets_BxL": jnp.zeros((B, L), jnp.int32),
           "loss_mask_BxL": jnp.asarray(mask)}
  inputs = DistillInputs(batch=batch, student=out(s_hidden, s_probs),
                         teacher=out(t_hidden, t_probs), projections=projections)
  return inputs, dict(mask=mask, s_hidden=s_hidden, t_hidden=t_hidden, s_probs=s_probs,
                      t_probs=t_probs)
