"""The adapted matmul of a LoRA site, y = x @ W + scaling * (dropout(x) @ A) @ B, at its natural
cost: a custom VJP (`adapted_matmul`) whose forward is one matmul of [x | scaling * h] and
[W ; B] (h = dropout(x) @ A) and whose backward computes no gradient for a frozen base and keeps
from the forward only x, h, the adapters, the 1-bit keep mask (`keep_mask`) and the base as
stored (a QLoRA base is dequantized again). `matmul_layout` decides, from the active
partitioning rules, whether the one-matmul form applies and how its weight is laid out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import string
from typing import Any

import jax
import jax.numpy as jnp
from jax import custom_derivatives

from distillax import partitioning as pt
from distillax.errors import PartitioningError
from distillax.quant.keep_mask import unpack_keep_mask


@dataclasses.dataclass(frozen=True)
class PlainBase:
  """The frozen base weight as stored, cast to the matmul's dtype."""

  dtype: str

  def __call__(self, w: jax.Array, zero: jax.Array | None = None) -> jax.Array:
    del zero  # read as is: nothing is recomputed in the backward
    return w.astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class AdaptedMatmul:
  """One adapted matmul, y = x @ W + scaling * (dropout(x) @ A) @ B, as static facts.

  The forward is one matmul of [x | scaling * h] and [W ; B] (h = dropout(x) @ A, rank-sized),
  so y comes out of a single dot: with two dots and an add, XLA fuses the add into y's
  consumers and keeps both output-sized addends alive until the backward. The backward
  (`_adapted_bwd`) takes the three matmuls apart again (x's cotangent, without adapter
  dropout, through one matmul with W + s A B: `merged_weight`) and keeps between the passes
  only x
  (shared by every site that reads it; the frozen base needs nothing else), the base as
  stored (a QLoRA base is dequantized again, never kept in full precision), the adapters,
  the packed keep mask and h.
  """

  spec: str  # the model's einsum with x first: x, W -> y
  base: Any  # callable: stored base arrays -> W in the matmul's dtype
  x_perm: tuple[int, ...]  # x -> (x's free dims, contracted dims)
  w_perm: tuple[int, ...]  # W -> (contracted dims, free dims)
  h_spec: str  # dropout(x), A -> h
  delta_spec: str  # h, B -> y
  flat_spec: str  # [x | h] (contracted dims flattened), [W ; B] -> y
  merge_spec: str  # A, B -> A B, laid out as W
  grad_specs: tuple[str, ...]  # (h, g -> dB), (g, B -> dh), (dh, A -> dx), (dh, x -> dA)
  n_contract: int  # contracted dims of W
  layout: tuple  # (one matmul?, W's PartitionSpec entries for it or None): `matmul_layout`
  scaling: float
  keep: float  # 1 - dropout
  kwargs: tuple  # the einsum's keyword arguments

  def dropped(self, x, keep_bits):
    if keep_bits is None:
      return x
    keep = unpack_keep_mask(keep_bits, x.shape[-1])
    return jnp.where(keep, x / self.keep, jnp.zeros_like(x))

  def dropped_again(self, x, keep_bits, zero):
    """dropout(x) for the backward: the forward's values, not the forward's array.

    `zero` is 0 * (a slice of the cotangent), broadcast like x: exactly zero for a finite
    cotangent, but only known in the backward. Without that dependency XLA merges this with
    the forward's dropout(x), or computes it at the start of the backward for every layer at
    once, and per-site copies of x stay alive across the step's memory peak. (The same goes
    for a QLoRA base dequantized again: see `Dequantizer`.)
    """
    keep = unpack_keep_mask(keep_bits, x.shape[-1])
    return jnp.where(keep, x + zero.astype(x.dtype), jnp.zeros_like(x)) / self.keep

  def hidden(self, x, lora_a, keep_bits):
    """h = dropout(x) @ A."""
    return jnp.einsum(self.h_spec, self.dropped(x, keep_bits), lora_a.astype(x.dtype),
                      **self._extra())

  def delta(self, h, lora_b, dtype):
    return (self.scaling * jnp.einsum(self.delta_spec, h, lora_b.astype(h.dtype),
                                      **self._extra())).astype(dtype)

  def _extra(self):
    return {k: v for k, v in self.kwargs if k in ("precision", "preferred_element_type")}

  def adapter_grads(self, x, lora_a, lora_b, keep_bits, h, g, dx=True):
    """(dx, dA, dB) of the adapter path for the output cotangent g (dx None with dx=False:
    `merged_weight` carried it).

    The rank-sized matmuls are written with the small operand first: a contraction over the
    tokens then transposes h or dh (rank-sized) rather than g or x, whose transposed copies,
    fused with everything that produces them, were the largest single costs of the old
    adapter backward on CPU."""
    b_spec, h_spec, x_spec, a_spec = self.grad_specs
    precision = {k: v for k, v in self.kwargs if k == "precision"}
    g = g.astype(h.dtype)
    g_b = self.scaling * jnp.einsum(b_spec, h, g, **precision)
    g_h = jnp.einsum(h_spec, g, (self.scaling * lora_b).astype(h.dtype), **precision)
    g_x = None
    if dx:
      _, dropped_vjp = jax.vjp(lambda x_: self.dropped(x_, keep_bits), x)
      (g_x,) = dropped_vjp(jnp.einsum(x_spec, g_h, lora_a.astype(x.dtype), **precision))
    x_dropped = x
    if keep_bits is not None:
      zero = jnp.expand_dims(0.0 * g_h[..., 0], self.x_perm[x.ndim - self.n_contract:])
      x_dropped = self.dropped_again(x, keep_bits, zero)
    g_a = jnp.moveaxis(jnp.einsum(a_spec, g_h, x_dropped, **precision), 0, -1)
    return g_x, g_a.astype(lora_a.dtype), g_b.astype(lora_b.dtype)

  def merge_pays(self, x, lora_b) -> bool:
    """Whether the merged weight costs less than the adapter's dx path it replaces: merging is
    rank x W's size of work, the path rank x the tokens x W's inputs, so it pays where a
    device holds at least as many tokens as W has outputs (as on one v5e at 4-8 x 2048, where
    QLoRA's step went from 790 to 745 ms at 8 rows)."""
    tokens = math.prod(x.shape[i] for i in self.x_perm[:x.ndim - self.n_contract])
    active = pt.active_rules()
    if active is not None and isinstance(active.mesh, jax.sharding.Mesh):
      tokens //= active.mesh.size  # at most this many per device, whatever the layout
    return tokens >= math.prod(lora_b.shape[1:])

  def merged_weight(self, w, lora_a, lora_b, zero):
    """W + s A B in W's dtype and layout, for the backward's dx: one matmul of g and it
    instead of g @ W^T plus (g @ (s B)^T) @ A^T, an HBM-bound pass over g for a rank-wide
    output and another writing dx-sized addends. The merged sum is rounded to W's dtype once
    (in float32 first): the adapter's part of dx then moves by at most half an ulp of W per
    weight entry, the precision a matmul in W's dtype has anyway. The forward, and dA and dB,
    keep the two paths apart. `zero` (an exact 0 known only in the backward, as for
    `dropped_again`) keeps XLA from merging every layer's weight at once, before the backward
    needs the first: a plain base does not depend on the cotangent otherwise."""
    delta = jnp.einsum(self.merge_spec, lora_a.astype(jnp.float32) + zero,
                       lora_b.astype(jnp.float32))
    return (w.astype(jnp.float32) + self.scaling * delta).astype(w.dtype)

  @property
  def one_matmul(self) -> bool:
    return self.layout[0]

  def laid_out(self, a: jax.Array, spec_of_w) -> jax.Array:
    """`a` laid out for the one matmul (see `matmul_layout`); `spec_of_w` maps
    W's PartitionSpec entries to a's."""
    active, spec = pt.active_rules(), self.layout[1]
    if spec is None or active is None:
      return a
    sharding = jax.sharding.NamedSharding(active.mesh,
                                          jax.sharding.PartitionSpec(*spec_of_w(spec)))
    return jax.lax.with_sharding_constraint(a, sharding)

  def weight(self, base_arrays, zero=None):
    """W in the matmul's dtype from its stored arrays, laid out first: a QLoRA base is then
    gathered (FSDP) as codes, not as its dequantized full-precision weight."""
    return self.base(*(self.laid_out(a, lambda s: s) for a in base_arrays), zero=zero)

  def forward(self, x, base_arrays, lora_a, lora_b, keep_bits):
    w = self.weight(base_arrays)
    h = self.hidden(x, lora_a, keep_bits)
    if not self.one_matmul:
      y = jnp.einsum(self.spec, x, w, **dict(self.kwargs))
      return y + self.delta(h, lora_b, y.dtype), h
    free_x = tuple(x.shape[i] for i in self.x_perm[:x.ndim - self.n_contract])
    free_w = tuple(w.shape[i] for i in self.w_perm[self.n_contract:])
    x_flat = jnp.transpose(x, self.x_perm).reshape(free_x + (-1,))
    w_flat = jnp.transpose(w, self.w_perm).reshape((-1,) + free_w)
    x_aug = jnp.concatenate([x_flat, (self.scaling * h).astype(x.dtype)], axis=-1)
    lora_b = self.laid_out(lora_b, lambda s: (None,) + s[self.n_contract:])  # (rank, free)
    w_aug = jnp.concatenate([w_flat, lora_b.astype(w.dtype).reshape((-1,) + free_w)], axis=0)
    return jnp.einsum(self.flat_spec, x_aug, w_aug, **dict(self.kwargs)), h


