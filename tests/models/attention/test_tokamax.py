"""model.attention_impl='tokamax' against the reference attention on CPU (tokamax's XLA path:
the masks, window, soft-cap, GQA head layout and scale distillax hands it, and its shard_map
under sharding rules), and what `choose` makes of it per platform. Its Mosaic GPU kernel is
lowered by tests/plan/test_target.py's H100 compile; it has not run on a GPU."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax import partitioning as pt
from distillax.errors import ConfigError
from distillax.models.attention import impl as attention_impl
from distillax.models.attention.layer import reference_attention
from distillax.models.attention.impl import AttentionNeeds, choose
from distillax.models.attention.tokamax import tokamax_attention
from distillax.models.config import GLOBAL_WINDOW
from distillax.models.presets import get_preset
from distillax.models.transformer import with_config
from tests.models.attention.test_impls import TRAIN, _both, _packed_segments, _qkv
from tests.support.models import random_model


def test_tiny_gemma2_model_matches_reference_logits_and_param_gradients():
  """One tiny Gemma 2 layer (GQA, soft-capped attention logits, a sliding window of 8 over 14
  tokens) over packed documents with padding."""
  base = random_model(get_preset("tiny_gemma").replace(num_layers=1, sliding_window_pattern=0),
                      seed=4)
  tokens = jnp.asarray([[5, 17, 200, 3, 9, 44, 12, 8, 8, 1, 2, 250, 0, 0],
                        [7, 7, 1, 90, 4, 4, 33, 2, 100, 6, 5, 18, 19, 20]], jnp.int32)
  segments = jnp.asarray([[1] * 9 + [2] * 3 + [0] * 2, [1] * 14], jnp.int32)
  positions = jnp.asarray([list(range(9)) + list(range(3)) + [0, 0], list(range(14))], jnp.int32)

  def run(impl):
    graphdef, state = nnx.split(with_config(base, attention_impl=impl))

    def loss(state):
      out = nnx.merge(graphdef, state)(tokens, positions_BxL=positions, segment_ids_BxL=segments)
      logp = jax.nn.log_softmax(out.logits_BxLxV)
      return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], axis=-1)), out.logits_BxLxV

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return logits, jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads))

  cfg = base.config
  assert cfg.attn_logit_softcap and cfg.sliding_window and cfg.num_heads > cfg.num_kv_heads
  want, want_grads = run("reference")
  with attention_impl.recorded_choices() as found:
    got, got_grads = run("tokamax")
  assert {impl for _, impl, _ in found} == {"tokamax"}, found
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert len(got_grads) == len(want_grads) > 8
  for (path, w), (_, g) in zip(want_grads, got_grads):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=jax.tree_util.keystr(path))


def test_under_sharding_rules_it_runs_per_shard_with_a_traced_window():
  """fsdp_tp on 4 x 2: a shard_map over batch and kv heads; a traced window picks among the
  model's windows; values and q/k/v gradients against the reference."""
  mesh = pt.create_mesh({"data": 4, "model": 2})
  rules = pt.rules_from_config({"strategy": "fsdp_tp"})
  B, L, K, G, H = 4, 24, 2, 2, 8
  q, k, v = _qkv(B, L, L, K, G, H, seed=5)
  seg = _packed_segments(B, L)
  idx = jnp.broadcast_to(jnp.arange(L), (B, L))
  common = dict(q_segment_BxL=seg, k_segment_BxS=seg, scale=0.3, softcap=None)
  window = jnp.asarray(5, jnp.int32)

  def tok(q, k, v):
    with pt.use_rules(mesh, rules):
      return tokamax_attention(q, k, v, window=window, windows=(5, GLOBAL_WINDOW), **common)

  ref = lambda q, k, v: reference_attention(q, k, v, q_index_BxL=idx, k_index_BxS=idx, window=5,
                                            **common)[0]
  with jax.set_mesh(mesh):
    (want, want_grads), (got, got_grads) = _both(jax.jit(ref), jax.jit(tok), q, k, v)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  for name, a, b in zip("qkv", got_grads, want_grads):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=f"d{name}")


def test_choose_tokamax_by_platform():
  assert choose("tokamax", "gpu", TRAIN) == ("tokamax",
                                             "as configured: Mosaic GPU flash attention")
  assert choose("tokamax", "cpu", TRAIN)[0] == "tokamax"
  # Probabilities and KV caches go where they always go.
  assert choose("tokamax", "gpu", AttentionNeeds(**{**TRAIN.__dict__, "probs": True}))[0] == (
      "reference")
  with pytest.raises(ConfigError, match=r"'tokamax' runs tokamax's GPU kernel; on a TPU use "
                                        r"'splash' or 'auto'"):
    choose("tokamax", "tpu", TRAIN)
  with pytest.raises(ConfigError, match="runs in bfloat16/float16, not float32"):
    choose("tokamax", "gpu", AttentionNeeds(**{**TRAIN.__dict__, "dtype": "float32"}))
  with pytest.raises(ConfigError, match="no attention sinks"):
    choose("tokamax", "gpu", AttentionNeeds(**{**TRAIN.__dict__, "sinks": True}))


def test_tokamax_not_installed_is_one_line_naming_the_extra(monkeypatch, capsys, tmp_path):
  from distillax.main import main
  monkeypatch.setitem(sys.modules, "tokamax", None)  # `import tokamax` raises ImportError
  code = main(["distillax", "train", "--workdir", str(tmp_path / "wd"), "--config",
               "distillax/configs/lm.py:tiny", "--config.model.attention_impl=tokamax"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1, err
  assert err[0].endswith("model.attention_impl='tokamax' needs the tokamax package (pip install "
                         "'distillax[tokamax]'); or set --config.model.attention_impl=auto"), err
  assert not (tmp_path / "wd").exists()
