"""Llama 4's chunked attention as segment ids, so every attention implementation runs it as is.

A query at position p sees the keys of its own chunk, positions [p - p % C, p] (C =
model.attention_chunk_size), as transformers' chunked mask does. Within one document positions
run one per index, so that is the causal mask with each (document, chunk) pair a segment of its
own: segment' = segment * M + position // C. The keys' positions are the call's own for the
slots it writes; a KV cache's earlier slots take the position the row's first query implies
(its index plus that query's position - index offset): only the document a call continues can
be seen there, and it is the first query's. Padding (segment 0) stays below every real segment.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distillax.models.config import TransformerConfig


def chunk_segments(config: TransformerConfig, ctx: dict):
  """(q segments, k segments) that also split each document at every chunk boundary, from a
  forward's context (Transformer.__call__: positions, indices, segments, the cache slot)."""
  positions_BxL, q_index_BxL, k_index_BxS = ctx["positions"], ctx["q_index"], ctx["k_index"]
  q_segment_BxL, k_segment_BxS = ctx["q_segment"], ctx["k_segment"]
  cache_index = ctx.get("cache_index")
  C = config.attention_chunk_size
  chunks = config.max_seq_len // C + 1  # M: chunk ids of one segment (positions < max_seq_len)
  B, L = positions_BxL.shape
  ones = lambda shape: jnp.ones(shape, jnp.int32)
  q_seg = ones((B, L)) if q_segment_BxL is None else q_segment_BxL
  k_seg = q_seg if k_segment_BxS is None else k_segment_BxS
  if cache_index is None:  # keys are this call's tokens
    k_pos_BxS = positions_BxL
  else:
    offset_B = positions_BxL[:, 0] - q_index_BxL[:, 0]
    k_pos_BxS = jax.lax.dynamic_update_slice(k_index_BxS + offset_B[:, None], positions_BxL,
                                             (0, cache_index))
  refine = lambda seg, pos: seg * chunks + jnp.clip(pos // C, 0, chunks - 1).astype(jnp.int32)
  return refine(q_seg, positions_BxL), refine(k_seg, k_pos_BxS)
