"""What a `TransformerConfig`'s fields mean together: the sizes derived from them and, layer by
layer, which attention, RoPE, window, keys/values and MLP each layer has. A base class of the
config (config.py stays the list of fields); it reads only the fields, never sets them.
"""

from __future__ import annotations

import math

from distillax.models.config_checks import (GLOBAL_WINDOW, LINEAR, ROPE_GLOBAL, ROPE_LOCAL,
                                            ROPE_NONE, SLIDING)


class DerivedQuantities:
  """The derived quantities of TransformerConfig (its fields are read from `self`)."""

  @property
  def num_groups(self) -> int:
    """Query heads per key/value head."""
    return self.num_heads // self.num_kv_heads

  @property
  def expert_mlp_dim(self) -> int:
    """Hidden width of each MoE expert."""
    return self.moe_mlp_dim or self.mlp_dim

  def layer_is_moe(self, layer: int) -> bool:
    """Whether layer `layer`'s MLP is routed experts (else a dense MLP of width mlp_dim)."""
    return bool(self.num_experts) and (self.moe_layers is None or layer in self.moe_layers)

  @property
  def num_moe_layers(self) -> int:
    return sum(self.layer_is_moe(i) for i in range(self.num_layers))

  @property
  def rotary_dim(self) -> int:
    """Features of each query/key head that RoPE turns (the first ones, the rest pass; MLA:
    qk_rope_head_dim, the last ones)."""
    if self.kv_lora_rank:
      return self.qk_rope_head_dim
    return int(self.head_dim * self.partial_rotary_factor)

  def layer_has_rope(self, layer: int) -> bool:
    """Whether layer `layer` turns its queries and keys (not one of rope_free_layers)."""
    return layer not in (self.rope_free_layers or ())

  def layer_is_chunked(self, layer: int) -> bool:
    """Whether layer `layer` attends within chunks (Llama 4's RoPE layers)."""
    return self.attention_chunk_size is not None and self.layer_has_rope(layer)

  @property
  def value_head_dim(self) -> int:
    """Features of each value head (MLA's v_head_dim; else head_dim)."""
    return self.v_head_dim or self.head_dim

  def layer_is_linear(self, layer: int) -> bool:
    """Whether layer `layer` is a Gated DeltaNet (linear attention) layer."""
    return self.token_mixers is not None and self.token_mixers[layer] == LINEAR

  def kv_source_layer(self, layer: int) -> int | None:
    """The layer whose keys/values layer `layer` attends with when it shares them (Gemma 4's
    last num_kv_shared_layers: the last unshared layer of the same attention type), else None."""
    first_shared = self.num_layers - self.num_kv_shared_layers
    if layer < first_shared:
      return None
    local = self.layer_uses_sliding_window(layer)
    same = [i for i in range(first_shared) if self.layer_uses_sliding_window(i) == local]
    return same[-1] if same else None

  def layer_head_dim(self, layer: int) -> int:
    """Features per attention head of layer `layer` (Gemma 4's full layers: global_head_dim)."""
    if self.global_head_dim and not self.layer_uses_sliding_window(layer):
      return self.global_head_dim
    return self.head_dim

  def layer_num_kv_heads(self, layer: int) -> int:
    """Key/value heads of layer `layer` (Gemma 4 31B's full layers: global_num_kv_heads)."""
    if self.global_num_kv_heads and not self.layer_uses_sliding_window(layer):
      return self.global_num_kv_heads
    return self.num_kv_heads

  def layer_keys_are_values(self, layer: int) -> bool:
    """Whether layer `layer` attends with its keys as values (no v projection of its own)."""
    return self.attention_k_eq_v and not self.layer_uses_sliding_window(layer)

  def layer_mlp_dim(self, layer: int) -> int:
    """Hidden width of layer `layer`'s dense MLP (Gemma 4's double-wide sharing layers)."""
    wide = self.double_wide_shared_mlp and not self.layer_owns_kv(layer)
    return self.mlp_dim * (2 if wide else 1)

  def layer_owns_kv(self, layer: int) -> bool:
    """Whether layer `layer` computes (and caches) keys/values of its own."""
    return layer < self.num_layers - self.num_kv_shared_layers

  @property
  def per_layer_vocab(self) -> int:
    return self.per_layer_input_vocab_size or self.vocab_size

  @property
  def num_linear_layers(self) -> int:
    return sum(self.layer_is_linear(i) for i in range(self.num_layers))

  @property
  def attn_scale(self) -> float:
    """The attention logits' scale: query_pre_attn_scalar (else head_dim) ** -0.5, times
    DeepSeek's YaRN m(mscale_all_dim)^2 when set."""
    scale = float(self.query_pre_attn_scalar or self.head_dim) ** -0.5
    return scale * self.yarn_mscale(self.rope_yarn_mscale_all_dim) ** 2

  def yarn_mscale(self, m: float) -> float:
    """DeepSeek's YaRN magnitude 0.1 m ln(factor) + 1 (1 without YaRN, m = 0 or factor <= 1)."""
    factor = self.rope_scaling_factor
    if not m or factor is None or self.rope_scaling_type != "yarn" or factor <= 1:
      return 1.0
    return 0.1 * m * math.log(factor) + 1.0

  def layer_uses_sliding_window(self, layer: int) -> bool:
    if self.sliding_window is None:
      return False
    if self.layer_types is not None:
      return self.layer_types[layer] == SLIDING
    p = self.sliding_window_pattern
    return p == 0 or (layer + 1) % p != 0

  def layer_windows(self) -> tuple[int, ...] | None:
    """Attention span per layer (GLOBAL_WINDOW for global layers); None without sliding window."""
    if self.sliding_window is None:
      return None
    return tuple(self.sliding_window if self.layer_uses_sliding_window(i) else GLOBAL_WINDOW
                 for i in range(self.num_layers))

  def local_layers(self) -> list[bool]:
    """Whether each layer attends within the sliding window."""
    return [self.layer_uses_sliding_window(i) for i in range(self.num_layers)]

  def layer_ropes(self) -> tuple[int, ...]:
    """Per layer, the RoPE its queries and keys turn with: ROPE_NONE for rope_free_layers,
    ROPE_LOCAL (rope_local_theta, unscaled) for sliding layers when it is set, else
    ROPE_GLOBAL (rope_theta with its scaling)."""
    free = self.rope_free_layers or ()
    return tuple(ROPE_NONE if i in free else ROPE_LOCAL if (
        self.rope_local_theta is not None and self.layer_uses_sliding_window(i)) else ROPE_GLOBAL
                 for i in range(self.num_layers))