# A frozen base's dx (no adapter dropout) as one matmul of g and W + s A B
# (`AdaptedMatmul.merged_weight`). False: the base's and the adapter's dx apart, as before it;
# benchmarks/lib/lever_grid.py's lora_bwd=two traces a step so, to hold the two against each
# other on a chip.
BACKWARD_MERGED = True


# On a CPU the merged weight did not pay at benchmarks/qat.py's sizes (LoRA's step 0.82-0.85x
# of full fine-tuning's with the paths apart, 0.89-0.92x merged): a CPU keeps them apart unless
# this says otherwise (the tests, to check the merged form's numbers on a CPU).
MERGED_ON_CPU = False


def _merged_grads(m, x, base_arrays, lora_a, lora_b, h, g):
  """(dx, dA, dB) of a frozen base without adapter dropout, dx through W + s A B."""
  # The base is read again through an exact zero taken from the cotangent (`dropped_again`).
  zero = 0.0 * g[(0,) * g.ndim].astype(jnp.float32)
  w = m.merged_weight(m.weight(base_arrays, zero=zero), lora_a, lora_b, zero)
  _, merged_vjp = jax.vjp(lambda x_: jnp.einsum(m.spec, x_, w, **dict(m.kwargs)), x)
  (g_x,) = merged_vjp(g)
  _, g_a, g_b = m.adapter_grads(x, lora_a, lora_b, None, h, g, dx=False)
  return g_x, g_a, g_b


