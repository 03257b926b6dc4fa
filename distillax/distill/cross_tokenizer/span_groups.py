"""Row work on the groups of one kind only: ULD's sorts, on the SPAN groups.

ULD sorts a whole merged distribution, [max(Vs, Vt)] values, per group; on the CPU sorting 384
such rows of 1024 took 62 ms, against 13 ms for a whole same-tokenizer on-policy step of the
benchmark below. Only SPAN groups are
scored by ULD, and an on-policy batch has few of them (two BPEs of one corpus: 2 to 6 of the 384
group slots of benchmarks/cross_tokenizer_on_policy.py's batch; prompts and one-to-one groups
are the rest). Sorting every slot and masking afterwards spent ~90% of the step on sorts
whose value was then thrown away.

`over_selected` moves each row's selected groups to the front of the row (a stable argsort of
[B, G] booleans), cuts the slots into chunks of a few slots per row and runs the caller's
function on a chunk only when some row still has a selected group there (lax.cond: a skipped
chunk sorts nothing); the values go back to group order. The value of each
selected group is what the function gives it, so the loss is unchanged; only the work on
unselected groups is skipped. The batch axis stays whole inside every chunk, like the
vocabulary-chunk engine's chunks, so an array sharded along the batch stays sharded. Each chunk
is rematerialised in the backward pass (jax.checkpoint): only its indices are kept, not its
[B, slots, V] intermediates.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

# A row's G slots are cut into this many chunks (fewer when G is smaller): the work past the
# selected groups is at most one chunk, 1/32 of the slots, and the loop at most 32 steps long
# (more only where `max_slots` asks for smaller chunks).
CHUNKS_PER_ROW = 32


def over_selected(fn: Callable[[jax.Array], dict], selected_BxG: jax.Array,
                  max_slots: int | None = None) -> dict[str, jax.Array]:
  """{name: [B, G]} values of fn at each row's selected groups, 0 elsewhere.

  fn(index_BxR) -> {name: [B, R]} computes the values of the groups index_BxR (group ids of each
  row); it must give finite values for any valid id, since a chunk's slots past a row's own
  selected groups hold other groups (their values are dropped). max_slots: the most slots per
  row in one chunk (a memory bound), None for no bound."""
  B, G = selected_BxG.shape
  slots = math.ceil(G / CHUNKS_PER_ROW)
  slots = max(1, min(slots, int(max_slots))) if max_slots is not None else slots
  C = math.ceil(G / slots)
  order_BxG = jnp.argsort(~selected_BxG, axis=1, stable=True)  # selected first, in order
  count = jnp.max(jnp.sum(selected_BxG, axis=1))
  order_CxBxR = jnp.moveaxis(
      jnp.pad(order_BxG, ((0, 0), (0, C * slots - G))).reshape(B, C, slots), 1, 0)
  out_shapes = jax.eval_shape(fn, order_CxBxR[0])

  def skipped(index_BxR):
    del index_BxR
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes)

  @jax.checkpoint
  def chunk(j, index_BxR):
    return jax.lax.cond(j * slots < count, fn, skipped, index_BxR)

  out_CxBxR = jax.lax.map(lambda xs: chunk(*xs), (jnp.arange(C), order_CxBxR))
  inverse_BxG = jnp.argsort(order_BxG, axis=1)  # slot of each group

  def to_groups(v_CxBxR):
    v_BxG = jnp.moveaxis(v_CxBxR, 0, 1).reshape(B, C * slots)[:, :G]
    return jnp.where(selected_BxG, jnp.take_along_axis(v_BxG, inverse_BxG, 1), 0)

  return {name: to_groups(v) for name, v in out_CxBxR.items()}
