"""The shared expert of a Qwen3.5-MoE layer: one dense gated MLP that every token runs beside
its k routed experts, its output added to theirs.

Its width is `shared_expert_mlp_dim` (HF's shared_expert_intermediate_size); with
`shared_expert_gate` its output is scaled per token by sigmoid(x @ output_gate), a learned
(embed, 1) projection (HF's shared_expert_gate, llama.cpp's ffn_gate_inp_shexp), so the layer
learns how much of the shared path each token takes. It is the dense `MLP` (same logical axes,
so every rule set places it as it places a dense model's MLP) and runs the same whatever
`moe_impl` dispatches the routed experts. The output gate is, like the router, a single logit
per token that QAT and QLoRA keep in full precision (`quant.sites.MatmulSite.is_router`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.models.config import TransformerConfig
from distillax.models.layers import MLP, normal_param


class SharedExpert(MLP):
  """down(act(gate(x)) * up(x)), times sigmoid(x @ output_gate) when the config gates it."""

  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    super().__init__(config, rngs=rngs, dim=config.shared_expert_mlp_dim)
    D = config.embed_dim
    self.output_gate = (normal_param(rngs, (D, 1), D ** -0.5, config.jnp_param_dtype,
                                     ("embed", None)) if config.shared_expert_gate else None)

  def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
    out_BxLxD = super().__call__(x_BxLxD)
    if self.output_gate is None:
      return out_BxLxD
    logit_BxLx1 = jnp.einsum("BLD,DO->BLO", x_BxLxD, self.output_gate[...].astype(self.dtype))
    return out_BxLxD * jax.nn.sigmoid(logit_BxLx1)