def _apart_grads(m, keep_bits, x, base_arrays, lora_a, lora_b, h, g):
  """(dx, dA, dB) of a frozen base, the base's dx (as autodiff computes it) and the adapter's
  apart."""
  g_x_adapter, g_a, g_b = m.adapter_grads(x, lora_a, lora_b, keep_bits, h, g)
  # The base is read again through an exact zero taken from dB (see `dropped_again`).
  zero = jnp.expand_dims(0.0 * g_b[0].astype(jnp.float32), m.w_perm[:m.n_contract])
  w = m.weight(base_arrays, zero=zero)
  _, base_vjp = jax.vjp(lambda x_: jnp.einsum(m.spec, x_, w, **dict(m.kwargs)), x)
  (g_x_base,) = base_vjp(g)
  return g_x_base + g_x_adapter, g_a, g_b


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def adapted_matmul(m: AdaptedMatmul, x, base_arrays, lora_a, lora_b, keep_bits):
  return m.forward(x, base_arrays, lora_a, lora_b, keep_bits)[0]


def _adapted_fwd(m, x, base_arrays, lora_a, lora_b, keep_bits):
  # A plain base trained along with the adapters (trainable=nnx.Param) gets its gradient;
  # the frozen base of LoRA and QLoRA (the usual case) costs no weight-sized matmul.
  base_trains = any(p.perturbed for p in jax.tree.leaves(base_arrays))
  values = custom_derivatives.custom_vjp_primal_tree_values
  x, base_arrays, lora_a, lora_b, keep_bits = values((x, base_arrays, lora_a, lora_b, keep_bits))
  y, h = m.forward(x, base_arrays, lora_a, lora_b, keep_bits)
  return y, (x, base_arrays, lora_a, lora_b, keep_bits, h, () if base_trains else None)


