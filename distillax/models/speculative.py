"""Speculative decoding: a draft proposes k tokens, the target checks them in one forward.

Each round the draft (an EAGLE-3 head reading the target's hidden states, `HeadDraft`, or a
whole small model of the same tokenizer, `ModelDraft`) proposes d_1..d_k from its distributions
q_1..q_k; the target runs once over [last token, d_1..d_k] (k + 1 positions of its KV cache)
and gives p_0..p_k. Then:
  - greedy: d_i is accepted while it is the target's argmax p_{i-1}; the first mismatch is
    replaced by the target's argmax (the bonus token; after k accepted ones, argmax p_k). The
    output is the target's own greedy decode token for token (models/sampler.py), whatever the
    draft: the draft only decides how many tokens one target forward yields.
  - sampled (temperature > 0): the standard rejection rule (Leviathan et al. 2023; Chen et al.
    2023): d_i accepted with probability min(1, p(d_i) / q(d_i)); at the first rejection the
    bonus is drawn from norm(max(0, p - q)), after k accepted ones from p_k. Every emitted token
    is then distributed exactly as the target's own sampler would draw it (p: the target's
    logits with the sampler's temperature / top-k / top-p and padded-row mask); the draft draws
    from its softmax at the same temperature.
Both caches roll back by position: slots past a cache's end are never attended and are
overwritten before anything reads them (attention/layer.py KVCache; the head's cache likewise).

Rows are independent sequences: the whole decode is written for one row and vmapped, so a
"batch" is many single-sequence decodes (each row stops when it has its tokens; a finished row
waits for the others). There is no batching of one forward across rows with different
acceptance counts beyond that: the first version serves batch size 1 per sequence.
`proposals_B` (<= k, per row) limits how many of the k proposals a row may accept: a row with
proposals j behaves exactly as a decode with k = j (the proposals past j are never looked at),
so one compiled program measures acceptance at 1..k proposed tokens (`distillax eval --draft`).

Targets whose state cannot roll back by position (Gated DeltaNet's recurrent state) are refused.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from distillax.errors import UserError
from distillax.models.attention.layer import KVCache
from distillax.models.eagle3 import Eagle3Head, aux_features
from distillax.models.sampler import SamplingConfig, filter_logits, mask_padded_ids, right_align
from distillax.models.transformer import Transformer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpeculativeOutput:
  """tokens_BxT (pad_id after a stop), lengths_B (tokens kept, the stop included), rounds_B
  (target forwards after the prefill), accepted_B (draft tokens accepted over all rounds)."""

  tokens_BxT: jax.Array
  lengths_B: jax.Array
  rounds_B: jax.Array
  accepted_B: jax.Array

  def acceptance_length_B(self) -> jax.Array:
    """Tokens emitted per target forward of a round: (accepted + one bonus per round) / rounds."""
    return (self.accepted_B + self.rounds_B) / jnp.maximum(self.rounds_B, 1)


def _target_probs(logits_NxV, cfg: SamplingConfig):
  """The distributions the target's own sampler draws from (float32, rows sum to 1)."""
  logits_NxV = mask_padded_ids(logits_NxV, cfg.vocab_limit)
  return jax.nn.softmax(filter_logits(logits_NxV, cfg), axis=-1)


def _pick(logits_V, key, cfg: SamplingConfig):
  """The target's first token after the prompt, as its sampler picks it."""
  logits_V = mask_padded_ids(logits_V[None], cfg.vocab_limit)[0]
  if cfg.temperature == 0:
    return jnp.argmax(logits_V).astype(jnp.int32)
  return jax.random.categorical(key, filter_logits(logits_V[None], cfg)[0]).astype(jnp.int32)


class HeadDraft:
  """An EAGLE-3 head over the target's hidden states. Its cache slot s holds the pass that reads
  the target's feature at slot s and the token at slot s + 1."""

  wants_hidden = True

  def __init__(self, head: Eagle3Head):
    self.head = head

  def init(self, length: int, pad, tokens_P, aux_PxA, first):
    cache = self.head.cache_zeros(1, length)
    next_P = jnp.concatenate([tokens_P[1:], first[None]])  # slot s pairs with token s + 1
    return self.accept({"cache": cache, "h": None, "slot": 0, "pad": pad}, aux_PxA, next_P,
                       tokens_P.shape[0] - 1, 0)

  def propose(self, state, k: int, key, cfg: SamplingConfig, vocab: int):
    head, h, cache, slot = self.head, state["h"], state["cache"], state["slot"]
    d2t = head.d2t[...]
    tokens, qs = [], []
    for i in range(k):
      logits_Vd = head.logits(h[None, None])[0, 0]
      if cfg.temperature == 0:  # greedy acceptance reads the proposals only
        choice = jnp.argmax(logits_Vd)
      else:
        q_Vd = jax.nn.softmax(logits_Vd / cfg.temperature)
        choice = jax.random.categorical(jax.random.fold_in(key, i), logits_Vd / cfg.temperature)
        qs.append(jnp.zeros((vocab,), jnp.float32).at[d2t].set(q_Vd))
      tokens.append(d2t[choice])
      if i + 1 < k:
        out, cache = head.extend(cache, slot + 1 + i, tokens[-1][None, None], h[None, None],
                                 valid_from=state["pad"])
        h = out[0, 0]
    return jnp.stack(tokens), jnp.stack(qs) if qs else None, state

  def accept(self, state, aux_CxA, emitted_C, n, start):
    fused = self.head.fuse(aux_CxA[None])
    out, cache = self.head.extend(state["cache"], start, emitted_C[None], fused,
                                  valid_from=state["pad"])
    return {**state, "cache": cache, "h": out[0, n], "slot": start + n}


