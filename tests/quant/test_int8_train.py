"""int8 QAT with int8 matmuls (qat.int8_matmul, quant/int8_train.py): each matmul is the numpy
int8 matmul bit for bit with the fake-quant gradient, the model's matmuls are s8 x s8 -> s32
dots in the compiled step, and its logits and gradients stay those of fake-quant int8 QAT."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.errors import ConfigError
from distillax.quant import QuantConfig, quantize_for_training
from distillax.quant.int8_train import int8_trained_einsum
from tests.quant.helpers import tokens
from tests.quant.test_int8 import LAYOUTS, np_int8, np_int8_matmul
from tests.support.models import FAN_IN, TINY, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

INT8 = {"rules": [("", None, None, None), (".*", "int8", "int8", None)]}


@pytest.mark.parametrize("spec,x_shape,w_shape,x_reduce,w_reduce", LAYOUTS[:3])
def test_the_int8_matmul_is_numpys_with_the_fake_quant_gradient(spec, x_shape, w_shape,
                                                                x_reduce, w_reduce):
  rng = np.random.default_rng(0)
  x = rng.normal(size=x_shape).astype(np.float32)
  w = rng.normal(size=w_shape).astype(np.float32)
  ins, out = spec.split("->")
  f = jax.jit(lambda x, w: int8_trained_einsum(tuple(ins.split(",")), out, 0, "float32", False,
                                                     x, w))
  y = f(jnp.asarray(x), jnp.asarray(w))
  np.testing.assert_array_equal(np.asarray(y), np_int8_matmul(spec, x, w, x_reduce, w_reduce)[0])
  # Straight through: the gradient of the product of the two rounded grids.
  r = rng.normal(size=y.shape).astype(np.float32)
  g_x, g_w = jax.grad(lambda x, w: jnp.sum(f(x, w) * r), argnums=(0, 1))(jnp.asarray(x),
                                                                        jnp.asarray(w))
  (cx, sx), (cw, sw) = np_int8(x, x_reduce), np_int8(w, w_reduce)
  xq, wq = cx.astype(np.float64) * sx, cw.astype(np.float64) * sw
  xt, wt = ins.split(",")
  np.testing.assert_allclose(np.asarray(g_x), np.einsum(f"{out},{wt}->{xt}", r, wq), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(g_w), np.einsum(f"{xt},{out}->{wt}", xq, r), rtol=1e-5,
                             atol=1e-5)


def _onto(scale, term, target):
  """A scale over `term` (1 on the axes it reduced) with its other axes moved onto `target`'s
  places, 1 on the rest."""
  kept = "".join(c for c in term if c in target)
  squeezed = scale.reshape([scale.shape[term.index(c)] for c in kept])
  order = "".join(c for c in target if c in kept)
  moved = np.einsum(f"{kept}->{order}", squeezed)
  return moved.reshape([moved.shape[order.index(c)] if c in order else 1 for c in target])


def np_int8_backward(spec, x, w, x_reduce, w_reduce, g):
  """(dx, dw) of int8_backward written out in numpy: g times the weight's channel scales
  rounded per token, its codes times the weight's codes; g times the input's token scales
  rounded per channel, the input's codes times its codes; int64 sums rescaled in float32."""
  ins, out = spec.split("->")
  xt, wt = ins.split(",")
  (cx, sx), (cw, sw) = np_int8(x, x_reduce), np_int8(w, w_reduce)
  channels = [out.index(c) for c in out if c in wt and c not in xt]
  tokens = [out.index(c) for c in out if c in xt and c not in wt]
  cg, sg = np_int8(g * _onto(sw, wt, out), channels)
  dx = np.einsum(f"{out},{wt}->{xt}", cg.astype(np.int64), cw.astype(np.int64))
  ch, sh = np_int8(g * _onto(sx, xt, out), tokens)
  dw = np.einsum(f"{xt},{out}->{wt}", cx.astype(np.int64), ch.astype(np.int64))
  return dx.astype(np.float32) * _onto(sg, out, xt), dw.astype(np.float32) * _onto(sh, out, wt)


@pytest.mark.parametrize("spec,x_shape,w_shape,x_reduce,w_reduce", LAYOUTS[:3])
def test_int8_backward_is_numpys_int8_gradient_near_the_straight_through_one(
    spec, x_shape, w_shape, x_reduce, w_reduce):
  rng = np.random.default_rng(1)
  x = rng.normal(size=x_shape).astype(np.float32)
  w = rng.normal(size=w_shape).astype(np.float32)
  ins, out = spec.split("->")
  terms = tuple(ins.split(","))
  grads = {}
  for int8_backward in (False, True):
    f = jax.jit(lambda x, w, b=int8_backward: int8_trained_einsum(terms, out, 0, "float32", b,
                                                                   x, w))
    y = f(jnp.asarray(x), jnp.asarray(w))
    r = rng.normal(size=y.shape).astype(np.float32) if not grads else r
    grads[int8_backward] = jax.grad(lambda x, w: jnp.sum(f(x, w) * r), argnums=(0, 1))(
        jnp.asarray(x), jnp.asarray(w))
  want_x, want_w = np_int8_backward(spec, x, w, x_reduce, w_reduce, r)
  got_x, got_w = (np.asarray(a) for a in grads[True])
  np.testing.assert_allclose(got_x, want_x, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got_w, want_w, rtol=1e-6, atol=1e-6)
  # One more rounding of the cotangent, to nearest: a few tenths of a percent of the
  # straight-through gradient, not a bias.
  for got, ste in zip((got_x, got_w), grads[False]):
    ste = np.asarray(ste)
    assert 0 < np.linalg.norm(got - ste) < 0.01 * np.linalg.norm(ste)


