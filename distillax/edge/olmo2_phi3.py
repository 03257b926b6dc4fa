"""What llama.cpp's olmo2 (OLMo 2 and OLMo 3) and phi3 (Phi-3, Phi-4) architectures read beyond
one GGUF tensor per parameter: their refusals, their `{arch}.*` keys and the tensors they store
differently from distillax.

OLMo (olmo2). Post norms only (post_attention_norm, post_ffw_norm), q/k norms over whole
projections stored as the flat vectors attn_q_norm [heads x head_dim] / attn_k_norm, RoPE on
rotated halves (no q/k permutation). llama.cpp fixes in code what a config could say otherwise:
head_dim is embed_dim / num_heads; with a sliding window, every 4th layer attends fully and the
others slide, turning plain RoPE at the file's base while the full layers turn the file's
scaling (YaRN: the attention factor 0.1 ln(factor) + 1, the ramp's ends floored and ceiled).
Its output projection is always a tensor of its own, so a tied model writes its embedding
there too.

Phi-3/4 (phi3). q, k and v as one attn_qkv [q rows; k rows; v rows], gate and up as one ffn_up
[gate rows; up rows], RoPE on rotated halves over rope.dimension_count (partial rotary) and
LongRoPE as the rope_factors_short / rope_factors_long tensors (divisors of the frequencies)
with the attention factor in rope.scaling.attn_factor; which set a run takes, llama.cpp decides
itself. head_dim is embed_dim / num_heads there.
"""

from __future__ import annotations

import math

import numpy as np

from distillax.errors import UserError
from distillax.models.config import TransformerConfig
from distillax.models.layers import rope_attention_factor


# ---- olmo2 ---------------------------------------------------------------------------------

def check_olmo2(config: TransformerConfig) -> None:
  """What llama.cpp's olmo2 would compute differently from this config, as one UserError."""
  if config.num_heads * config.head_dim != config.embed_dim:
    raise UserError(f"llama.cpp's olmo2 takes head_dim = embed_dim / num_heads = "
                    f"{config.embed_dim // config.num_heads}; head_dim={config.head_dim} cannot "
                    f"be stored (export it with --format hf)")
  n = config.num_layers
  sliding = config.sliding_window is not None and config.sliding_window < config.max_seq_len
  if sliding and config.local_layers() != [(i + 1) % 4 != 0 for i in range(n)]:
    raise UserError(f"llama.cpp's olmo2 slides three layers in four (every 4th attends fully; a "
                    f"GGUF cannot say otherwise) but this model's sliding layers are "
                    f"{[i for i, x in enumerate(config.local_layers()) if x]}; export it with "
                    f"--format hf, or derive the student from blocks in that pattern")
  local = config.rope_local_theta
  scaled = config.rope_scaling_factor is not None
  if sliding and (local not in (None, config.rope_theta) or local is None and scaled):
    raise UserError(f"llama.cpp's olmo2 turns its sliding layers unscaled at the full layers' "
                    f"base rope_theta={config.rope_theta}; rope_local_theta={local} (with "
                    f"rope_scaling_factor={config.rope_scaling_factor}) would run differently "
                    f"there: set rope_local_theta={config.rope_theta}")
  if config.rope_scaling_factor is None:
    return
  default = 0.1 * math.log(config.rope_scaling_factor) + 1.0
  factor = config.rope_attention_factor
  if not config.rope_yarn_truncate or factor is not None and abs(factor - default) > 1e-9:
    raise UserError(f"llama.cpp's YaRN scales cos/sin by 0.1 ln(factor) + 1 = {default:.6f} and "
                    f"floors/ceils its ramp; rope_attention_factor={factor}, rope_yarn_truncate="
                    f"{config.rope_yarn_truncate} would run differently there")


def add_olmo2_hparams(writer, config: TransformerConfig) -> None:
  """The sliding window (llama.cpp slides three layers in four); the full layers' YaRN keys are
  layout.py's, as for every architecture that reads YaRN."""
  if config.sliding_window is not None and any(config.local_layers()):
    writer.add_sliding_window(int(config.sliding_window))


def olmo2_tensors(config: TransformerConfig, rows: dict[str, np.ndarray]
                  ) -> list[tuple[tuple[str, ...], str, np.ndarray]]:
  """A tied model's output projection, which llama.cpp's olmo2 always reads as a tensor of
  its own: the embedding rows again (the same numbers, the same type)."""
  if not config.tie_embeddings:
    return []
  return [(("embedder/embedding",), "lm_head", rows["embedder/embedding"])]


# ---- phi3 ----------------------------------------------------------------------------------

def check_phi3(config: TransformerConfig) -> None:
  """What llama.cpp's phi3 would compute differently from this config, as one UserError."""
  if config.num_heads * config.head_dim != config.embed_dim:
    raise UserError(f"llama.cpp's phi3 takes head_dim = embed_dim / num_heads = "
                    f"{config.embed_dim // config.num_heads}; head_dim={config.head_dim} cannot "
                    f"be stored (export it with --format hf)")


def add_phi3_hparams(writer, config: TransformerConfig) -> None:
  """LongRoPE's original context and attention factor (its divisors are tensors)."""
  if config.rope_scaling_factor is not None:
    writer.add_rope_scaling_orig_ctx_len(int(config.rope_original_max_len))
    writer.add_rope_scaling_attn_factors(float(rope_attention_factor(config)))


# Phi-3/4: q, k and v as one attn_qkv, gate and up as one ffn_up (made by phi3_tensors).
PHI3_NAMES = {"attn/qkv": "attn_qkv.weight", "mlp/gate_up": "ffn_up.weight"}


def phi3_tensors(config: TransformerConfig, rows: dict[str, np.ndarray]
                 ) -> list[tuple[tuple[str, ...], str, np.ndarray]]:
  """Each layer's fused attn_qkv and ffn_up (gate rows first), as pseudo parameters
  'attn/qkv' / 'mlp/gate_up' gguf_layout names."""
  out = []
  for i in range(config.num_layers):
    p = f"layers/{i}/"
    qkv = np.concatenate([rows[p + "attn/q"], rows[p + "attn/k"], rows[p + "attn/v"]], axis=0)
    gate_up = np.concatenate([rows[p + "mlp/gate"], rows[p + "mlp/up"]], axis=0)
    out += [((p + "attn/q", p + "attn/k", p + "attn/v"), p + "attn/qkv", qkv),
            ((p + "mlp/gate", p + "mlp/up"), p + "mlp/gate_up", gate_up)]
  return out


def phi3_rope_factors(config: TransformerConfig) -> list[tuple[str, np.ndarray]]:
  """LongRoPE's divisors as llama.cpp's rope_factors_short / _long tensors (none without)."""
  if config.rope_scaling_factor is None:
    return []
  return [("rope_factors_short.weight", np.asarray(config.rope_short_factors, np.float32)),
          ("rope_factors_long.weight", np.asarray(config.rope_long_factors, np.float32))]
