"""One layer's place in a stacked KV cache, for a scan over the layers.

A scan that took each layer's cache as input (`xs`) and returned the updated one as output
(`ys`) would read the whole cache and write a whole new stack at every call: at decode, one
token per row, that copy is most of what a step reads and writes (the real 0.6B student's 16
rows of 1,024 slots: 1.9 GB of keys and values against 1.2 GB of weights). With a slot the scan
carries the stack instead: a call writes only its own tokens into it, in place, at
(layer, :, index), and reads its layer back for the attention.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedSlot:
  """`stacks`: the cache's parts, each (N layers, B, S, ...); `layer`: this layer's index in
  them (an int32 scalar, traced under scan)."""

  stacks: tuple[jax.Array, ...]
  layer: jax.Array

  def written(self, parts_BxLx: tuple[jax.Array, ...], cache_index) -> "StackedSlot":
    """The slot with `parts_BxLx` (one per stack, this call's L tokens) written at slot
    `cache_index` of this layer."""
    def write(stack, part):
      start = (self.layer, 0, cache_index) + (0,) * (stack.ndim - 3)
      return jax.lax.dynamic_update_slice(stack, part.astype(stack.dtype)[None], start)
    return StackedSlot(tuple(map(write, self.stacks, parts_BxLx)), self.layer)

  def layer_parts(self) -> tuple[jax.Array, ...]:
    """This layer's part of every stack, (B, S, ...) each."""
    return tuple(jax.lax.dynamic_index_in_dim(s, self.layer, 0, keepdims=False)
                 for s in self.stacks)
