"""The int8 teacher (quant/int8_model.py): every projection matmul an int8 x int8 -> int32 dot.

Each matmul layout the models use is checked against a numpy int8 reference written from the
formulas (codes, scales and every output bit), and against the float matmul within the error
that the rounding bounds: each operand is off by at most half a step of its own scale, so

    |y_int8 - x @ w| <= (s_w / 2) * sum_k |x^_k| + (s_x / 2) * sum_k |w_k|   (per output).

Through a whole model the rounding adds up in ways no closed bound captures, so the logits are
compared with the float32 model next to the bf16 model's own rounding, measured on the same
tiny models (a relative RMS error; see test_logits_stay_near_the_full_precision_model).
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from distillax.errors import ConfigError, UserError
from distillax.models.init import abstract_model
from distillax.models.presets import get_preset
from distillax.quant import apply_lora, quantize_for_training
from distillax.quant.int8_model import Int8Weight, abstract_int8_model, int8_model, state_bytes
from tests.quant.helpers import tokens
from tests.support.models import FAN_IN, PEAKED, TINY, logits, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ---- numpy reference ---------------------------------------------------------------------------

def np_int8(v, reduce_axes):
  """(codes, scales): scale = absmax / 127.5 per kept index (1 for an all-zero row), codes
  round-half-even of v times the scale's reciprocal, clipped to [-128, 127]; float32 math."""
  v = np.asarray(v, np.float32)
  absmax = np.max(np.abs(v), axis=tuple(reduce_axes), keepdims=True)
  scale = (absmax * np.float32(1 / 127.5)).astype(np.float32)
  scale = np.where(scale < np.sqrt(np.finfo(np.float32).tiny), np.float32(1), scale)
  inverse = (np.float32(1) / scale).astype(np.float32)
  return np.clip(np.round(v * inverse), -128, 127).astype(np.int8), scale


def np_int8_matmul(spec, x, w, x_reduce, w_reduce):
  """(int8 result rescaled in float32, the bound above) of einsum `spec` (x first)."""
  cx, sx = np_int8(x, x_reduce)
  cw, sw = np_int8(w, w_reduce)
  acc = np.einsum(spec, cx.astype(np.int64), cw.astype(np.int64))
  ins, out = spec.split("->")
  xt, wt = ins.split(",")
  def onto(scale, term):  # the scale's kept axes moved to their output places, 1 elsewhere
    kept = "".join(c for c in term if c in out)
    order = "".join(c for c in out if c in kept)
    s = np.einsum(f"{kept}->{order}", scale.reshape([scale.shape[term.index(c)] for c in kept]))
    return s.reshape([s.shape[order.index(c)] if c in order else 1 for c in out])
  y = (acc.astype(np.float32) * onto(sx, xt)) * onto(sw, wt)
  x_hat = cx.astype(np.float64) * sx
  bound = (np.einsum(spec, np.abs(x_hat), np.ones_like(w, np.float64)) * onto(sw, wt) / 2
           + np.einsum(spec, np.ones_like(x, np.float64), np.abs(w.astype(np.float64)))
           * onto(sx, xt) / 2)
  return y, bound


def int8_weight(w, contract_axes):
  codes, scale = np_int8(w, contract_axes)
  return Int8Weight(jnp.asarray(codes), jnp.asarray(scale), logical_axes=(None,) * w.ndim,
                    dtype=jnp.float32, contract_axes=contract_axes, ndim=w.ndim, name="w")


# (model einsum, x shape, w shape, x's contracted axes, w's contracted axes)
LAYOUTS = [
    ("BLD,DF->BLF", (2, 5, 48), (48, 40), (2,), (0,)),  # MLP gate/up/down
    ("BLD,DNH->BLNH", (2, 5, 48), (48, 4, 8), (2,), (0,)),  # attention q/k/v
    ("BLHK,HKD->BLD", (2, 5, 4, 8), (4, 8, 48), (2, 3), (0, 1)),  # attention o
    ("TD,EDF->TEF", (6, 48), (3, 48, 16), (1,), (1,)),  # dense-dispatch experts
    ("...D,VD->...V", (2, 5, 48), (40, 48), (2,), (1,)),  # tied embedding as the head
]