class ModelDraft:
  """A whole small model of the target's tokenizer: it reads tokens only. It feeds its k
  proposals back one at a time (k + 1 forwards a round, the last writing d_k to its cache for
  the round where all k are accepted), and rolls its cache back to the accepted tokens."""

  wants_hidden = False

  def __init__(self, model: Transformer):
    _check_rolls_back(model, "draft")
    self.model = model

  def init(self, length: int, pad, tokens_P, aux, first):
    del aux
    P = tokens_P.shape[0]
    slots = jnp.arange(P, dtype=jnp.int32)
    cache = KVCache.zeros(self.model.config, 1, length)
    out = self.model(tokens_P[None], positions_BxL=jnp.maximum(slots - pad, 0)[None],
                     segment_ids_BxL=(slots >= pad).astype(jnp.int32)[None], cache=cache,
                     return_logits=False)
    return {"cache": out.cache, "pad": pad, "first": first}

  def propose(self, state, k: int, key, cfg: SamplingConfig, vocab: int):
    cache, pad = state["cache"], state["pad"]
    token = state["first"]
    tokens, qs = [], []
    for i in range(k + 1):
      slot = cache.end_index
      out = self.model(token[None, None], positions_BxL=(slot - pad)[None, None],
                       segment_ids_BxL=jnp.ones((1, 1), jnp.int32), cache=cache)
      cache = out.cache
      if i == k:
        break
      logits_V = _to_width(mask_padded_ids(out.logits_BxLxV[:, 0], cfg.vocab_limit)[0], vocab)
      if cfg.temperature == 0:  # greedy acceptance reads the proposals only
        token = jnp.argmax(logits_V).astype(jnp.int32)
      else:
        qs.append(jax.nn.softmax(logits_V / cfg.temperature))
        token = jax.random.categorical(jax.random.fold_in(key, i),
                                       logits_V / cfg.temperature).astype(jnp.int32)
      tokens.append(token)
    return jnp.stack(tokens), jnp.stack(qs) if qs else None, {**state, "cache": cache}

  def accept(self, state, aux, emitted_C, n, start):
    del aux
    cache = dataclasses.replace(state["cache"], end_index=start + n + 1)
    return {**state, "cache": cache, "first": emitted_C[n]}


def _to_width(logits_V, vocab: int):
  """A draft model's logits over the target's `vocab` rows (rows it lacks: -inf)."""
  if logits_V.shape[0] >= vocab:
    return logits_V[:vocab]
  return jnp.concatenate([logits_V, jnp.full((vocab - logits_V.shape[0],), -jnp.inf)])


def _check_rolls_back(model: Transformer, role: str):
  if model.config.num_linear_layers:
    raise UserError(f"speculative decoding rolls the {role}'s cache back by position; its "
                    f"linear-attention layers keep a recurrent state that cannot roll back: use "
                    f"a {role} without Gated DeltaNet layers")


def _accept(p_KxV, q_KxV, d_K, proposals, key, cfg: SamplingConfig):
  """(accepted count n, bonus token) of one round; p_KxV has k + 1 rows (greedy: the target's
  logits; q_KxV is then None)."""
  k = d_K.shape[0]
  if cfg.temperature == 0:
    choice_K1 = jnp.argmax(p_KxV, axis=-1).astype(jnp.int32)
    ok_K = d_K == choice_K1[:k]
  else:
    u_K = jax.random.uniform(jax.random.fold_in(key, 1), (k,))
    p_d = jnp.take_along_axis(p_KxV[:k], d_K[:, None], -1)[:, 0]
    q_d = jnp.take_along_axis(q_KxV, d_K[:, None], -1)[:, 0]
    ok_K = u_K * q_d < p_d  # u < min(1, p / q), q(d) > 0 where the draft drew d
  n = jnp.minimum(jnp.sum(jnp.cumprod(ok_K.astype(jnp.int32))), proposals)
  if cfg.temperature == 0:
    return n, choice_K1[n]
  residual = jnp.maximum(p_KxV[n] - q_KxV[jnp.minimum(n, k - 1)], 0.0)
  use_residual = (n < proposals) & (jnp.sum(residual) > 0)
  dist = jnp.where(use_residual, residual / jnp.maximum(jnp.sum(residual), 1e-30), p_KxV[n])
  bonus = jax.random.categorical(jax.random.fold_in(key, 2), jnp.log(dist))
  return n, bonus.astype(jnp.int32)


