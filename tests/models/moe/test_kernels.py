"""moe_impl='tokamax' against 'ragged' (values and gradients, with gpt-oss's biases and up
activation and with capacity drops), and its one line when tokamax is not installed. On CPU
tokamax runs its XLA path; its Triton kernel is compiled for an H100 by tests/plan/test_target.py
and its Mosaic TPU kernel needs a live TPU (models/moe/kernels.py)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.errors import ConfigError
from distillax.main import main
from distillax.models.moe import layer as moe
from distillax.models.moe import kernels as moe_kernels
from tests.test_main import LM

T, D, E, F, K = 9, 6, 4, 5, 2


def test_tokamax_dispatch_equals_ragged_in_values_and_gradients():
  """With gpt-oss's expert biases and clamped up activation, and capacity drops: every branch
  of the grouped matmul (the plain one runs in test_moe_parallel.py and the H100 plan test)."""
  rng = np.random.default_rng(0)
  arr = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  x, logits = arr(T, D), arr(T, E)
  logits = logits.at[:, 2].set(-50.0)  # expert 2 gets no token: an empty group
  gate, up, down = arr(E, D, F), arr(E, D, F), arr(E, F, D)
  biases = [arr(E, F), arr(E, F), arr(E, D)]
  up_act = lambda u: jnp.clip(u, -7.0, 7.0) + 1.0
  cotangent = arr(T, D)

  def loss(impl, x, logits, gate, up, down, biases):
    # Capacity 3 of each expert's assignments: some are dropped.
    routing = moe.with_capacity(moe.route(logits, K, "topk_softmax", False), 3, None)
    out = moe._DISPATCH[impl](x, routing, gate, up, down, jax.nn.silu, biases, up_act)
    return jnp.sum(out * cotangent)

  results = {impl: jax.jit(jax.value_and_grad(lambda *a, i=impl: loss(i, *a),
                                              argnums=(0, 1, 2, 3, 4, 5)))(
      x, logits, gate, up, down, biases) for impl in ("ragged", "tokamax")}
  (v_t, g_t), (v_r, g_r) = results["tokamax"], results["ragged"]
  np.testing.assert_allclose(v_t, v_r, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_t), jax.tree.leaves(g_r), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert float(jnp.abs(g_t[2][2]).max()) == 0.0  # the unused expert learns nothing


def test_tokamax_not_installed_is_one_line_naming_the_extra(monkeypatch, capsys, tmp_path):
  monkeypatch.setitem(sys.modules, "tokamax", None)  # `import tokamax` raises ImportError
  assert not moe_kernels.tokamax_installed()
  says = ("model.moe_impl='tokamax' needs the tokamax package (pip install "
          "'distillax[tokamax]'); or set --config.model.moe_impl=ragged")
  with pytest.raises(ConfigError) as raised:
    moe_kernels.tokamax_ragged_dot(jnp.ones((2, 3)), jnp.ones((1, 3, 2)),
                                   jnp.asarray([2], jnp.int32))
  assert str(raised.value) == says
  code = main(["distillax", "train", "--workdir", str(tmp_path / "wd"), "--config", f"{LM}:tiny",
               "--config.model.num_experts=4", "--config.model.moe_impl=tokamax"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and err[0].endswith(says), err
  assert not (tmp_path / "wd").exists()