@pytest.mark.parametrize("spec,x_shape,w_shape,x_reduce,w_reduce", LAYOUTS)
def test_each_matmul_layout_is_the_numpy_int8_matmul_bit_for_bit(spec, x_shape, w_shape,
                                                                 x_reduce, w_reduce):
  rng = np.random.default_rng(0)
  x = rng.normal(size=x_shape).astype(np.float32)
  x[0, 0] = 0.0  # an all-zero row (token): scale 1, codes 0
  w = rng.normal(size=w_shape).astype(np.float32)
  weight = int8_weight(w, w_reduce)
  # The head reads the weight second, as the model does, with fp32 logits from bf16 inputs.
  if spec.startswith("..."):
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = weight.intercepted_einsum(spec, (jnp.asarray(x, jnp.bfloat16), weight[...]), 1,
                                    {"preferred_element_type": jnp.float32})
    spec = "BLD,VD->BLV"
  else:
    got = weight.intercepted_einsum(spec, (jnp.asarray(x), weight[...]), 1, {})
  want, bound = np_int8_matmul(spec, x, w, x_reduce, w_reduce)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), want)
  exact = np.einsum(spec, x.astype(np.float64), w.astype(np.float64))
  assert np.all(np.abs(want - exact) <= bound * (1 + 1e-5) + 1e-6)


def test_dot_general_and_grouped_matmuls_are_the_numpy_int8_matmul():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(3, 5, 48)).astype(np.float32)
  w = rng.normal(size=(3, 48, 40)).astype(np.float32)  # batch dim 0 on both sides
  weight = int8_weight(w, (1,))
  got = weight.intercepted_dot_general(jnp.asarray(x), weight[...], (((2,), (1,)), ((0,), (0,))),
                                       1, {})
  want, _ = np_int8_matmul("bld,bdf->blf", x, w, (2,), (1,))
  np.testing.assert_array_equal(np.asarray(got), want)
  # The weight as lhs: output (weight's free dims, then x's).
  w2 = rng.normal(size=(40, 48)).astype(np.float32)
  weight2 = int8_weight(w2, (1,))
  got = weight2.intercepted_dot_general(weight2[...], jnp.asarray(x[0]), (((1,), (1,)), ((), ())),
                                        0, {})
  want, _ = np_int8_matmul("ld,fd->fl", x[0], w2, (1,), (1,))
  np.testing.assert_array_equal(np.asarray(got), want)
  # Grouped (an MoE's experts): rows 0-2 expert 0, none for expert 1, 3-7 expert 2, 8-9 none.
  sizes = np.array([3, 0, 5])
  rows = rng.normal(size=(10, 48)).astype(np.float32)
  got = weight.intercepted_ragged_dot(jnp.asarray(rows), weight[...], jnp.asarray(sizes), {},
                                      jax.lax.ragged_dot)
  want = np.zeros((10, 40), np.float32)
  for g, (lo, hi) in enumerate([(0, 3), (3, 3), (3, 8)]):
    want[lo:hi] = np_int8_matmul("md,df->mf", rows[lo:hi], w[g], (1,), (0,))[0] if hi > lo else 0
  np.testing.assert_array_equal(np.asarray(got), want)


# ---- whole models ------------------------------------------------------------------------------

def _relative_rms(x, reference):
  x, reference = np.asarray(x, np.float64), np.asarray(reference, np.float64)
  return float(np.sqrt(np.mean((x - reference) ** 2)) / reference.std())


@pytest.mark.parametrize("init,tied", [(FAN_IN, True), (PEAKED, False)])
def test_logits_stay_near_the_full_precision_model(init, tied):
  """A 2-block model (width 64) in bf16, run plain and with int8 weights, against its float32
  twin. Measured: int8 8.8% / 0.97% relative RMS error (FAN_IN tied / PEAKED untied), bf16
  alone 3.6% / 0.36%: at width 64 a step of the per-token grid is ~1/50 of a row's RMS (about
  0.5% RMS rounding per operand, ~4x bf16's), and the blocks carry it to the logits as they
  carry bf16's. Tolerance: 4x the bf16 model's own error; PEAKED's clear next token is kept."""
  cfg = TINY.replace(num_layers=2, tie_embeddings=tied, param_dtype="bfloat16", dtype="bfloat16")
  t = tokens(4, 32, cfg.vocab_size)
  exact = logits(random_model(cfg.replace(param_dtype="float32", dtype="float32"), 0, init), t)
  bf16_model = random_model(cfg, 0, init)
  bf16_error = _relative_rms(logits(bf16_model, t), exact)
  int8 = logits(int8_model(bf16_model), t)
  assert int8.dtype == jnp.float32  # the head's preferred type, as the bf16 model's
  assert _relative_rms(int8, exact) <= 4 * bf16_error
  if init is PEAKED:
    assert np.array_equal(np.argmax(int8, -1), np.argmax(exact, -1))