def _decode_row(target: Transformer, draft, k: int, cfg: SamplingConfig, aux_layers,
                prompt_P, length, key, proposals):
  """One sequence's speculative decode (vmapped over rows by `speculative_decode`)."""
  P = prompt_P.shape[0]
  T = cfg.max_new_tokens
  size = P + T + k + 1
  prompt_1xP, seg_1xP, pos_1xP = right_align(prompt_P[None], length[None])
  pad = P - length
  cache = KVCache.zeros(target.config, 1, size)
  want = draft.wants_hidden
  out = target(prompt_1xP, positions_BxL=pos_1xP, segment_ids_BxL=seg_1xP, cache=cache,
               return_logits=False, return_hidden_states=want)
  first = _pick(target.logits_from_hidden(out.final_hidden_BxLxD[0, -1]), key, cfg)
  aux = aux_features(out.hidden_states, aux_layers)[0] if want else None
  vocab = target.config.vocab_size
  state = {"t_cache": out.cache, "d": draft.init(size, pad, prompt_1xP[0], aux, first),
           "last": first, "out": jnp.zeros((T + k + 1,), jnp.int32).at[0].set(first),
           "count": jnp.int32(1), "rounds": jnp.int32(0), "accepted": jnp.int32(0),
           "done": _stops(first[None], cfg)[0]}

  def round_(state):
    rkey = jax.random.fold_in(key, state["rounds"] + 1)
    d_K, q_KxV, d_state = draft.propose(state["d"], k, jax.random.fold_in(rkey, 0), cfg, vocab)
    start = state["t_cache"].end_index
    tokens = jnp.concatenate([state["last"][None], d_K])[None]
    positions = (start - pad + jnp.arange(k + 1, dtype=jnp.int32))[None]
    out = target(tokens, positions_BxL=positions, segment_ids_BxL=jnp.ones((1, k + 1), jnp.int32),
                 cache=state["t_cache"], return_hidden_states=want)
    p_KxV = _target_probs(out.logits_BxLxV[0], cfg) if cfg.temperature else \
        mask_padded_ids(out.logits_BxLxV[0], cfg.vocab_limit)
    n, bonus = _accept(p_KxV, q_KxV, d_K, proposals, jax.random.fold_in(rkey, 1), cfg)
    i = jnp.arange(k + 1)
    emitted = jnp.where(i < n, jnp.concatenate([d_K, d_K[-1:]]), bonus).astype(jnp.int32)
    aux = aux_features(out.hidden_states, aux_layers)[0] if want else None
    stopped = jnp.any(_stops(emitted, cfg) & (i <= n))
    return {"t_cache": dataclasses.replace(out.cache, end_index=start + n + 1),
            "d": draft.accept(d_state, aux, emitted, n, start), "last": bonus,
            "out": jax.lax.dynamic_update_slice(state["out"], emitted, (state["count"],)),
            "count": state["count"] + n + 1, "rounds": state["rounds"] + 1,
            "accepted": state["accepted"] + n, "done": state["done"] | stopped}

  state = jax.lax.while_loop(lambda s: (s["count"] < T) & ~s["done"], round_, state)
  tokens = state["out"][:T]
  stop_T = _stops(tokens, cfg)
  kept = jnp.where(jnp.any(stop_T), jnp.argmax(stop_T) + 1, T)
  tokens = jnp.where(jnp.arange(T) < kept, tokens, cfg.pad_id)
  return SpeculativeOutput(tokens, kept.astype(jnp.int32), state["rounds"], state["accepted"])


def _stops(tokens, cfg: SamplingConfig):
  stops = ([] if cfg.eos_id is None else [cfg.eos_id]) + list(cfg.stop_ids)
  out = jnp.zeros(tokens.shape, bool)
  for s in stops:
    out = out | (tokens == s)
  return out


def speculative_decode(target: Transformer, draft, prompt_BxP, lengths_B, keys_B,
                       cfg: SamplingConfig, num_proposals: int, proposals_B=None,
                       aux_layers=()) -> SpeculativeOutput:
  """Continues each prompt (right-padded, real lengths `lengths_B`) by cfg.max_new_tokens tokens
  with `draft` (HeadDraft or ModelDraft) proposing `num_proposals` a round; `keys_B`: one PRNG
  key per row; `proposals_B`: per-row limit (<= num_proposals; default all). A pure function,
  callable under jit."""
  _check_rolls_back(target, "target")
  if num_proposals < 1:
    raise UserError(f"num_proposals={num_proposals} must be >= 1")
  if isinstance(draft, HeadDraft):
    aux_layers = draft.head.config.aux_layers
  B = prompt_BxP.shape[0]
  if proposals_B is None:
    proposals_B = jnp.full((B,), num_proposals, jnp.int32)
  row = lambda p, n, key, j: _decode_row(target, draft, num_proposals, cfg, aux_layers, p, n,
                                         key, j)
  return jax.vmap(row)(prompt_BxP, lengths_B, keys_B, proposals_B)
