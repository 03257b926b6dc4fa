"""Expert parallelism: the token exchange of a mixture of experts whose experts the rules split.

When the active rules map the logical axis 'expert' onto mesh axes (presets fsdp_ep, ep_tp),
each device along those axes holds E / n of every layer's experts. The dispatch then runs in a
`shard_map` region over exactly those axes (the rest of the mesh stays under GSPMD, so ep_tp's
model axis still splits each expert's width automatically):

1. each device routes its own T / n tokens (routing is computed before, under GSPMD);
2. it packs its (token, expert) rows by destination device and sends them with one
   `all_to_all`;
3. each device runs the rows it received through its local experts with grouped matmuls;
4. a second `all_to_all` sends the results back, where each token sums its k weighted rows.

Dropless with fixed shapes: a token's k experts are distinct, so it sends at most
min(k, E / n) rows to one device, and a send or receive slot per device pair of
C = (T / n) * min(k, E / n) rows holds any routing. The exchange buffers are (n, C, D) per
device, sent and received, n * min(k, E / n) / k times the (T / n) * k rows a perfect balance
needs: with fsdp_ep over 4 devices and tiny_moe (4 experts, k = 2) that is 2x, with 8 experts
per device and k = 8 it is n x. `jax.lax.ragged_all_to_all` would shrink the send side to the
rows actually sent, but XLA:CPU does not implement it (jax 0.10.2: "HLO opcode
`ragged-all-to-all` is not supported"), and the receive side would still need the worst case.

The model never reads the mesh: `MoE` asks `partitioning.split_over('expert', E)`.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from distillax import partitioning as pt

RaggedDot = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def grouped_ffn(xs_NxD, group_sizes_E, gate_ExDxF, up_ExDxF, down_ExFxD, act,
                ragged_dot: RaggedDot = jax.lax.ragged_dot):
  """The gated MLP of each expert over its contiguous group of rows (rows past the groups'
  total come out zero)."""
  gate_NxF = ragged_dot(xs_NxD, gate_ExDxF, group_sizes_E)
  up_NxF = ragged_dot(xs_NxD, up_ExDxF, group_sizes_E)
  return ragged_dot(act(gate_NxF) * up_NxF, down_ExFxD, group_sizes_E)


def _pack_by_destination(dest_N, n: int, capacity: int):
  """For rows bound to devices dest_N: the sort that groups them by device, each row's slot in
  its device's block, and per (device, slot) which sorted row fills it and whether one does."""
  N = dest_N.shape[0]
  order_N = jnp.argsort(dest_N, stable=True)
  dest_sorted_N = dest_N[order_N]
  counts_n = jnp.bincount(dest_N, length=n)
  starts_n = jnp.cumsum(counts_n) - counts_n
  slot_N = jnp.arange(N) - starts_n[dest_sorted_N]
  slots_C = jnp.arange(capacity)
  source_nxC = jnp.minimum(starts_n[:, None] + slots_C[None, :], N - 1)
  filled_nxC = slots_C[None, :] < counts_n[:, None]
  return order_N, dest_sorted_N, slot_N, source_nxC, filled_nxC


def _local_experts(recv_MxD, expert_M, E_local: int, weights, act, ragged_dot):
  """The received rows (expert_M = E_local marks an empty slot) through this device's experts,
  returned in the order they arrived."""
  order_M = jnp.argsort(expert_M, stable=True)
  group_sizes_E = jnp.sum(expert_M[:, None] == jnp.arange(E_local)[None, :], axis=0,
                          dtype=jnp.int32)
  out_MxD = grouped_ffn(jnp.take(recv_MxD, order_M, axis=0), group_sizes_E, *weights, act,
                        ragged_dot=ragged_dot)
  return jnp.take(out_MxD, jnp.argsort(order_M), axis=0)


def _exchange(x_TxD, weights_TxK, experts_TxK, gate, up, down, *, axes, n, act, ragged_dot):
  """Per device (inside the shard_map region): T local tokens, E_local local experts."""
  T, D = x_TxD.shape
  k = experts_TxK.shape[1]
  E_local = gate.shape[0]
  capacity = T * min(k, E_local)
  experts_N = experts_TxK.reshape(-1)
  order_N, dest_sorted_N, slot_N, source_nxC, filled_nxC = _pack_by_destination(
      experts_N // E_local, n, capacity)
  rows_NxD = jnp.take(x_TxD, order_N // k, axis=0)
  send_nxCxD = jnp.where(filled_nxC[..., None], rows_NxD[source_nxC], 0).astype(x_TxD.dtype)
  local_nxC = jnp.where(filled_nxC, (experts_N[order_N] % E_local)[source_nxC], E_local)
  recv_nxCxD = jax.lax.all_to_all(send_nxCxD, axes, 0, 0, tiled=True)
  recv_local_nxC = jax.lax.all_to_all(local_nxC, axes, 0, 0, tiled=True)
  out_MxD = _local_experts(recv_nxCxD.reshape(n * capacity, D), recv_local_nxC.reshape(-1),
                           E_local, (gate, up, down), act, ragged_dot)
  back_nxCxD = jax.lax.all_to_all(out_MxD.reshape(n, capacity, D), axes, 0, 0, tiled=True)
  out_sorted_NxD = back_nxCxD[dest_sorted_N, slot_N]
  out_TxKxD = jnp.take(out_sorted_NxD, jnp.argsort(order_N), axis=0).reshape(T, k, D)
  return jnp.einsum("TKD,TK->TD", out_TxKxD, weights_TxK.astype(out_TxKxD.dtype))


def exchanged_experts(x_TxD, weights_TxK, experts_TxK, gate_ExDxF, up_ExDxF, down_ExFxD, act,
                      where: pt.ManualAxes, ragged_dot: RaggedDot = jax.lax.ragged_dot):
  """The routed experts' weighted output (T, D), experts split over `where` (see the module
  docstring). Tokens are padded to a multiple of the shard count with zero-weight rows."""
  T, D = x_TxD.shape
  n = where.size
  pad = -T % n
  if pad:
    x_TxD = jnp.pad(x_TxD, ((0, pad), (0, 0)))
    weights_TxK = jnp.pad(weights_TxK, ((0, pad), (0, 0)))
    experts_TxK = jnp.pad(experts_TxK, ((0, pad), (0, 0)))
  axes = where.axes if len(where.axes) > 1 else where.axes[0]
  split = P(axes)

  def body(*args):
    with pt.use_rules(jax.sharding.get_abstract_mesh(), where.inner_rules):
      return _exchange(*args, axes=axes, n=n, act=act, ragged_dot=ragged_dot)

  region = jax.shard_map(body, mesh=where.mesh, in_specs=(split,) * 6, out_specs=split,
                         axis_names=set(where.axes), check_vma=False)
  return region(x_TxD, weights_TxK, experts_TxK, gate_ExDxF, up_ExDxF, down_ExFxD)[:T]
