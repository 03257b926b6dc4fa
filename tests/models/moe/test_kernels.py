"""The grouped matmul behind moe_impl 'ragged' and 'tokamax' against the dense reference (values
and gradients, with gpt-oss's biases and up activation and with capacity drops), and tokamax's
one line when it is not installed. On CPU tokamax runs its XLA path; its Triton kernel is
compiled for an H100 by tests/plan/test_target.py; its Mosaic TPU kernel runs on a live TPU in
the chip run (scripts/chip_tests.sh, tests/support/chip.py)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.errors import ConfigError
from distillax.main import main
from distillax.models.moe import layer as moe
from distillax.models.moe import kernels as moe_kernels
from tests.support import chip
from tests.test_main import LM

# CPU: tiny shapes (tokamax's XLA path); the chip run (scripts/chip_tests.sh): shapes tokamax's
# Mosaic kernel takes (every matmul dimension >= 128; 512 rows) and the TPU's own ragged_dot.
# (tokens T, embed D, experts E, mlp F, top-k K, capacity per expert)
SHAPES = dict(cpu=(9, 6, 4, 5, 2, 3), tpu=(256, 256, 8, 512, 2, 48))


def _moe_arrays(dtype):
  """x, router logits (float32, expert 2 never chosen: an empty group), gate, up, down, gpt-oss's
  biases (float32 only: in bfloat16 their gradients are sums of T bf16 terms, the adds'
  rounding, not the grouped matmul's) and a cotangent for the output; the matmul operands
  rounded to `dtype`."""
  T, D, E, F, _, _ = chip.pick(**SHAPES)
  rng = np.random.default_rng(0)
  arr = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  x, logits = arr(T, D), arr(T, E).at[:, 2].set(-50.0)
  gate, up, down = arr(E, D, F) * D ** -0.5, arr(E, D, F) * D ** -0.5, arr(E, F, D) * F ** -0.5
  biases = [arr(E, F), arr(E, F), arr(E, D)]
  cast = lambda a: a.astype(dtype)
  biases = biases if dtype == jnp.float32 else None
  return cast(x), logits, cast(gate), cast(up), cast(down), biases, arr(T, D)


def _dispatch_and_grads(impl, args, cotangent):
  """The experts' output and the gradients of x, logits, gate, up, down and the biases, with
  gpt-oss's clamped up activation and capacity drops; and the jitted function."""
  _, _, _, _, K, capacity = chip.pick(**SHAPES)
  up_act = lambda u: jnp.clip(u, -7.0, 7.0) + 1.0

  def loss(x, logits, gate, up, down, biases):
    routing = moe.with_capacity(moe.route(logits, K, "topk_softmax", False), capacity, None)
    out = moe._DISPATCH[impl](x, routing, gate, up, down, jax.nn.silu, biases, up_act)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))
  (_, out), grads = fn(*args)
  return out, grads, fn


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["ragged", "tokamax"])
def test_grouped_matmul_equals_dense_in_values_and_gradients(impl, dtype):
  """moe_impl 'ragged' (jax.lax.ragged_dot) and 'tokamax' (its Mosaic kernel on a TPU) against
  the dense reference, with gpt-oss's expert biases and clamped up activation, capacity drops and
  an empty group: the output and every gradient. float32 against the dense dispatch; bfloat16
  against the float32 dense dispatch of the same rounded operands (chip.assert_bf16; tolerances
  and what they leave: tests/support/chip.py)."""
  *args, cotangent = _moe_arrays(jnp.dtype(dtype))
  with chip.precision(dtype):
    out, grads, fn = _dispatch_and_grads(impl, args, cotangent)
    if chip.on_tpu() and impl == "tokamax":  # its Mosaic kernel took the calls, not its XLA path
      mosaic_calls = fn.lower(*args).as_text().count("@tpu_custom_call(")
      assert mosaic_calls >= 3, f"tokamax ran {mosaic_calls} Mosaic grouped matmuls, not 3 or more"
  f32_args = jax.tree.map(lambda a: a.astype(jnp.float32), args)
  want_out, want_grads, _ = _dispatch_and_grads("dense", f32_args, cotangent)
  got_all, want_all = [out, *jax.tree.leaves(grads)], [want_out, *jax.tree.leaves(want_grads)]
  names = ["out", "x", "logits", "gate", "up", "down", "gate_b", "up_b", "down_b"]
  assert len(got_all) == len(want_all) == (9 if dtype == "float32" else 6)
  for name, got, want in zip(names, got_all, want_all):
    chip.assert_close(np.asarray(jnp.asarray(got, jnp.float32)), want, dtype=dtype,
                      rtol=1e-5 if name == "out" else 1e-4, atol=1e-5, err_msg=name)
  assert float(jnp.abs(grads[2][2]).max()) == 0.0  # the unused expert learns nothing
  assert float(jnp.abs(grads[2]).max()) > 0.0


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


def _tpu_like_ragged_dot():
  """jax.lax.ragged_dot with what a TPU leaves in the rows past the groups' total: NaN there in
  the output and in the input gradient (its transpose is another grouped matmul over the same
  groups), as the v5e's showed (benchmarks/results/tpu/chip_tests_call1.json); the CPU's own
  kernel leaves zeros, which hides a missing mask."""
  real = jax.lax.ragged_dot

  def past_groups_nan(rows_NxX, group_sizes_E):
    tail_Nx1 = (jnp.arange(rows_NxX.shape[0]) >= jnp.sum(group_sizes_E))[:, None]
    return jnp.where(tail_Nx1, jnp.nan, rows_NxX)

  @jax.custom_vjp
  def ragged_dot(lhs, rhs, group_sizes_E):
    return past_groups_nan(real(lhs, rhs, group_sizes_E), group_sizes_E)

  def forward(lhs, rhs, group_sizes_E):
    return ragged_dot(lhs, rhs, group_sizes_E), (lhs, rhs, group_sizes_E)

  def backward(saved, g_NxF):
    lhs, rhs, group_sizes_E = saved
    _, vjp = jax.vjp(lambda a, b: real(a, b, group_sizes_E), lhs, rhs)
    d_lhs, d_rhs = vjp(g_NxF)
    return past_groups_nan(d_lhs, group_sizes_E), d_rhs, None

  ragged_dot.defvjp(forward, backward)
  return lambda lhs, rhs, group_sizes, **_: ragged_dot(lhs, rhs, group_sizes)


def test_rows_a_tpu_leaves_undefined_never_reach_values_or_gradients(monkeypatch):
  """The default dispatch ('ragged') with capacity drops over a grouped matmul that leaves NaN
  in the rows past the groups (as a TPU does): the output and every gradient still equal the
  dense reference. Before the rows were masked, the ragged dispatch's x gradient was NaN in
  bf16 and 12% off in float32 on a v5e."""
  *args, cotangent = _moe_arrays(jnp.float32)
  want_out, want_grads, _ = _dispatch_and_grads("dense", args, cotangent)
  monkeypatch.setattr(jax.lax, "ragged_dot", _tpu_like_ragged_dot())
  out, grads, _ = _dispatch_and_grads("ragged", args, cotangent)
  names = ["out", "x", "logits", "gate", "up", "down", "gate_b", "up_b", "down_b"]
  for name, got, want in zip(names, [out, *jax.tree.leaves(grads)],
                             [want_out, *jax.tree.leaves(want_grads)], strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
