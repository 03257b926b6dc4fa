"""ULD on span groups only (distill.cross_tokenizer.span_groups): the same values and gradients
as sorting every group and masking (the formulation it replaced), both against NumPy, and the
work skipped where rows have no span group left."""

import jax
import jax.numpy as jnp
import numpy as np

from distillax.data.cross_tokenizer.alignment import EXACT, SKIP, SPAN
from distillax.distill.cross_tokenizer import span_groups
from distillax.distill.cross_tokenizer.losses import AlignedTargets, per_group_terms


def _aligned(rng, B, L, M, G) -> AlignedTargets:
  """Random groups and kinds: row 0 has no span group, row 1 only span groups (every chunk
  runs), the others a mix. Which positions a group holds does not matter to ULD's arithmetic."""
  kind = rng.choice([SKIP, EXACT, SPAN], size=(B, G)).astype(np.int32)
  kind[0] = np.where(kind[0] == SPAN, EXACT, kind[0])
  kind[1] = SPAN


  def groups(n):  # every group holds a position or more on each side, as an alignment's do
    rows = np.concatenate([np.tile(np.arange(G), (B, 1)), rng.integers(-1, G, (B, n - G))], 1)
    return rng.permuted(rows, axis=1).astype(np.int32)
  return AlignedTargets(rng.integers(0, 16, (B, L)).astype(np.int32),
                        rng.integers(0, 24, (B, M)).astype(np.int32), groups(L), groups(M), kind)


def _merged(logits_BxLxV, targets_BxL, group_BxL, span_BxG, T):
  """Each group's merged distribution [B, G, V] by a dense one-hot formulation (independent of
  losses._per_group): the first position's probabilities times the group's other targets'."""
  G = span_BxG.shape[1]
  logp = jax.nn.log_softmax(logits_BxLxV / T, -1)
  target_lp = jnp.take_along_axis(logp, targets_BxL[..., None], -1)[..., 0]
  member_BxLxG = group_BxL[..., None] == jnp.arange(G)
  span_lp = jnp.einsum("bl,blg->bg", target_lp, member_BxLxG.astype(jnp.float32))
  first_BxG = jnp.argmax(member_BxLxG, axis=1)
  first_logp = jnp.take_along_axis(logp, first_BxG[..., None], 1)
  first_target = jnp.take_along_axis(target_lp, first_BxG, 1)
  shift = jnp.where(span_BxG, span_lp - first_target, 0.0)
  return jnp.exp(first_logp + shift[..., None])


def _dense_uld(s_logits, t_logits, aligned, T):
  """The replaced formulation: every group's rows padded to one width, sorted, masked after."""
  span = aligned.group_kind_BxG == SPAN
  ms = _merged(s_logits, aligned.student_targets_BxL, aligned.student_group_BxL, span, T)
  mt = _merged(t_logits, aligned.teacher_targets_BxM, aligned.teacher_group_BxM, span, T)
  V = max(ms.shape[-1], mt.shape[-1])
  pad = lambda p: jnp.sort(jnp.pad(p, ((0, 0), (0, 0), (0, V - p.shape[-1]))), -1)
  return jnp.where(span, jnp.sum(jnp.abs(pad(ms) - pad(mt)), -1), 0.0), (ms, mt)


def test_span_group_uld_equals_dense_sorting_and_numpy():
  rng = np.random.default_rng(0)
  B, L, M, G, T = 4, 13, 15, 10, 1.5
  aligned = _aligned(rng, B, L, M, G)
  s_logits = jnp.asarray(rng.normal(size=(B, L, 16)) * 2, jnp.float32)
  t_logits = jnp.asarray(rng.normal(size=(B, M, 24)) * 2, jnp.float32)
  no_ids = jnp.zeros((0,), jnp.int32)
  new = lambda s: jnp.sum(per_group_terms(s, t_logits, aligned, no_ids, no_ids, T)["uld"])
  dense = lambda s: jnp.sum(_dense_uld(s, t_logits, aligned, T)[0])

  got = per_group_terms(s_logits, t_logits, aligned, no_ids, no_ids, T)["uld"]
  want, (ms, mt) = _dense_uld(s_logits, t_logits, aligned, T)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  # NumPy: each span group's sorted vectors, descending, the student's padded with zeros.
  ms, mt = np.asarray(ms, np.float64), np.asarray(mt, np.float64)
  numpy_BxG = np.zeros((B, G))
  for b, g in zip(*np.nonzero(aligned.group_kind_BxG == SPAN)):
    s = np.pad(np.sort(ms[b, g])[::-1], (0, 24 - 16))
    numpy_BxG[b, g] = np.abs(s - np.sort(mt[b, g])[::-1]).sum()
  np.testing.assert_allclose(got, numpy_BxG, rtol=1e-5, atol=1e-6)
  assert (np.asarray(got)[1] > 0).all() and not np.asarray(got)[0].any()

  grad_new, grad_dense = jax.jit(jax.grad(new))(s_logits), jax.jit(jax.grad(dense))(s_logits)
  assert np.abs(np.asarray(grad_dense)).max() > 1e-3
  np.testing.assert_allclose(grad_new, grad_dense, rtol=0, atol=1e-6)


def test_chunks_without_a_selected_group_do_not_run():
  """64 slots per row, one selected group (slot 40 of row 1): of the 32 chunks (2 slots each)
  only the first runs, and the value lands back at group 40; zero elsewhere."""
  B, G = 3, 64
  selected = np.zeros((B, G), bool)
  selected[1, 40] = True
  values_BxG = jnp.asarray(np.arange(B * G, dtype=np.float32).reshape(B, G) + 1)
  ran = []

  def fn(index_BxR):
    jax.debug.callback(lambda: ran.append(1))
    return {"v": jnp.take_along_axis(values_BxG, index_BxR, 1) * 2}

  out = jax.jit(lambda sel: span_groups.over_selected(fn, sel))(jnp.asarray(selected))["v"]
  jax.effects_barrier()
  assert len(ran) == 1, len(ran)
  want = np.where(selected, 2 * np.asarray(values_BxG), 0)
  np.testing.assert_array_equal(out, want)
