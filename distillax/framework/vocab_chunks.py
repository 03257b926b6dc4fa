"""The vocabulary-chunk engine: any token loss (next-token CE, every distillation term) over the
output layer's logits, a chunk of positions at a time, so no (tokens, V) fp32 array is held
whole.

Where it still runs. The vocabulary-slice engine (vocab_slices.py) is faster on a TPU v5e at
its default chunks at every shape measured (train, KD, LoRA, QLoRA) and serves, under
train.loss_impl='auto', every
job whose losses need only per-token normalisers and sums over the vocabulary: next-token CE,
one LogitKD (live teacher, hidden-state cache head, top-k cache of any K, one of every id read
as a table of the teacher's logits, or several teachers mixed or routed), several LogitKDs
over the whole vocabulary in one pass (a Composite, each its own temperature, divergence and
alpha: slice_terms.py), on-policy GeneralizedJSD and SampledTokenKL, with their eval
objectives' metrics. This engine keeps what a slice cannot see, and one combination not moved:
  - cross-tokenizer distillation (distill/cross_tokenizer/chunked.py): ULD sorts each span
    group's whole distribution over the vocabulary (the k-th largest of one model against the
    k-th largest of the other), which no per-token carry over slices gives: a capability reason;
  - several logit terms of which one reads the teacher's top-k or a top-k cache (each would
    take its own bucket pass): refused by 'sliced' in one line (logit_kd.sliced_leaves), run
    here under 'auto';
  - train.loss_impl='chunked', chosen by hand;
  - for speed: the train step's LogitKDs of a teacher run in the step, compiled for a TPU, at
    ~1,024-token chunks (distill/tpu_chunks.TPU_CHUNK_BUDGET_BYTES): forming the gradient in
    the forward pass makes each model's logits once, where the slices make the teacher's again
    in the backward, and at that size the weight gradient's traffic per chunk costs less than
    that (v5e: 607.3 against 616.1 ms, the int8 teacher's 540.8 against 563.3; at the default
    budget below 702.0).

A token function `values_fn(student_logits_NxV, teacher_logits_NxV | None, tokens) -> {name:
(N,)}` sees the N flattened positions of one chunk; `tokens` holds every per-token entry the
caller passed (targets, loss mask, cached teacher top-k, ...), flattened the same way. The
engine returns `(loss, sums)`: the sums of each value over the real positions (mask > 0), and
`loss = sum(weights[k] * sums[k])`, the only differentiable output (the sums are metrics).

Chunks. Chunk j of n takes positions j, j + n, j + 2n, ... of every row, shape (B, C): an array
sharded along the batch or the length (sequence parallelism) stays sharded inside every chunk.
AUTO sizes C per device from the active partitioning rules: the most positions whose fp32 logits
of one model, (rows, C, vocab) on one device, fit CHUNK_BUDGET_BYTES; a data-parallel device
thus fills its whole budget, not 1/dp of it. An explicit `chunk_size` is a number of tokens
(positions x rows) per chunk.

Gradient. One custom VJP: each chunk's gradient of the weighted loss with respect to the
student's hidden states and to the output-layer parameters is formed inside the forward scan
while the chunk's logits are at hand; the backward pass only scales them by the loss's cotangent.
Neither model's logits are computed twice, and only the parameters the output layer reads (found
from its jaxpr) and the caller differentiates carry a gradient accumulator, not the whole model
nor a frozen base.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax import custom_derivatives

from distillax import partitioning as pt
from distillax.errors import ConfigError
from distillax.framework import token_loss_impl, token_rows

AUTO = -1  # chunk_size: sized per device from the vocabulary, the batch and the rules
CHUNK_BUDGET_BYTES = 128 * 2**20  # fp32 logits of one model for one chunk, on one device

ValuesFn = Callable[[jax.Array, jax.Array | None, Mapping[str, jax.Array]],
                    dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class OutputLayer:
  """A model's last step to logits: `logits_fn(params, hidden_BxCxD) -> (B, C, V)`."""

  logits_fn: Callable[[Any, jax.Array], jax.Array]
  params: Any

  @classmethod
  def of_model(cls, model: nnx.Module) -> "OutputLayer":
    """Through the model's own `logits_from_hidden` (plain, fake-quantized or adapted)."""
    graphdef, state = nnx.split(model)
    return cls(lambda state, h: nnx.merge(graphdef, state).logits_from_hidden(h), state)

  def over_token_rows(self, rows: int | None) -> "OutputLayer":
    """This layer with the columns at or past `rows` (a padded vocabulary's) masked in every
    chunk's logits (framework/token_rows.py): they leave every softmax, with no gradient."""
    return OutputLayer(token_rows.masked_logits_fn(self.logits_fn, rows), self.params)


