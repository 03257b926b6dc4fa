"""Per-token losses shared by every objective, computed in fp32 and returned as sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distillax.data import batch as batch_spec


def token_nll(logits_BxLxV: jax.Array, targets_BxL: jax.Array) -> jax.Array:
  """Negative log-likelihood of each target token, fp32 whatever the logits' dtype."""
  logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None].astype(jnp.int32), axis=-1)[..., 0]


def cross_entropy_sums(logits_BxLxV: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(loss_sum, correct_sum, tokens) over the tokens where mask is 1."""
  mask_BxL = mask_BxL.astype(jnp.float32)
  nll_BxL = token_nll(logits_BxLxV, targets_BxL)
  correct_BxL = (jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL).astype(jnp.float32)
  return jnp.sum(nll_BxL * mask_BxL), jnp.sum(correct_BxL * mask_BxL), jnp.sum(mask_BxL)


def model_inputs(batch) -> dict:
  """The keyword arguments a distillax model takes from a packed batch."""
  kwargs = {}
  if batch_spec.POSITIONS in batch:
    kwargs["positions_BxL"] = batch[batch_spec.POSITIONS]
  if batch_spec.SEGMENT_IDS in batch:
    kwargs["segment_ids_BxL"] = batch[batch_spec.SEGMENT_IDS]
  return kwargs