@pytest.fixture(scope="module")
def scanned():
  return random_model(TINY.replace(scan_layers=True, remat="full"), seed=0, init=FAN_IN)


def _step(model, tok):
  """(logits, gradients, the compiled step's HLO text) of a mean log-likelihood."""
  graphdef, state = nnx.split(model)

  def loss(s):
    logits = nnx.merge(graphdef, s)(tok).logits_BxLxV.astype(jnp.float32)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits
  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (_, logits), grads = step(state)
  return np.asarray(logits), grads, step.lower(state).compile().as_text()


def _int8_dots(hlo: str) -> list[str]:
  """The compiled program's products of two s8 operands (dot, or a TPU's convolution): each
  operand's type read from its definition in the same computation, a parameter of the
  computation's header or an instruction (compiled HLO prints operands by name only)."""
  found, types = [], {}
  for line in hlo.splitlines():
    header = re.match(r"\s*(?:ENTRY )?%\S+ \((.*)\) -> .*\{\s*$", line)
    if header:  # a computation starts: its parameters' types
      types = dict(re.findall(r"([\w.\-]+): (\w+)\[", header.group(1)))
      continue
    defined = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[", line)
    if defined:
      types[defined.group(1)] = defined.group(2)
    product = re.search(r" (?:dot|convolution)\(%([\w.\-]+), %([\w.\-]+)\)", line)
    if product and types.get(product.group(1)) == types.get(product.group(2)) == "s8":
      found.append(line.strip())
  return found


def test_int8_matmul_qat_multiplies_int8_codes_and_trains_like_fake_quant(scanned):
  tok = tokens(2, 16, TINY.vocab_size)
  logits, grads, hlo = _step(quantize_for_training(scanned, {**INT8, "int8_matmul": True}), tok)
  fake_logits, fake_grads, fake_hlo = _step(quantize_for_training(scanned, INT8), tok)
  # The scanned layer's 7 projections, in the forward and in the remat's recompute.
  assert len(_int8_dots(hlo)) >= 7 and not _int8_dots(fake_hlo)
  # Each matmul is fake-quant's up to float rounding (the test above), but a next layer's
  # activation rounding turns a last-bit difference at a half-way point into a whole step: the
  # two stay far closer to each other than to the full-precision model.
  plain_logits, plain_grads, _ = _step(scanned, tok)
  rms = lambda d: float(np.sqrt(np.mean(np.square(d))))
  assert rms(logits - fake_logits) < 0.25 * rms(fake_logits - plain_logits)
  for (path, a), (_, b), (_, p) in zip(jax.tree_util.tree_leaves_with_path(grads),
                                       jax.tree_util.tree_leaves_with_path(fake_grads),
                                       jax.tree_util.tree_leaves_with_path(plain_grads)):
    a, b, p = (np.asarray(v).ravel() for v in (a, b, p))
    assert rms(a - b) < 0.25 * rms(b - p), jax.tree_util.keystr(path)


def test_int8_backward_runs_every_matmul_of_the_step_in_int8(scanned):
  tok = tokens(2, 16, TINY.vocab_size)
  _, grads, hlo = _step(quantize_for_training(scanned, {**INT8, "int8_matmul": True,
                                                        "int8_backward": True}), tok)
  forward_only = _step(quantize_for_training(scanned, {**INT8, "int8_matmul": True}), tok)
  # The layer's 7 projections: forward, the remat's recompute, and now dx and dw.
  assert len(_int8_dots(hlo)) >= len(_int8_dots(forward_only[2])) + 14
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(grads),
                               jax.tree_util.tree_leaves_with_path(forward_only[1])):
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    assert np.linalg.norm(a - b) < 0.05 * np.linalg.norm(b), jax.tree_util.keystr(path)


def test_int8_matmul_needs_an_int8_rule_and_round_trips():
  with pytest.raises(ConfigError, match="int8_matmul=True but no qat rule"):
    QuantConfig.from_config({"rules": [(".*", "int4", "int8", None)], "int8_matmul": True})
  qcfg = QuantConfig.from_config({**INT8, "int8_matmul": True})
  assert QuantConfig.from_config(qcfg.to_dict()) == qcfg
  assert all(stage.int8_matmul for _, stage in qcfg.stages())
  with pytest.raises(ConfigError, match="int8_backward=True needs qat.int8_matmul=True"):
    QuantConfig.from_config({**INT8, "int8_backward": True})
  both = QuantConfig.from_config({**INT8, "int8_matmul": True, "int8_backward": True})
  assert QuantConfig.from_config(both.to_dict()) == both
  assert all(stage.int8_backward for _, stage in both.stages())
