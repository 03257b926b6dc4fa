"""The decoder against an independent numpy reference, plus layout/remat/mask/cache invariants."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.models.attention import impl as attention_impl
from distillax.models.attention.layer import KVCache
from distillax.models.presets import get_preset
from distillax.models.transformer import ModelOutput, with_config, with_layer_layout
from tests.models import reference
from tests.support.models import forward, numpy_params, random_model

CONFIGS = {
    "tiny": get_preset("tiny"),
    "tiny_gemma": get_preset("tiny_gemma"),
    # Llama 3.1 RoPE scaling with a short original context, so all three frequency bands occur.
    "tiny_llama3_rope": get_preset("tiny", rope_scaling_factor=4.0, rope_original_max_len=64,
                                   tie_embeddings=True),
    "tiny_mqa_global_scalar": get_preset("tiny_gemma", num_kv_heads=1, sliding_window_pattern=0,
                                         query_pre_attn_scalar=None, attn_logit_softcap=None),
    # Qwen 2's q/k/v biases, Qwen 3's q/k head norms and Mistral's every-layer window at once.
    "tiny_qwen_mistral": get_preset("tiny", qkv_bias=True, qk_norm=True, sliding_window=5,
                                    sliding_window_pattern=0),
}


def _model(name, seed=0, **changes):
  config = CONFIGS[name] if name in CONFIGS else get_preset(name)
  return random_model(config.replace(**changes), seed=seed)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_numpy_reference_with_packing(name):
  model = _model(name)
  cfg = model.config
  # Two packed documents (positions restart) and trailing padding.
  tokens = np.array([5, 17, 200, 3, 9, 44, 12, 8, 8, 1, 2, 250, 0, 0], np.int32)
  segments = np.array([1] * 9 + [2] * 3 + [0] * 2, np.int32)
  positions = np.concatenate([np.arange(9), np.arange(3), np.arange(2)]).astype(np.int32)
  out = forward(model, tokens[None], positions_BxL=positions[None], segment_ids_BxL=segments[None])
  want = reference.forward(cfg, *numpy_params(model), tokens, positions, segments)
  real = segments > 0
  np.testing.assert_allclose(np.asarray(out.logits_BxLxV[0])[real], want[real], atol=2e-4,
                             rtol=1e-4)


@pytest.mark.parametrize("name", ["tiny", "tiny_gemma"])
def test_packed_equals_separate_and_padding_is_invisible(name):
  model = _model(name, seed=1)
  a = jnp.array([[3, 1, 4, 1, 5, 9, 2]], jnp.int32)
  b = jnp.array([[6, 5, 3, 5]], jnp.int32)
  packed = jnp.concatenate([a, b, jnp.zeros((1, 3), jnp.int32)], axis=1)
  seg = jnp.array([[1] * 7 + [2] * 4 + [0] * 3])
  pos = jnp.array([list(range(7)) + list(range(4)) + [0, 0, 0]])
  logits = forward(model, packed, pos, seg).logits_BxLxV
  np.testing.assert_allclose(logits[:, :7], forward(model, a).logits_BxLxV, atol=1e-5)
  np.testing.assert_allclose(logits[:, 7:11], forward(model, b).logits_BxLxV, atol=1e-5)
  assert np.all(np.isfinite(np.asarray(logits)))


@pytest.mark.parametrize("name", ["tiny", "tiny_gemma", "tiny_qwen_mistral"])
def test_scan_layout_gives_same_outputs(name):
  unrolled = _model(name, seed=2)
  scanned = with_layer_layout(unrolled, scan_layers=True)
  assert scanned.layers.attn.q.shape[0] == unrolled.config.num_layers
  tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 256)
  kw = dict(return_hidden_states=True, return_attention=True)
  u, s = forward(unrolled, tokens, **kw), forward(scanned, tokens, **kw)
  for field in ("logits_BxLxV", "final_hidden_BxLxD", "hidden_states", "attention_probs"):
    np.testing.assert_allclose(getattr(s, field), getattr(u, field), atol=2e-5, err_msg=field)
  back = with_layer_layout(scanned, scan_layers=False)
  # Without probabilities requested both run the same (blockwise) path: bit-identical.
  np.testing.assert_array_equal(forward(back, tokens).logits_BxLxV,
                                forward(unrolled, tokens).logits_BxLxV)


def _grads_and_flops(model, tokens):
  """(loss, grads, compiled flops) of a next-token loss."""
  graphdef, state = nnx.split(model)

  def loss(state):
    logits = nnx.merge(graphdef, state)(tokens[:, :-1]).logits_BxLxV
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

  compiled = jax.jit(jax.value_and_grad(loss)).lower(state).compile()
  cost = compiled.cost_analysis()
  value, grads = compiled(state)
  return value, grads, (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.mark.parametrize("name,scan,policies", [
    ("tiny_gemma", False, ("full", "save_dots")),
    ("tiny_gemma", True, ("full", "save_dots_no_batch")),
    ("tiny_qwen_mistral", True, ("full",)),
    # models/remat.py's policies on the blockwise path (a custom VJP naming its residuals).
    ("tiny", True, ("full", "save_attention", "save_attention_qkv", "save_attention_up",
                    "save_attention_mlp")),
    ("tiny", False, ("full", "save_attention", "save_attention_qkv")),
    # The MLP names inside the experts' grouped matmuls, and the dispatch's gathered rows.
    ("tiny_moe", True, ("full", "save_attention", "save_attention_mlp")),
])
def test_remat_policies_give_identical_gradients(name, scan, policies):
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, 256)
  base = with_layer_layout(_model(name, seed=3), scan)
  loss0, g0, flops0 = _grads_and_flops(base, tokens)
  flops = {}
  for policy in policies:
    loss1, g1, flops[policy] = _grads_and_flops(with_config(base, remat=policy), tokens)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g1, g0)
  if "full" in flops:  # the forward really is recomputed in the backward pass
    assert flops["full"] > flops0
  if "save_attention_qkv" in flops:  # the attention forward, then the q, k, v projections, kept
    assert flops["full"] > flops["save_attention"] > flops["save_attention_qkv"] > flops0
  if "save_attention_mlp" in flops:  # the attention forward, then one or two MLP matrices, kept
    assert (flops["full"] > flops["save_attention"] > flops.get("save_attention_up", np.inf)
            > flops["save_attention_mlp"] > flops0) or (
                "save_attention_up" not in flops
                and flops["full"] > flops["save_attention"] > flops["save_attention_mlp"] > flops0)


@pytest.mark.parametrize("name", ["tiny", "tiny_gemma"])
def test_intermediates_and_hidden_to_logits(name):
  model = _model(name, seed=5)
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 256)
  seg = jnp.array([[1] * 6 + [2] * 6, [1] * 10 + [0] * 2])
  plain = forward(model, tokens, segment_ids_BxL=seg)
  assert isinstance(plain, ModelOutput)
  assert plain.hidden_states is None and plain.attention_probs is None and plain.cache is None
  out = forward(model, tokens, segment_ids_BxL=seg, return_hidden_states=True,
                return_attention=True)
  cfg = model.config
  assert out.hidden_states.shape == (cfg.num_layers + 1, 2, 12, cfg.embed_dim)
  assert out.attention_probs.shape == (cfg.num_layers, 2, cfg.num_heads, 12, 12)
  # Asking for probabilities runs the reference attention path; plain calls run blockwise
  # (model.attention_impl='auto' on CPU): the two agree to fp32 rounding.
  np.testing.assert_allclose(out.logits_BxLxV, plain.logits_BxLxV, atol=1e-5)
  # final hidden = final norm of the last block output; logits = projection of final hidden
  np.testing.assert_allclose(model.final_norm(out.hidden_states[-1]), out.final_hidden_BxLxD,
                             atol=1e-6)
  np.testing.assert_allclose(model.logits_from_hidden(out.final_hidden_BxLxD[:, 3:5]),
                             out.logits_BxLxV[:, 3:5], atol=1e-5)
  # probabilities: rows sum to one, nothing above the diagonal or across segments
  probs = np.asarray(out.attention_probs)
  np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
  segn = np.asarray(seg)
  allowed = (np.tril(np.ones((12, 12), bool))[None]
             & (segn[:, :, None] == segn[:, None, :]))[None, :, None]
  assert np.all(probs[~np.broadcast_to(allowed, probs.shape)] == 0)
  if cfg.sliding_window:  # layer 0 is local: nothing sliding_window or more tokens back
    far = np.tril(np.ones((12, 12), bool), -cfg.sliding_window)
    assert np.all(probs[0][:, :, far] == 0) and np.any(probs[1][:, :, far] > 0)


@pytest.mark.parametrize("name,scan", [("tiny", False), ("tiny_gemma", True),
                                       ("tiny_qwen_mistral", False)])
def test_kv_cache_prefill_then_decode_matches_full_forward(name, scan):
  model = with_layer_layout(_model(name, seed=6), scan)
  tokens = jax.random.randint(jax.random.key(3), (2, 14), 0, 256)
  full = forward(model, tokens).logits_BxLxV
  cache = KVCache.zeros(model.config, batch=2, length=16)
  out = forward(model, tokens[:, :9], cache=cache)
  pieces, cache = [out.logits_BxLxV], out.cache
  assert int(cache.end_index) == 9
  for t in range(9, 14):
    out = forward(model, tokens[:, t:t + 1], cache=cache)
    pieces.append(out.logits_BxLxV)
    cache = out.cache
  np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=2e-5)


@pytest.mark.parametrize("name,scan", [("tiny", True), ("tiny_qwen_mistral", False)])
def test_a_prefill_into_an_empty_cache_attends_its_own_tokens_and_a_later_one_the_cache(name,
                                                                                        scan):
  """A fresh cache's prefill runs the uncached attention a training forward runs (blockwise on
  CPU: its tokens only, not every slot of the cache); a second multi-token call, into the cache
  that prefill left, attends the cache. Both against one uncached forward of all the tokens."""
  model = with_layer_layout(_model(name, seed=7), scan)
  tokens = jax.random.randint(jax.random.key(5), (2, 13), 0, 256)
  full = forward(model, tokens).logits_BxLxV
  cache = KVCache.zeros(model.config, batch=2, length=16)
  assert cache.empty
  with attention_impl.recorded_choices() as first_choices:
    first = forward(model, tokens[:, :8], cache=cache)
  assert not first.cache.empty
  with attention_impl.recorded_choices() as later_choices:
    later = forward(model, tokens[:, 8:], cache=first.cache)
  assert {why for _, _, why in first_choices}.isdisjoint(
      {why for _, _, why in later_choices}), (first_choices, later_choices)
  assert all("KV-cache prefill" in why for _, _, why in later_choices), later_choices
  got = jnp.concatenate([first.logits_BxLxV, later.logits_BxLxV], axis=1)
  np.testing.assert_allclose(got, full, atol=2e-5)


def test_compute_dtype_bfloat16_close_to_float32():
  model = _model("tiny_gemma", seed=8)
  tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, 256)
  ref = forward(model, tokens).logits_BxLxV
  low = forward(with_config(model, dtype="bfloat16"), tokens).logits_BxLxV
  assert low.dtype == jnp.float32  # logits come out in float32 for the losses
  err = float(jnp.max(jnp.abs(low - ref)))
  assert 0 < err < 0.05 * float(jnp.max(jnp.abs(ref)))


def test_with_config_rejects_shape_changes():
  from distillax.errors import ConfigError
  with pytest.raises(ConfigError, match="shapes"):
    with_config(_model("tiny"), embed_dim=32)