def _adapted_bwd(m, res, g):
  """The cotangents of x @ W + delta(x, A, B): x's from the base's own transposed matmul
  (as autodiff computes it) plus the adapter path's; A's and B's; none for a frozen base."""
  x, base_arrays, lora_a, lora_b, keep_bits, h, base_trains = res
  if isinstance(g, custom_derivatives.SymbolicZero):
    g = jnp.zeros(g.shape, g.dtype)
  if base_trains is None:  # the frozen base: no gradient, nothing weight-sized computed
    grads = functools.partial(_apart_grads, m, keep_bits)
    if keep_bits is None and m.one_matmul and BACKWARD_MERGED and m.merge_pays(x, lora_b):
      merged = functools.partial(_merged_grads, m)
      # A CPU keeps the paths apart (see MERGED_ON_CPU); the platform lowered for decides.
      grads = merged if MERGED_ON_CPU else functools.partial(
          jax.lax.platform_dependent, default=merged, cpu=grads)
    g_x, g_a, g_b = grads(x, base_arrays, lora_a, lora_b, h, g)
    return g_x, jax.tree.map(lambda _: None, base_arrays), g_a, g_b, None
  # Only a plain base (one array) trains.
  g_x_adapter, g_a, g_b = m.adapter_grads(x, lora_a, lora_b, keep_bits, h, g)
  w = m.weight(base_arrays)
  _, base_vjp = jax.vjp(lambda x_, w_: jnp.einsum(m.spec, x_, w_, **dict(m.kwargs)), x, w)
  g_x_base, g_w = base_vjp(g)
  return g_x_base + g_x_adapter, (g_w.astype(base_arrays[0].dtype),), g_a, g_b, None


adapted_matmul.defvjp(_adapted_fwd, _adapted_bwd, symbolic_zeros=True)


def for_einsum(x_term: str, w_term: str, out: str, contract: str, x_ndim: int,
               **facts) -> AdaptedMatmul:
  """The AdaptedMatmul of the model's `x_term,w_term->out`, contracting the letters `contract`
  (in W's order, as A lays them out; W's other letters are its output dims, B's). A '...' in x
  and the output is spelled out in fresh letters: the one-matmul form flattens x by position.
  `facts`: base, layout, scaling, keep, kwargs."""
  fresh = [c for c in string.ascii_letters if c not in x_term + w_term + out]
  if "..." in x_term:
    dots = "".join(fresh[:x_ndim - (len(x_term) - 3)])
    fresh = fresh[len(dots):]
    x_term, out = x_term.replace("...", dots), out.replace("...", dots)
  rank, flat = fresh[:2]
  free = "".join(c for c in w_term if c not in contract)
  x_free = "".join(c for c in x_term if c not in contract)
  return AdaptedMatmul(
      spec=f"{x_term},{w_term}->{out}",
      x_perm=tuple(x_term.index(c) for c in x_free + contract),
      w_perm=tuple(w_term.index(c) for c in contract + free),
      h_spec=f"{x_term},{contract}{rank}->{x_free}{rank}",
      delta_spec=f"{x_free}{rank},{rank}{free}->{out}",
      flat_spec=f"{x_free}{flat},{flat}{free}->{out}",
      merge_spec=f"{contract}{rank},{rank}{free}->{w_term}",
      grad_specs=(f"{x_free}{rank},{out}->{rank}{free}", f"{out},{rank}{free}->{x_free}{rank}",
                  f"{x_free}{rank},{contract}{rank}->{x_term}",
                  f"{x_free}{rank},{x_term}->{rank}{contract}"),
      n_contract=len(contract), **facts)


def matmul_layout(names: tuple, sizes: tuple[int, ...], contract_axes: tuple[int, ...],
                  batch_size: int, site_name: str) -> tuple[bool, tuple | None]:
  """(one matmul?, the weight's layout for it) under the active partitioning rules, for a
  weight of logical axes `names` and shape `sizes` (as its matmul sees it).

  The one-matmul form concatenates along the contracted dims: only where the input is whole
  along them (not the row-parallel o and down under tp, where GSPMD would gather the input;
  those keep x @ W + delta). The weight is then laid out as the matmul uses it (contracted
  dims whole, output dims as the output is split), which is what GSPMD gathers for the plain
  matmul too, so the backward reads the same gathered weight."""
  active = pt.active_rules()
  if active is None:
    return True, None
  free = [i for i in range(len(sizes)) if i not in contract_axes]

  def split_as_activation(dims):  # the batch takes its mesh axes first
    logical = ("batch",) + tuple(names[i] for i in dims)
    shape = (batch_size,) + tuple(sizes[i] for i in dims)
    return tuple(active.rules.resolve(logical, shape, active.mesh, site_name))[1:]
  try:
    x_spec, out_spec = split_as_activation(contract_axes), split_as_activation(free)
  except PartitioningError:
    return False, None
  if any(math.prod(active.mesh.shape[a] for a in pt.axes_tuple(d)) > 1 for d in x_spec):
    return False, None
  if not isinstance(active.mesh, jax.sharding.Mesh):  # per worker: nothing to lay out
    return True, None
  return True, tuple(None if i in contract_axes else out_spec[free.index(i)]
                     for i in range(len(sizes)))
