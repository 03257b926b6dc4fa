"""Quantized export: the loaded model reproduces the fake-quant forward, the integers on disk
decode (with numpy, independently) to the reference rounding, and the files are small."""

import json
import os

import numpy as np
import pytest
import safetensors.numpy

from distillax.errors import UserError
from distillax.quant import (QuantConfig, export_quantized, load_quantized,
                             quantize_for_training, size_report)
from distillax.quant.export import pack_nibbles, unpack_nibbles
from tests.quant.helpers import np_fake_quant, tokens
from tests.support.models import FAN_IN, TINY, logits, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Stated tolerance: loaded logits equal the fake-quant forward to 1e-5 (same integers and
# scales; only the float op order inside the compiled forwards may differ).
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model():
  return random_model(TINY, seed=3, init=FAN_IN)


@pytest.mark.parametrize("weight,act,tile,scan", [
    ("int8", None, None, False), ("int4", "int8", 8, False), ("nf4", None, 8, False),
    ("float8_e4m3fn", None, None, False), ("int4", None, None, True)])
def test_round_trip_equals_fake_quant_forward(model, tmp_path, weight, act, tile, scan):
  if scan:
    model = random_model(TINY.replace(scan_layers=True), seed=4, init=FAN_IN)
  qcfg = QuantConfig.simple(weight, act, tile)
  qat = quantize_for_training(model, qcfg)
  export_quantized(qat, qcfg, str(tmp_path))
  loaded = load_quantized(str(tmp_path))
  toks = tokens(2, 12, TINY.vocab_size, seed=5)
  np.testing.assert_allclose(np.asarray(logits(loaded, toks)), np.asarray(logits(qat, toks)),
                             **TOL)


def _np_unpack_int4(stored, shape):
  """Independent reading of the documented layout: two codes per byte, low nibble first."""
  low, high = stored & 0x0F, stored >> 4
  nibbles = np.empty(2 * stored.size, np.int16)
  nibbles[0::2], nibbles[1::2] = low, high
  nibbles = nibbles[:int(np.prod(shape))]
  return np.where(nibbles >= 8, nibbles - 16, nibbles).reshape(shape)


def test_stored_integers_decode_to_reference_rounding(model, tmp_path):
  qcfg = QuantConfig.simple("int4", None, 8)
  meta = export_quantized(model, qcfg, str(tmp_path))
  with open(os.path.join(tmp_path, "quant_config.json")) as f:
    assert json.load(f) == meta
  tensors = safetensors.numpy.load_file(os.path.join(tmp_path, "model.safetensors"))
  o = np.asarray(model.layers[1].attn.o[...])  # (heads, head_dim, embed), tiles on head_dim
  stored = tensors["layers/1/attn/o:qvalue"]
  assert stored.dtype == np.uint8 and stored.size == o.size // 2
  codes = _np_unpack_int4(stored, o.shape)
  assert codes.min() >= -8 and codes.max() <= 7
  scale = tensors["layers/1/attn/o:scale"]
  assert scale.shape == (1, o.shape[1] // 8, o.shape[2])
  dequant = codes * np.repeat(scale, 8, axis=1)
  np.testing.assert_allclose(dequant, np_fake_quant(o, "int4", (0, 1), 8, 1), rtol=1e-6,
                             atol=1e-7)
  # Untouched variables are stored as they are.
  np.testing.assert_array_equal(tensors["embedder/embedding"],
                                np.asarray(model.embedder.embedding[...]))


def test_size_report(model, tmp_path):
  reports = {}
  for qtype in ("int8", "int4"):
    export_quantized(model, QuantConfig.simple(qtype), str(tmp_path / qtype))
    reports[qtype] = size_report(str(tmp_path / qtype))
  files = {q: os.path.getsize(tmp_path / q / "model.safetensors") for q in reports}
  for q, r in reports.items():
    assert r["safetensors_bytes"] == files[q]
    assert r["fp32_bytes"] == 4 * r["params"] and r["bf16_bytes"] == 2 * r["params"]
  # Quantized weights alone: int8 ~4x smaller than fp32, int4 ~8x, minus per-channel scales.
  assert 3.7 < reports["int8"]["quantized_tensors_ratio_vs_fp32"] <= 4.0
  assert 7.0 < reports["int4"]["quantized_tensors_ratio_vs_fp32"] <= 8.0
  # Whole files (embeddings and norms stay fp32 here): still well below fp32 and bf16.
  assert reports["int8"]["ratio_vs_fp32"] > 2.7 and reports["int4"]["ratio_vs_fp32"] > 4.0
  assert reports["int4"]["ratio_vs_bf16"] > 2.0


def test_nibble_packing_and_errors(tmp_path):
  codes = np.random.default_rng(0).integers(-8, 8, size=33).astype(np.int8)  # odd count
  packed = pack_nibbles(codes)
  assert packed.dtype == np.uint8 and packed.size == 17
  np.testing.assert_array_equal(unpack_nibbles(packed, 33, signed=True), codes)
  np.testing.assert_array_equal(_np_unpack_int4(packed, (33,)), codes)
  with pytest.raises(UserError, match="quant_config.json"):
    load_quantized(str(tmp_path))
