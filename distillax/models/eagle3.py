"""The EAGLE-3 draft head: one decoder layer that reads a frozen target's own hidden states.

A target served with speculative decoding runs a small draft that proposes the next few tokens,
which the target then checks in one forward. EAGLE-3's draft is not a small LM: it reads the
target's residual stream at a low, a middle and a high layer (their concatenation, 3D wide,
fused to D by one linear map `fc`), pairs it with the embedding of the next token (the first
layer's attention projections take that 2D-wide input), runs one decoder layer of the target's
family, a final norm and an LM head over a (possibly reduced) draft vocabulary. Its own output
hidden state stands in for the target's fused feature at the next position, so it can run a
few steps ahead of the target alone.

Layer ids count as vLLM and speculators count them: id i is the residual stream entering block
i (0-based), i.e. distillax's `hidden_states[i]` (index 0: the embedding output).

The draft vocabulary is the `draft_vocab_size` target ids `d2t_ids` (ascending); the head's
logits are over those, and a draft id j stands for target id d2t_ids[j]. The embedding table is
the target's (frozen, whole vocabulary), the LM head starts as the target's output layer's
columns of those ids (frozen unless trained: `Eagle3Config.train_lm_head`).

The decoder layer is Llama's (Qwen 3's when the target normalises queries and keys): what
speculators' eagle3 format and vLLM load. Weights are named so that export maps one to one.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from distillax.errors import ConfigError
from distillax.models.config import TransformerConfig
from distillax.models.layers import MLP, RMSNorm, apply_rope, normal_param, rope_sin_cos


class TargetCopy(nnx.Variable):
  """A weight copied from the target and kept frozen (not an nnx.Param: the optimizer never
  sees it, the checkpoint stores it with the head's other frozen parts)."""


class VocabMap(nnx.Variable):
  """The draft vocabulary's target ids (int32, ascending): frozen, part of the checkpoint."""


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
  """EAGLE-3's low, middle and high layer: vLLM's and speculators' default (2, L // 2, L - 3)
  where those are three distinct blocks' outputs; in a shallower target, three distinct ones
  spread over its depth (speculators refuses repeated ids)."""
  L = num_layers
  ids = (2, L // 2, L - 3)
  if len(set(ids)) == 3 and min(ids) >= 1:
    return ids
  if L >= 4:
    return tuple(int(round(1 + i * (L - 2) / 2)) for i in range(3))
  return tuple(range(max(0, L - 2), L + 1))


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
  """The head's shape: the target's layer (one decoder layer of its family) and the draft's."""

  layer: TransformerConfig  # the target's config with num_layers=1: widths, RoPE, norms, dtypes
  aux_layers: tuple[int, ...]  # target hidden-state indices fused by fc (low, middle, high)
  draft_vocab_size: int  # rows of the head's LM head (<= the target's vocab_size)
  train_lm_head: bool = False  # False: the LM head stays the target's columns, as EAGLE-3 does

  @classmethod
  def for_target(cls, target: TransformerConfig, aux_layers=(), draft_vocab_size: int = 0,
                 train_lm_head: bool = False) -> "Eagle3Config":
    """The head for `target`; aux_layers () = default_aux_layers, draft_vocab_size 0 = the
    target's whole vocabulary. Refused in one line where EAGLE-3 cannot read the target."""
    aux = tuple(int(i) for i in aux_layers) or default_aux_layers(target.num_layers)
    if len(aux) < 1 or len(set(aux)) != len(aux) or any(
        not 0 <= i <= target.num_layers for i in aux):
      raise ConfigError(f"draft.aux_layers={aux} must be distinct hidden-state indices "
                        f"0..{target.num_layers} of the target (id i: the stream entering "
                        f"block i), e.g. "
                        f"{default_aux_layers(target.num_layers)}, each once")
    vocab = int(draft_vocab_size) or target.vocab_size
    if not 1 <= vocab <= target.vocab_size:
      raise ConfigError(f"draft.vocab_size={draft_vocab_size} must be between 1 and the "
                        f"target's vocab_size {target.vocab_size} (0 = all of it)")
    if target.kv_lora_rank or target.num_linear_layers or target.per_layer_input_dim:
      raise ConfigError("the EAGLE-3 head's layer is a Llama/Qwen 3 attention layer; this "
                        "target's attention (latent, linear or per-layer inputs) has no such "
                        "layer to copy the shape of: use a Llama, Qwen or Mistral target")
    layer = target.replace(num_layers=1, scan_layers=False, remat="none", num_experts=0,
                           sliding_window=None, layer_types=None, attn_logit_softcap=None)
    return cls(layer, aux, vocab, bool(train_lm_head))

  @property
  def target_vocab_size(self) -> int:
    return self.layer.vocab_size

  @property
  def reduced(self) -> bool:
    return self.draft_vocab_size != self.layer.vocab_size


def _attend(q_BxLxHxK, k_BxSxGxK, v_BxSxGxK, mask_BxLxS, scale, diag=()):
  """Softmax attention (float32 scores; grouped-query heads) over keys `k` where `mask`, plus
  `diag`: (k, v) pairs of extra keys each query sees at its own position only (training-time
  test's earlier steps)."""
  B, L, H, K = q_BxLxHxK.shape
  G = k_BxSxGxK.shape[2]
  q = q_BxLxHxK.reshape(B, L, G, H // G, K).astype(jnp.float32) * scale
  s_BxGxRxLxS = jnp.einsum("BLGRK,BSGK->BGRLS", q, k_BxSxGxK.astype(jnp.float32))
  s_BxGxRxLxS = jnp.where(mask_BxLxS[:, None, None], s_BxGxRxLxS, -jnp.inf)
  extra = [jnp.einsum("BLGRK,BLGK->BGRL", q, k.astype(jnp.float32))[..., None] for k, _ in diag]
  p = jax.nn.softmax(jnp.concatenate([s_BxGxRxLxS] + extra, axis=-1), axis=-1)
  S = k_BxSxGxK.shape[1]
  out = jnp.einsum("BGRLS,BSGK->BLGRK", p[..., :S], v_BxSxGxK.astype(jnp.float32))
  for i, (_, v) in enumerate(diag):
    out = out + jnp.einsum("BGRL,BLGK->BLGRK", p[..., S + i], v.astype(jnp.float32))
  return out.reshape(B, L, H, K)


class Eagle3Head(nnx.Module):
  """fc, the first (only) decoder layer with 2D-wide q/k/v, final norm, LM head; the target's
  embedding (frozen) and the draft vocabulary's map."""

  def __init__(self, config: Eagle3Config, *, rngs: nnx.Rngs):
    self.config = cfg = config
    c = cfg.layer
    D, H, G, K, pd = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.jnp_param_dtype
    A = len(cfg.aux_layers)
    self.fc = normal_param(rngs, (A * D, D), (A * D) ** -0.5, pd, (None, "embed"))
    self.embedding = TargetCopy(jnp.zeros((c.vocab_size, D), pd), logical_axes=("vocab", "embed"))
    self.input_norm = RMSNorm(c)  # the next token's embedding (speculators: input_layernorm)
    self.hidden_norm = RMSNorm(c)  # the fused feature
    self.q = normal_param(rngs, (2 * D, H, K), (2 * D) ** -0.5, pd, (None, "heads", "head_dim"))
    self.k = normal_param(rngs, (2 * D, G, K), (2 * D) ** -0.5, pd, (None, "kv_heads", "head_dim"))
    self.v = normal_param(rngs, (2 * D, G, K), (2 * D) ** -0.5, pd, (None, "kv_heads", "head_dim"))
    self.o = normal_param(rngs, (H, K, D), (H * K) ** -0.5 / 2, pd, ("heads", "head_dim", "embed"))
    qk = lambda axis: RMSNorm(c, dim=K, logical_axes=("head_dim",)) if c.qk_norm else None
    self.q_norm, self.k_norm = qk("heads"), qk("kv_heads")
    self.mlp_norm = RMSNorm(c)  # speculators: post_attention_layernorm
    self.mlp = MLP(c, rngs=rngs)
    self.final_norm = RMSNorm(c)
    head = (nnx.Param if cfg.train_lm_head else TargetCopy)
    self.lm_head = head(jnp.zeros((D, cfg.draft_vocab_size), pd), logical_axes=("embed", "vocab"))
    self.d2t = VocabMap(jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32), logical_axes=(None,))

  # ---- pieces -----------------------------------------------------------------------------

  def fuse(self, aux_BxLxAD: jax.Array) -> jax.Array:
    """The target's concatenated layers (A*D wide) fused to D."""
    dt = self.config.layer.jnp_dtype
    return jnp.einsum("BLE,ED->BLD", aux_BxLxAD.astype(dt), self.fc[...].astype(dt))

  def embed(self, tokens_BxL: jax.Array) -> jax.Array:
    """The target's embedding rows of target ids (no scaling: the raw table)."""
    return jnp.take(self.embedding[...], tokens_BxL, axis=0).astype(self.config.layer.jnp_dtype)

  def qkv(self, tokens_BxL, hidden_BxLxD, positions_BxL):
    """(q, k, v) with RoPE at `positions`, and the residual (the fused feature) of one pass."""
    c, dt = self.config.layer, self.config.layer.jnp_dtype
    x_BxLx2D = jnp.concatenate([self.input_norm(self.embed(tokens_BxL)).astype(dt),
                                self.hidden_norm(hidden_BxLxD).astype(dt)], axis=-1)
    sin_cos = rope_sin_cos(positions_BxL, c)
    out = []
    for w, norm in ((self.q, self.q_norm), (self.k, self.k_norm), (self.v, None)):
      y = jnp.einsum("BLE,EHK->BLHK", x_BxLx2D, w[...].astype(dt))
      if norm is not None:
        y = norm(y).astype(dt)
      out.append(y if w is self.v else apply_rope(y, *sin_cos))
    return (*out, hidden_BxLxD)

  def finish(self, attended_BxLxHxK, residual_BxLxD):
    """The layer's output (the draft's hidden state): o-projection, residual, MLP, residual."""
    dt = self.config.layer.jnp_dtype
    h = residual_BxLxD + jnp.einsum("BLHK,HKD->BLD", attended_BxLxHxK.astype(dt),
                                    self.o[...].astype(dt))
    return h + self.mlp(self.mlp_norm(h).astype(dt))

  def logits(self, hidden_BxLxD) -> jax.Array:
    """Float32 logits over the draft vocabulary."""
    dt = self.config.layer.jnp_dtype
    return jnp.einsum("BLD,DV->BLV", self.final_norm(hidden_BxLxD).astype(dt),
                      self.lm_head[...].astype(dt), preferred_element_type=jnp.float32)

  @property
  def scale(self) -> float:
    c = self.config.layer
    return (c.query_pre_attn_scalar or c.head_dim) ** -0.5

  # ---- training-time test -----------------------------------------------------------------

  def ttt_hidden(self, aux_BxLxAD, tokens_TxBxL, positions_BxL, segment_ids_BxL):
    """The head's hidden state at each of T training-time-test steps, (T, B, L, D).

    Step j at position t reads the fused target feature (step 0) or the head's own step j-1
    output there (later steps), with the token tokens_TxBxL[j] (the one j places past the
    position's next token), at RoPE position positions + 1 + j. Its query attends to step 0's
    keys causally within the document, and to each later step's key at its own position only:
    what the draft sees at inference, j tokens ahead of the last verified one."""
    T = tokens_TxBxL.shape[0]
    seg = segment_ids_BxL
    L = seg.shape[1]
    causal = jnp.arange(L)[:, None] >= jnp.arange(L)[None, :]
    mask_BxLxL = causal[None] & (seg[:, :, None] == seg[:, None, :]) | jnp.eye(L, dtype=bool)[None]
    hidden = self.fuse(aux_BxLxAD)
    keys, diag, outs = None, [], []
    for j in range(T):
      q, k, v, residual = self.qkv(tokens_TxBxL[j], hidden, positions_BxL + 1 + j)
      if j == 0:
        keys = (k, v)
      else:
        diag.append((k, v))
      attended = _attend(q, *keys, mask_BxLxL, self.scale, diag)
      hidden = self.finish(attended, residual)
      outs.append(hidden)
    return jnp.stack(outs)

  # ---- decoding with a cache --------------------------------------------------------------

  def cache_zeros(self, batch: int, length: int):
    """Keys and values of `length` slots: slot s holds the pass at RoPE position s + 1."""
    c = self.config.layer
    shape = (batch, length, c.num_kv_heads, c.head_dim)
    return jnp.zeros(shape, c.jnp_dtype), jnp.zeros(shape, c.jnp_dtype)

  def extend(self, cache, start, tokens_BxC, hidden_BxCxD, valid_from=0):
    """Writes C passes at slots start.. (positions start+1..) and runs them: each sees the
    slots from `valid_from` (a left-padded prompt's first real slot) to itself; slots past are
    never read (a rolled-back draft's stale entries are overwritten before anything attends to
    them). Returns (hidden, cache)."""
    B, C = tokens_BxC.shape
    positions_BxC = start + 1 + jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
    q, k, v, residual = self.qkv(tokens_BxC, hidden_BxCxD, positions_BxC)
    ck = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), (0, start, 0, 0))
    cv = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), (0, start, 0, 0))
    S = ck.shape[1]
    slots_S = jnp.arange(S)[None, :]
    mask_CxS = (slots_S <= (start + jnp.arange(C))[:, None]) & (slots_S >= valid_from)
    mask_BxCxS = jnp.broadcast_to(mask_CxS, (B, C, S))
    hidden = self.finish(_attend(q, ck, cv, mask_BxCxS, self.scale), residual)
    return hidden, (ck, cv)


def aux_features(hidden_states_NxBxLxD: jax.Array, aux_layers) -> jax.Array:
  """The target layers the head fuses, concatenated on features: (B, L, A*D)."""
  return jnp.concatenate([hidden_states_NxBxLxD[i] for i in aux_layers], axis=-1)


def draft_to_target(head: Eagle3Head, draft_ids: jax.Array) -> jax.Array:
  """Target ids of draft-vocabulary ids."""
  return jnp.take(head.d2t[...], draft_ids, axis=0)
