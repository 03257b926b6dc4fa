"""How closely a quantized model follows its full-precision twin, token by token (llama.cpp's
`perplexity --kl-divergence` figures and torchao's recovery), as pure functions.

A training loss says how well a quantized student predicts the data; these say how far it moved
from the model it was quantized from, which is what quantization alone is to blame for:

- per-token KL(P_fp || P_quant) of the next-token distributions (mean, p99, max over the real
  tokens: the tail is where quantization breaks generations);
- same-top-1: the share of positions where both models' most likely token is the same
  (llama.cpp's "same top p");
- top-p agreement: the share where the quantized model's most likely token lies inside the
  full-precision model's nucleus (its smallest set of tokens of mass >= p), i.e. a token a top-p
  sampler of the full model could have drawn;
- the perplexity ratio PPL_quant / PPL_fp over the same tokens;
- recovery = (PTQ - QAT) / (PTQ - fp) of a loss: the share of post-training quantization's
  degradation that quantization-aware training won back.

Per-token values are JAX (any [N, V] logits, under jit or not); the summaries are NumPy over the
tokens a mask keeps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from distillax.errors import UserError


@jax.jit
def per_token_kl(fp_logits_NxV: jax.Array, quant_logits_NxV: jax.Array) -> jax.Array:
  """KL(P_fp || P_quant) per position, in nats, from the two models' logits."""
  logp_NxV = jax.nn.log_softmax(fp_logits_NxV.astype(jnp.float32), axis=-1)
  logq_NxV = jax.nn.log_softmax(quant_logits_NxV.astype(jnp.float32), axis=-1)
  return jnp.sum(jnp.exp(logp_NxV) * (logp_NxV - logq_NxV), axis=-1)


@jax.jit
def same_top1(fp_logits_NxV: jax.Array, quant_logits_NxV: jax.Array) -> jax.Array:
  """Per position: both models' most likely token is the same."""
  return jnp.argmax(fp_logits_NxV, axis=-1) == jnp.argmax(quant_logits_NxV, axis=-1)


@functools.partial(jax.jit, static_argnums=2)
def in_top_p(fp_logits_NxV: jax.Array, quant_logits_NxV: jax.Array, p: float) -> jax.Array:
  """Per position: the quantized model's most likely token is inside the full-precision model's
  top-p nucleus (tokens taken by falling probability until their mass reaches p; the token that
  crosses p is inside)."""
  if not 0 < p <= 1:
    raise UserError(f"top_p={p} must be in (0, 1]")
  probs_NxV = jax.nn.softmax(fp_logits_NxV.astype(jnp.float32), axis=-1)
  token_N = jnp.argmax(quant_logits_NxV, axis=-1)
  own_N = jnp.take_along_axis(probs_NxV, token_N[:, None], -1)[:, 0]
  # Mass of the tokens ranked strictly before this one (ties broken by id, as a sort would).
  ids_V = jnp.arange(probs_NxV.shape[-1])
  before_NxV = (probs_NxV > own_N[:, None]) | ((probs_NxV == own_N[:, None]) &
                                               (ids_V[None] < token_N[:, None]))
  mass_before_N = jnp.sum(jnp.where(before_NxV, probs_NxV, 0.0), axis=-1)
  return mass_before_N < p


@jax.jit
def target_nll(logits_NxV: jax.Array, targets_N: jax.Array) -> jax.Array:
  """-log P(target) per position."""
  logp_NxV = jax.nn.log_softmax(logits_NxV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp_NxV, targets_N[:, None], -1)[:, 0]


@jax.jit
def target_nll_pair(quant_logits_NxV: jax.Array, fp_logits_NxV: jax.Array,
                    targets_N: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`target_nll` of both models' logits through one computation over the two stacked: the
  same code rounds both alike, so a model against itself has a perplexity ratio of exactly 1
  (two separate `target_nll`s inside one jit are two fusions, which XLA's CPU backend may
  vectorise differently: 0.9999999944 on an AVX-512 host)."""
  both_2xN = target_nll(jnp.stack([quant_logits_NxV, fp_logits_NxV]).reshape(
      -1, quant_logits_NxV.shape[-1]), jnp.concatenate([targets_N, targets_N]))
  n = targets_N.shape[0]
  return both_2xN[:n], both_2xN[n:]


def _kept(values_N, mask_N) -> np.ndarray:
  values_N = np.asarray(values_N, np.float64).reshape(-1)
  kept = values_N if mask_N is None else values_N[np.asarray(mask_N, bool).reshape(-1)]
  if kept.size == 0:
    raise UserError("no tokens to compare: the mask keeps none")
  return kept


def kl_summary(kl_N, mask_N=None) -> dict[str, float]:
  """kl_mean, kl_p99 (linear interpolation, NumPy's default) and kl_max over the kept tokens."""
  kept = _kept(kl_N, mask_N)
  return {"kl_mean": float(kept.mean()), "kl_p99": float(np.percentile(kept, 99)),
          "kl_max": float(kept.max())}


def share(flags_N, mask_N=None) -> float:
  """The share of kept positions where `flags_N` holds."""
  return float(_kept(flags_N, mask_N).mean())


def perplexity_ratio(quant_nll_N, fp_nll_N, mask_N=None) -> float:
  """PPL_quant / PPL_fp = exp(mean NLL_quant - mean NLL_fp) over the same kept tokens."""
  return float(np.exp(_kept(quant_nll_N, mask_N).mean() - _kept(fp_nll_N, mask_N).mean()))


def recovery(ptq_loss: float, qat_loss: float, fp_loss: float) -> float:
  """(PTQ - QAT) / (PTQ - fp): 1 when QAT is as good as full precision, 0 when no better than
  PTQ. Refused when PTQ is not worse than full precision (nothing to recover)."""
  gap = float(ptq_loss) - float(fp_loss)
  if not gap > 0:
    raise UserError(f"recovery needs a PTQ loss above the full-precision one (PTQ {ptq_loss}, "
                    f"fp {fp_loss}): quantization lost nothing to recover")
  return (float(ptq_loss) - float(qat_loss)) / gap


def fidelity(fp_logits_NxV, quant_logits_NxV, targets_N, mask_N=None, *,
             top_p: float = 0.9) -> dict[str, float]:
  """Every per-token figure of a quantized model against its full-precision twin over the
  same tokens, summarised over the kept positions."""
  fp, quant = jnp.asarray(fp_logits_NxV), jnp.asarray(quant_logits_NxV)
  targets = jnp.asarray(targets_N, jnp.int32)
  out = kl_summary(per_token_kl(fp, quant), mask_N)
  out["same_top1"] = share(same_top1(fp, quant), mask_N)
  out[f"in_top_p{top_p:g}"] = share(in_top_p(fp, quant, top_p), mask_N)
  out["perplexity_ratio"] = perplexity_ratio(*target_nll_pair(quant, fp, targets), mask_N)
  return out