# ---- chunk sizes --------------------------------------------------------------------------------

def check_chunk_size(chunk_size) -> None:
  """None (unchunked), AUTO, or a positive number of tokens."""
  if chunk_size is None:
    return
  if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or (
      chunk_size <= 0 and chunk_size != AUTO):
    raise ConfigError(f"distill chunk_size={chunk_size!r} must be a positive number of tokens, "
                      f"{AUTO} (auto: from the vocabulary, the batch and the rules) or None "
                      f"(unchunked)")


def chunk_size_from_config(value) -> int | None:
  """`distill.chunk_size` as the objectives take it: 0 = unchunked (None), -1 = AUTO, n > 0."""
  value = int(value)
  if value == 0:
    return None
  check_chunk_size(value)
  return value


def per_device_shape(batch: int, length: int, vocab: int) -> tuple[int, int, int]:
  """(rows, length, vocab) of one device's share of (batch, length, vocab) logits under the
  active rules (the whole shape when no rules are active)."""
  active = pt.active_rules()
  if active is None:
    return batch, length, vocab
  spec = active.rules.resolve(("batch", "length", "vocab"), (batch, length, vocab), active.mesh,
                              "vocabulary-chunk logits")
  size = lambda axes: math.prod(active.mesh.shape[a] for a in pt.axes_tuple(axes))
  return batch // size(spec[0]), length // size(spec[1]), vocab // size(spec[2])


