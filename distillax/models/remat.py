"""What a decoder block keeps for its backward pass (`model.remat`), as jax.checkpoint policies.

- `full`: nothing; the backward pass runs the block's forward again.
- `save_dots` / `save_dots_no_batch`: JAX's policies, every matmul output / those without a
  batch dimension (the weight products).
- `save_attention`: the attention kernel's output and its softmax statistics (splash's on a
  TPU, named by its `residual_checkpoint_name`; the blockwise path's), so the backward pass
  runs the projections, norms and MLP again but not the attention forward. Why: on a TPU the splash
  forward is the largest part of what `full` recomputes (54 of 135 ms in the 0.6B student's
  8 x 2048 train step), for one (tokens, heads x head_dim) array a layer.
- `save_attention_qkv`: that, and the rotated queries, keys and values the attention backward
  reads, so the q, k, v projections and their RoPE are not run again either.
- `save_attention_up` / `save_attention_mlp`: the attention kernel's output, and each gated
  MLP's up product / its gate and up products (a mixture of experts' too, and the rows its
  dispatch gathered into expert order), so the backward runs one / two of the MLP's three
  matmuls fewer. Why: on a TPU v5e, with Adam's moments in bf16, the 0.6B student's
  train step at 6 x 2048 ran 525.9 ms with `save_attention_up` against 537.7 with
  `save_attention` (50.8% MFU against 49.6%; chip call 50). The MoE student's did not gain.

Other attention paths (the reference, cuDNN) are recomputed under both, as under `full`.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

ATTENTION_OUT = "attention_out"  # an attention kernel's output and softmax statistics
ATTENTION_QKV = ("attention_q", "attention_k", "attention_v")
MLP_GATE_UP = ("mlp_gate", "mlp_up")  # a gated MLP's two input products, before the activation
MOE_ROWS = "moe_rows"  # the MoE dispatch's rows gathered into expert order

POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "save_dots": jax.checkpoint_policies.checkpoint_dots,
    "save_dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "save_attention": jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT),
    "save_attention_qkv": jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT,
                                                                         *ATTENTION_QKV),
    "save_attention_up": jax.checkpoint_policies.save_only_these_names(ATTENTION_OUT,
                                                                        MLP_GATE_UP[1]),
    "save_attention_mlp": jax.checkpoint_policies.save_only_these_names(
        ATTENTION_OUT, *MLP_GATE_UP, MOE_ROWS),
}


def name_attention_out(*arrays):
  """The blockwise kernel's residuals, named for `save_attention`'s policy."""
  return tuple(checkpoint_name(a, ATTENTION_OUT) for a in arrays)


def name_qkv(q, k, v):
  """The rotated queries, keys and values, named for `save_attention_qkv`'s policy."""
  return tuple(checkpoint_name(a, n) for a, n in zip((q, k, v), ATTENTION_QKV))


def name_moe_rows(rows):
  """The dispatch's gathered rows, named for `save_attention_mlp`'s policy."""
  return checkpoint_name(rows, MOE_ROWS)


def name_mlp_gate_up(gate, up):
  """A gated MLP's two input products (a dense MLP's or the experts'), named for
  `save_attention_up`'s and `save_attention_mlp`'s policies."""
  return tuple(checkpoint_name(a, n) for a, n in zip((gate, up), MLP_GATE_UP))