def _lowered(model, t):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits_BxLxV).lower(state, t).as_text()


@pytest.mark.parametrize("scan_layers", [False, True])
def test_every_projection_is_an_int8_dot_and_the_lookup_gathers_int8_rows(scan_layers):
  """The lowered forward: 7 projections per block and the tied head are s8 x s8 -> s32 dots
  (scanned: the body's 7 once), the embedding lookup gathers int8 rows and their scales; the
  attention's own two matmuls (activations with activations) stay float."""
  cfg = TINY.replace(num_layers=2, scan_layers=scan_layers, tie_embeddings=True)
  text = _lowered(int8_model(random_model(cfg, 0, FAN_IN)), tokens(2, 8, cfg.vocab_size))
  dots = re.findall(r"stablehlo\.dot_general [^\n]*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> "
                    r"(tensor<[^>]*>)", text)
  int8_dots = [d for d in dots if all(t.endswith("xi8>") for t in d[:2]) and
               d[2].endswith("xi32>")]
  assert len(int8_dots) == 7 * (1 if scan_layers else 2) + 1
  assert all(d[0].endswith("xf32>") for d in dots if d not in int8_dots)
  gathers = re.findall(r"stablehlo\.gather\"?\(%\w+, %\w+\)[^\n]*: \((tensor<[^>]*>)", text)
  V, D = cfg.vocab_size, cfg.embed_dim  # rows of codes and their scales, no float table
  assert sorted(gathers) == [f"tensor<{V}x1xf32>", f"tensor<{V}x{D}xi8>"]


def test_the_real_teachers_weights_take_half_their_bf16_bytes():
  """Qwen3-1.7B in bf16 (abstract: nothing allocated): 3.44 GB of arrays; int8 codes for
  every matmul weight (the tied embedding included) plus float32 scales per output channel and
  the bf16 norms: exactly the byte count below, 50.1%."""
  cfg = get_preset("qwen3-1.7b", param_dtype="bfloat16", dtype="bfloat16", scan_layers=True)
  plain = abstract_model(cfg)
  int8 = abstract_int8_model(plain)
  D, F, H, K, KV, V, L = (cfg.embed_dim, cfg.mlp_dim, cfg.num_heads, cfg.head_dim,
                          cfg.num_kv_heads, cfg.vocab_size, cfg.num_layers)
  weights = L * (D * H * K + 2 * D * KV * K + H * K * D + 3 * D * F) + V * D
  channels = L * (H * K + 2 * KV * K + D + 2 * F + D) + V  # one float32 scale each
  norms = L * (2 * D + 2 * K) + D  # attention / MLP norms, q/k head norms, the final norm
  assert state_bytes(plain) == 2 * (weights + norms)
  assert state_bytes(int8) == weights + 4 * channels + 2 * norms
  assert 0.50 < state_bytes(int8) / state_bytes(plain) < 0.502


def test_what_cannot_run_in_int8_is_refused_in_one_line():
  model = random_model(TINY.replace(num_layers=1), 0, FAN_IN)
  lora = apply_lora(model, module_regex=r".*/mlp/.*", rank=2)
  qat = quantize_for_training(model, {"rules": [(".*", "int8", None, None)]})
  for transformed, words in ((lora, "LoRA adapters"), (qat, "already quantized"),
                             (int8_model(model), "already quantized")):
    with pytest.raises(ConfigError, match=words) as e:
      int8_model(transformed)
    assert "\n" not in str(e.value)
  # Training through it: the norms are still Params, but their gradient would cross int8 dots.
  int8 = int8_model(model)
  graphdef, params, rest = nnx.split(int8, nnx.Param, ...)
  loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(tokens(1, 4, 128)).logits_BxLxV)
  with pytest.raises(UserError, match="cannot be trained") as e:
    jax.jit(jax.grad(loss)).trace(params)
  assert "\n" not in str(e.value)