def auto_chunk_len(batch: int, length: int, vocab: int,
                   budget_bytes: int = CHUNK_BUDGET_BYTES) -> int:
  """Positions per chunk whose (rows, C, vocab) fp32 logits fit `budget_bytes` on one device."""
  rows, local_len, cols = per_device_shape(batch, length, vocab)
  length_shards = max(1, length // max(1, local_len))
  return max(1, min(length, budget_bytes * length_shards // (4 * rows * cols)))


def chunk_len(chunk_size: int, batch: int, length: int, vocab: int) -> int:
  """Positions per row in one chunk: AUTO by the per-device budget, else `chunk_size` tokens."""
  check_chunk_size(chunk_size)
  if chunk_size == AUTO:
    return auto_chunk_len(batch, length, vocab)
  return max(1, min(length, int(chunk_size) // batch))


# ---- the engine ---------------------------------------------------------------------------------

def masked_sums(values: Mapping[str, jax.Array], mask_N: jax.Array) -> dict[str, jax.Array]:
  """Each value summed in fp32 over the positions whose mask is > 0."""
  keep = mask_N > 0
  return {k: jnp.sum(jnp.where(keep, v.astype(jnp.float32), 0.0)) for k, v in values.items()}


def weighted_loss(sums: Mapping[str, jax.Array], weights: Mapping[str, float]) -> jax.Array:
  return sum((w * sums[k] for k, w in weights.items()), jnp.zeros((), jnp.float32))


def _flat(x_BxC):
  return x_BxC.reshape((x_BxC.shape[0] * x_BxC.shape[1],) + x_BxC.shape[2:])


def whole_sums(values_fn: ValuesFn, weights: Mapping[str, float], tokens, mask_BxL,
               student_logits_BxLxV, teacher_logits_BxLxV=None):
  """The unchunked path over logits a forward pass returned: the same (loss, sums) contract,
  differentiable through the logits."""
  t = None if teacher_logits_BxLxV is None else jax.lax.stop_gradient(
      _flat(teacher_logits_BxLxV))
  values = values_fn(_flat(student_logits_BxLxV), t, {k: _flat(v) for k, v in tokens.items()})
  sums = masked_sums(values, _flat(mask_BxL))
  token_loss_impl.record("unchunked (whole logits)")
  return weighted_loss(sums, weights), jax.tree.map(jax.lax.stop_gradient, sums)


def _to_chunks(x_BxL, n: int):
  """(B, L, ...) -> (n, B, C, ...), chunk j = positions j, j + n, ...; L padded to n * C (the
  padded positions carry mask 0)."""
  B, L = x_BxL.shape[:2]
  C = math.ceil(L / n)
  x = jnp.pad(x_BxL, [(0, 0), (0, n * C - L)] + [(0, 0)] * (x_BxL.ndim - 2))
  return jnp.moveaxis(x.reshape(B, C, n, *x.shape[2:]), 2, 0)


def _used_leaves(logits_fn, params, h_BxCxD) -> list[bool]:
  """Which leaves of `params` the output layer reads (the rest get no gradient accumulator)."""
  leaves, treedef = jax.tree.flatten(params)
  fn = lambda leaves, h: logits_fn(jax.tree.unflatten(treedef, leaves), h)
  closed = jax.make_jaxpr(fn)(leaves, h_BxCxD)
  used = {v for eqn in closed.jaxpr.eqns for v in eqn.invars if not hasattr(v, "val")}
  used |= {v for v in closed.jaxpr.outvars if not hasattr(v, "val")}
  return [v in used for v in closed.jaxpr.invars[:len(leaves)]]


def _split(params, h_BxCxD, logits_fn):
  """(differentiable leaves the output layer reads, the rest, join)."""
  leaves, treedef = jax.tree.flatten(params)
  used = _used_leaves(logits_fn, params, h_BxCxD)
  is_diff = [u and jnp.issubdtype(x.dtype, jnp.inexact) for x, u in zip(leaves, used)]
  diff = [x for x, d in zip(leaves, is_diff) if d]
  rest = [x for x, d in zip(leaves, is_diff) if not d]

  def join(diff, rest):
    diff, rest = iter(diff), iter(rest)
    return jax.tree.unflatten(treedef, [next(diff) if d else next(rest) for d in is_diff])

  return diff, rest, join


def vocab_chunk_sums(values_fn: ValuesFn, weights: Mapping[str, float],
                     tokens: Mapping[str, jax.Array], mask_BxL: jax.Array,
                     student: OutputLayer, student_hidden_BxLxD: jax.Array,
                     teacher: OutputLayer | None = None, teacher_hidden_BxLxD=None, *,
                     chunk_size: int = AUTO) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(loss, sums) of `values_fn` over the logits of `student` (and `teacher`), chunk by chunk.

  tokens: per-token entries shaped (B, L, ...); mask_BxL: which positions count (> 0)."""
  B, L = mask_BxL.shape
  vocab = jax.eval_shape(student.logits_fn, student.params,
                         student_hidden_BxLxD[:, :1]).shape[-1]
  n = math.ceil(L / chunk_len(chunk_size, B, L, vocab))
  token_loss_impl.record(f"chunked (vocabulary-chunk engine, {n} chunk(s) of {math.ceil(L / n)} "
                         f"positions x {B} rows)")
  chunks = {"tokens": {k: _to_chunks(v, n) for k, v in tokens.items()},
            "mask": _to_chunks(mask_BxL, n)}
  if teacher is not None:
    chunks["teacher_h"] = jax.lax.stop_gradient(_to_chunks(teacher_hidden_BxLxD, n))
  t_params = None if teacher is None else jax.lax.stop_gradient(teacher.params)
  h_chunks = _to_chunks(student_hidden_BxLxD, n)
  diff, rest, join = _split(student.params, h_chunks[0], student.logits_fn)

  # The output layers see each chunk as (B*C, D) rows: XLA:CPU runs the 2-D matmul 1.2x faster
  # than the batched (B, C, D) one (benchmarks/vocab_chunks.py); the merged axis keeps the
  # batch's sharding in its major part.
  def chunk_value(diff, h_BxCxD, rest, t_params, chunk):
    s_NxV = student.logits_fn(join(diff, rest), _flat(h_BxCxD))
    t_NxV = None
    if teacher is not None:
      t_NxV = jax.lax.stop_gradient(teacher.logits_fn(t_params, _flat(chunk["teacher_h"])))
    values = values_fn(s_NxV, t_NxV, {k: _flat(v) for k, v in chunk["tokens"].items()})
    sums = masked_sums(values, _flat(chunk["mask"]))
    return weighted_loss(sums, weights), sums

  if not weights:  # metrics only: nothing to differentiate
    return jnp.zeros((), jnp.float32), _scan(chunk_value, False, diff, h_chunks, rest, t_params,
                                             chunks)[0]
  loss, sums = _fused(chunk_value, weights, diff, h_chunks, rest, t_params, chunks)
  return loss, jax.tree.map(jax.lax.stop_gradient, sums)


def _fused(chunk_value, weights, diff, h_chunks, rest, t_params, chunks):
  """(loss, sums) with a VJP formed chunk by chunk in the forward pass, for the leaves the
  caller differentiates only: a frozen output layer (a LoRA or QLoRA base, a tied embedding
  that does not train) reads its weights but carries no gradient accumulator and costs no
  weight-sized matmul per chunk."""
  diff_dtypes, h_dtype = [p.dtype for p in diff], h_chunks.dtype

  @jax.custom_vjp
  def fused(diff, h_chunks, rest, t_params, chunks):
    sums = _scan(chunk_value, False, diff, h_chunks, rest, t_params, chunks)[0]
    return weighted_loss(sums, weights), sums

  def fwd(diff, h_chunks, rest, t_params, chunks):
    perturbed = tuple(p.perturbed for p in diff)
    diff, h_chunks, rest, t_params, chunks = custom_derivatives.custom_vjp_primal_tree_values(
        (diff, h_chunks, rest, t_params, chunks))
    trained = [x for x, p in zip(diff, perturbed) if p]
    frozen = [x for x, p in zip(diff, perturbed) if not p]

    def trained_value(trained, h_BxCxD, rest_and_frozen, t_params, chunk):
      rest, frozen = rest_and_frozen
      return chunk_value(_interleave(perturbed, trained, frozen), h_BxCxD, rest, t_params, chunk)

    sums, grads = _scan(trained_value, True, trained, h_chunks, (rest, frozen), t_params, chunks)
    return (weighted_loss(sums, weights), sums), (perturbed, grads)

  def bwd(res, cotangents):
    perturbed, (g_trained, g_h) = res
    ct = cotangents[0]  # the sums are metrics: no cotangent
    if isinstance(ct, custom_derivatives.SymbolicZero):
      ct = jnp.zeros(ct.shape, ct.dtype)
    g_trained = iter(g_trained)
    g_diff = [(ct * next(g_trained)).astype(dt) if p else None
              for p, dt in zip(perturbed, diff_dtypes)]
    return g_diff, (ct * g_h).astype(h_dtype), None, None, None

  fused.defvjp(fwd, bwd, symbolic_zeros=True)
  return fused(diff, h_chunks, rest, t_params, chunks)


def _interleave(perturbed, trained, frozen):
  """The output layer's differentiable leaves in their order, from the two lists."""
  trained, frozen = iter(trained), iter(frozen)
  return [next(trained) if p else next(frozen) for p in perturbed]


def _scan(chunk_value, with_grad: bool, diff, h_chunks, rest, t_params, chunks):
  """(sums, None) or (sums, (fp32 gradient w.r.t. diff, stacked gradient w.r.t. each chunk's
  hidden states)): one `chunk_value` per chunk, in a `lax.scan`."""
  first = jax.tree.map(lambda x: x[0], (h_chunks, chunks))
  sums0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
      lambda h, c: chunk_value(diff, h, rest, t_params, c)[1], *first))
  if not with_grad:
    def body(total, xs):
      sums = chunk_value(diff, xs[0], rest, t_params, xs[1])[1]
      return jax.tree.map(jnp.add, total, sums), None
    return jax.lax.scan(body, sums0, (h_chunks, chunks))[0], None

  grad = jax.value_and_grad(chunk_value, argnums=(0, 1), has_aux=True)

  def grad_body(carry, xs):
    total, g_total = carry
    (_, sums), (g_diff, g_h) = grad(diff, xs[0], rest, t_params, xs[1])
    g_total = [a + g.astype(jnp.float32) for a, g in zip(g_total, g_diff)]
    return (jax.tree.map(jnp.add, total, sums), g_total), g_h

  g0 = [jnp.zeros(p.shape, jnp.float32) for p in diff]
  (sums, g_diff), g_h = jax.lax.scan(grad_body, (sums0, g0), (h_chunks, chunks))
  return sums, (g_diff, g_h)
