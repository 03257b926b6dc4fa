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

The model never reads the mesh: `run_experts` asks `partitioning.split_over('expert', E)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from distillax import partitioning as pt
from distillax.models.moe.dispatch_rows import combine_rows, gather_rows, group_sizes
from distillax.models.moe.kernels import (RaggedDot, describe, grouped_ffn, ragged_dot_for,
                                          record)


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


def _local_experts(rows_MxD, expert_M, E_local: int, weights, act, ragged_dot, biases=None,
                   up_act=None):
  """Rows through the experts their ids name (expert_M = E_local marks a row for none: an
  empty slot or a dropped assignment), returned in their own order."""
  order_M = jnp.argsort(expert_M, stable=True)
  out_MxD = grouped_ffn(jnp.take(rows_MxD, order_M, axis=0, mode="clip"),
                        group_sizes(expert_M, E_local),
                        *weights, act, ragged_dot=ragged_dot, biases=biases, up_act=up_act,
                        sorted_experts_N=jnp.take(expert_M, order_M))
  return jnp.take(out_MxD, jnp.argsort(order_M), axis=0, mode="clip")


def _combine(out_NxD, weights_TxK):
  """Each token's k weighted expert outputs (rows token-major) summed."""
  T, k = weights_TxK.shape
  out_TxKxD = out_NxD.reshape(T, k, -1)
  return jnp.einsum("TKD,TK->TD", out_TxKxD, weights_TxK.astype(out_TxKxD.dtype))


def routed_experts(x_TxD, routing, gate_ExDxF, up_ExDxF, down_ExFxD, act, biases=None,
                   up_act=None, *, ragged_dot: RaggedDot | None = None):
  """The dropless grouped-matmul dispatch with every expert on this device (the signature of
  models/moe/layer.py's dispatches; `ragged_dot` None: jax.lax.ragged_dot): the T*k (token,
  expert) assignments sorted by expert, each expert's contiguous group through one grouped
  matmul, the sort undone and each token's k weighted outputs summed. An assignment dropped for
  capacity sorts past every group (expert E): no work, and its rows are masked (grouped_ffn)."""
  # Row gathers through dispatch_rows.gather_rows: mode='clip' (every index is in bounds, and
  # jnp.take's default fill adds a select over the gathered rows: 13 ms of a 0.50B MoE
  # student's 8 x 2048 step on a v5e), and gradients that gather through the inverse
  # permutation instead of scatter-adding; dispatch_rows.combine_rows brings the outputs back
  # and takes its gradient from the tokens' cotangent, and group_sizes counts without a scatter.
  # The assignments are slot-major (row j * T + t: token t's j-th choice), so the outputs come
  # back as (k, T, D) by splitting the leading axis, which a TPU's (8, 128) tiles keep as they
  # are; token-major rows reshaped to (T, k, D) put k = 4 on the sublanes, a relayout copy of
  # every expert output there and back (deviceless v5e compile of the MoE student's step).
  E = gate_ExDxF.shape[0]
  experts_N = routing.experts_TxK.T.reshape(-1)  # N = k*T assignments, slot-major
  dropless = routing.keep_TxK is None
  if not dropless:
    experts_N = jnp.where(routing.keep_TxK.T.reshape(-1), experts_N, E)
  order_N = jnp.argsort(experts_N, stable=True)
  inverse_N = jnp.argsort(order_N)
  out_NxD = grouped_ffn(gather_rows(x_TxD, order_N, inverse_N), group_sizes(experts_N, E),
                        gate_ExDxF, up_ExDxF, down_ExFxD, act, ragged_dot=ragged_dot, biases=biases,
                        up_act=up_act, sorted_experts_N=jnp.take(experts_N, order_N),
                        every_row_grouped=dropless)
  return combine_rows(out_NxD, routing.weights_TxK, order_N, inverse_N)


def _exchange(x_TxD, weights_TxK, experts_TxK, gate, up, down, biases, *, axes, n, act, up_act,
              ragged_dot):
  """Per device (inside the shard_map region): T local tokens, E_local local experts."""
  T, D = x_TxD.shape
  k = experts_TxK.shape[1]
  E_local = gate.shape[0]
  capacity = T * min(k, E_local)
  experts_N = experts_TxK.reshape(-1)
  order_N, dest_sorted_N, slot_N, source_nxC, filled_nxC = _pack_by_destination(
      experts_N // E_local, n, capacity)
  rows_NxD = jnp.take(x_TxD, order_N // k, axis=0, mode="clip")
  send_nxCxD = jnp.where(filled_nxC[..., None], rows_NxD[source_nxC], 0).astype(x_TxD.dtype)
  local_nxC = jnp.where(filled_nxC, (experts_N[order_N] % E_local)[source_nxC], E_local)
  recv_nxCxD = jax.lax.all_to_all(send_nxCxD, axes, 0, 0, tiled=True)
  recv_local_nxC = jax.lax.all_to_all(local_nxC, axes, 0, 0, tiled=True)
  out_MxD = _local_experts(recv_nxCxD.reshape(n * capacity, D), recv_local_nxC.reshape(-1),
                           E_local, (gate, up, down), act, ragged_dot, biases, up_act)
  back_nxCxD = jax.lax.all_to_all(out_MxD.reshape(n, capacity, D), axes, 0, 0, tiled=True)
  out_sorted_NxD = back_nxCxD[dest_sorted_N, slot_N]
  return _combine(jnp.take(out_sorted_NxD, jnp.argsort(order_N), axis=0), weights_TxK)


def exchanged_experts(x_TxD, weights_TxK, experts_TxK, gate_ExDxF, up_ExDxF, down_ExFxD, act,
                      where: pt.ManualAxes, ragged_dot: RaggedDot | None = None,
                      biases=None, up_act=None):
  """The routed experts' weighted output (T, D), experts (and their `biases`) split over
  `where` (see the module docstring). Tokens are padded to a multiple of the shard count with
  zero-weight rows. An assignment dropped for capacity has weight 0: it still travels, and
  adds nothing."""
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
      return _exchange(*args, axes=axes, n=n, act=act, up_act=up_act, ragged_dot=ragged_dot)

  region = jax.shard_map(body, mesh=where.mesh, in_specs=(split,) * 7, out_specs=split,
                         axis_names=set(where.axes), check_vma=False)
  return region(x_TxD, weights_TxK, experts_TxK, gate_ExDxF, up_ExDxF, down_ExFxD,
                biases)[:T]


def run_experts(impl: str, replicated, x_TxD, routing, weights, act, biases=None, up_act=None):
  """The MoE layer's expert output (T, D) by `moe_impl`: exchanged over the mesh axes the rules
  split 'expert' over, else `replicated(x_TxD, routing, *weights, act, biases, up_act)` (one
  GSPMD program). The dense reference always runs as one GSPMD program."""
  where = None if impl == "dense" else pt.split_over("expert", weights[0].shape[0])
  if where is None:
    record(f"{describe(impl)}, experts not split (one GSPMD program)")
    return replicated(x_TxD, routing, *weights, act, biases, up_act)
  record(f"{describe(impl)}, experts split {where.size} ways over {'+'.join(where.axes)} "
         f"(all_to_all)")
  return exchanged_experts(x_TxD, routing.weights_TxK, routing.experts_TxK, *weights, act,
                           where, ragged_dot_for(impl), biases, up_act)
