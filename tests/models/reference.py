"""A plain-numpy decoder written from the published model descriptions, independent of the
flax code: loops over heads, explicit masks, float64. Tests compare the model against it."""

from __future__ import annotations

import math

import numpy as np


def _rms_norm(x, scale, eps, plus_one):
  x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return x * ((1.0 + scale) if plus_one else scale)


def _inv_freq(cfg):
  d = cfg.head_dim
  inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  if cfg.rope_scaling_factor is None:
    return inv
  f, lo, hi, old = (cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                    cfg.rope_original_max_len)
  out = []
  for w in inv:
    wavelen = 2 * math.pi / w
    if wavelen < old / hi:
      out.append(w)
    elif wavelen > old / lo:
      out.append(w / f)
    else:
      s = (old / wavelen - lo) / (hi - lo)
      out.append((1 - s) * w / f + s * w)
  return np.array(out)


def _rope(x_LxHxK, positions_L, cfg):
  ang = positions_L[:, None].astype(np.float64) * _inv_freq(cfg)[None, :]
  cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]
  sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]
  half = x_LxHxK.shape[-1] // 2
  rotated = np.concatenate([-x_LxHxK[..., half:], x_LxHxK[..., :half]], axis=-1)
  return x_LxHxK * cos + rotated * sin


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _projection(h_LxD, attn, name, cfg):
  """One of q/k/v per head: (L, heads, head_dim), with Qwen 2's bias and Qwen 3's head norm."""
  y = np.einsum("ld,dhk->lhk", h_LxD, attn[name])
  if cfg.qkv_bias:
    y = y + attn[f"{name}_bias"]
  if cfg.qk_norm and name != "v":
    y = _rms_norm(y, attn[f"{name}_norm"]["scale"], cfg.norm_eps, cfg.norm_scale_plus_one)
  return y


def forward(cfg, layers, embedding, final_norm, lm_head, tokens_L, positions_L=None,
            segments_L=None):
  """Logits (L, V) of one sequence. `layers` is a list of per-layer dicts of numpy arrays."""
  L = len(tokens_L)
  positions_L = np.arange(L) if positions_L is None else np.asarray(positions_L)
  segments_L = np.ones(L, int) if segments_L is None else np.asarray(segments_L)
  x = embedding[tokens_L].astype(np.float64)
  if cfg.scale_embeddings:
    x = x * math.sqrt(cfg.embed_dim)
  norm = lambda h, s: _rms_norm(h, s, cfg.norm_eps, cfg.norm_scale_plus_one)
  for i, p in enumerate(layers):
    h = norm(x, p["attn_norm"]["scale"])
    q, k, v = (_projection(h, p["attn"], name, cfg) for name in "qkv")
    q, k = _rope(q, positions_L, cfg), _rope(k, positions_L, cfg)
    scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
    out = np.zeros((L, cfg.num_heads, cfg.head_dim))
    window = cfg.sliding_window if cfg.layer_uses_sliding_window(i) else None
    for head in range(cfg.num_heads):
      kv = head // (cfg.num_heads // cfg.num_kv_heads)
      for a in range(L):
        allowed = [b for b in range(a + 1) if segments_L[b] == segments_L[a]
                   and (window is None or a - b < window)]
        s = np.array([q[a, head] @ k[b, kv] * scale for b in allowed])
        if cfg.attn_logit_softcap:
          s = cfg.attn_logit_softcap * np.tanh(s / cfg.attn_logit_softcap)
        w = np.exp(s - s.max())
        w /= w.sum()
        out[a, head] = sum(wi * v[b, kv] for wi, b in zip(w, allowed))
    h = np.einsum("lhk,hkd->ld", out, p["attn"]["o"])
    if cfg.use_post_norms:
      h = norm(h, p["post_attn_norm"]["scale"])
    x = x + h
    h = norm(x, p["mlp_norm"]["scale"])
    g, u = h @ p["mlp"]["gate"], h @ p["mlp"]["up"]
    act = g / (1 + np.exp(-g)) if cfg.mlp_activation == "swiglu" else _gelu_tanh(g)
    h = (act * u) @ p["mlp"]["down"]
    if cfg.use_post_norms:
      h = norm(h, p["post_mlp_norm"]["scale"])
    x = x + h
  x = norm(x, final_norm)
  logits = x @ (embedding.T if lm_head is None else lm_head)
  if cfg.final_logit_softcap:
    logits = cfg.final_logit_softcap * np.tanh(logits / cfg.final_logit_softcap)
  return logits
