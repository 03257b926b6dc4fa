"""Per-token log-probabilities of many token rows of different lengths, compiled a handful of times.

Evaluation harnesses ask for thousands of (context, continuation) scores of every length. Each
row is right-padded to the next power of two (at least `min_len`, at most the model's
max_seq_len) and rows are scored `batch_size` at a time (the last batch filled with dummy rows),
so the forward compiles once per length bucket, not once per request. Right padding leaves the
real positions unchanged (causal attention never looks right).

The output projection runs over chunks of `chunk_len` positions inside the jit (a `lax.map`),
so no [batch, length, vocab] fp32 array of a large vocabulary is held whole. Log-probabilities
are over the tokenizer's ids (`vocab_limit`): a vocabulary padded past them has rows no text
names, which training's losses and every export leave out, so a run and its export score alike.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from distillax.errors import UserError
from distillax.models.sampler import mask_padded_ids


def length_bucket(length: int, min_len: int, max_len: int) -> int:
  """The padded length of a row of `length` tokens: the next power of two, within bounds."""
  bucket = max(min_len, 1 << max(0, (length - 1).bit_length()))
  return min(bucket, max_len)


def _scores(graphdef, state, inputs_BxL, targets_BxL, chunk_len: int,
            vocab_limit: int | None = None):
  """(logprob_BxL, is_argmax_BxL) of each target given the inputs up to its position."""
  model = nnx.merge(graphdef, state)
  hidden_BxLxD = model(inputs_BxL, return_logits=False).final_hidden_BxLxD
  B, L, D = hidden_BxLxD.shape
  n = L // chunk_len
  h_NxBxCxD = hidden_BxLxD.reshape(B, n, chunk_len, D).transpose(1, 0, 2, 3)
  t_NxBxC = targets_BxL.reshape(B, n, chunk_len).transpose(1, 0, 2)

  def chunk(args):
    h_BxCxD, t_BxC = args
    logits_BxCxV = mask_padded_ids(model.logits_from_hidden(h_BxCxD).astype(jnp.float32),
                                   vocab_limit)
    target_BxC = jnp.take_along_axis(logits_BxCxV, t_BxC[..., None], -1)[..., 0]
    logprob_BxC = target_BxC - jax.nn.logsumexp(logits_BxCxV, axis=-1)
    return logprob_BxC, jnp.argmax(logits_BxCxV, axis=-1) == t_BxC

  logprob_NxBxC, argmax_NxBxC = jax.lax.map(chunk, (h_NxBxCxD, t_NxBxC))
  back = lambda x: x.transpose(1, 0, 2).reshape(B, L)
  return back(logprob_NxBxC), back(argmax_NxBxC)


# One jit for every scorer: two scorers of the same model structure share its compilations.
_compiled_scores = jax.jit(_scores, static_argnums=(0, 4, 5))


class TokenScorer:
  """Scores token rows with one model: row r's result holds, for t = 1 .. len(r) - 1, the
  log-probability of r[t] after r[:t], and whether r[t] was the model's top choice there."""

  def __init__(self, model, *, batch_size: int = 8, min_len: int = 32, chunk_len: int = 128,
               mesh: Mesh | None = None, vocab_limit: int | None = None):
    if batch_size < 1:
      raise UserError(f"batch_size={batch_size} must be at least 1")
    self.graphdef, self.state = nnx.split(model)
    # Rows split over the mesh's data axis when they divide evenly (data parallel over the
    # weights' own placement), else every device sees the whole batch.
    self.sharding = None
    if mesh is not None:
      rows = "data" if batch_size % mesh.shape.get("data", 1) == 0 else None
      self.sharding = NamedSharding(mesh, P(rows, None))
    self.max_len = int(model.config.max_seq_len)
    self.batch_size, self.min_len, self.chunk_len = batch_size, min_len, chunk_len
    # The tokenizer's ids: a padded vocabulary's rows past them leave the softmax (None: all).
    self.vocab_limit = None if vocab_limit is None else int(vocab_limit)
    self.compiled_shapes: set[tuple[int, int]] = set()

  def __call__(self, rows: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each row scored once however often it is asked (lm-eval repeats requests: the same
    context and choice under several metrics or repeats, as its HF backend also merges)."""
    unique: dict[tuple[int, ...], int] = {}
    index = [unique.setdefault(tuple(int(t) for t in r), len(unique)) for r in rows]
    scored = self._score_rows([list(r) for r in unique])
    return [scored[i] for i in index]

  def _score_rows(self, rows: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    for r in rows:
      if not 2 <= len(r) <= self.max_len + 1:
        raise UserError(f"a scored row has {len(r)} tokens; it needs 2 to max_seq_len + 1 = "
                        f"{self.max_len + 1} (truncate the context)")
    buckets = [length_bucket(len(r) - 1, self.min_len, self.max_len) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: buckets[i])
    out: list = [None] * len(rows)
    # Every batch is dispatched before any result is fetched: the host pads the next batch
    # while the device scores this one.
    pending = []
    for start in range(0, len(order), self.batch_size):
      picked = order[start:start + self.batch_size]
      L = max(buckets[i] for i in picked)
      inputs_BxL = np.zeros((self.batch_size, L), np.int32)
      targets_BxL = np.zeros((self.batch_size, L), np.int32)
      for b, i in enumerate(picked):
        n = len(rows[i]) - 1
        inputs_BxL[b, :n], targets_BxL[b, :n] = rows[i][:-1], rows[i][1:]
      self.compiled_shapes.add((self.batch_size, L))
      inputs_BxL, targets_BxL = (jax.device_put(x, self.sharding) if self.sharding is not None
                                 else jnp.asarray(x) for x in (inputs_BxL, targets_BxL))
      pending.append((picked, _compiled_scores(self.graphdef, self.state, inputs_BxL,
                                               targets_BxL, math.gcd(self.chunk_len, L),
                                               self.vocab_limit)))
    for picked, scores in pending:
      logprob_BxL, argmax_BxL = jax.device_get(scores)
      for b, i in enumerate(picked):
        n = len(rows[i]) - 1
        out[i] = (np.asarray(logprob_BxL[b, :n], np.float64), np.asarray(argmax_BxL[b, :n]))
    return out
