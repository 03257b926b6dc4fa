"""`distillax export` writes a run's student as HF safetensors and as int4, both loadable."""

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax import partitioning as pt
from distillax import quant
from distillax.main import main
from distillax.models.hf import checkpoint as hf
from distillax.trainers import load_trained_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QAT = f"{ROOT}/distillax/configs/qat.py:tiny"


@nnx.jit
def logits(model, tokens):
  """One compiled forward (an eager one dispatches every op on 8 devices, one by one)."""
  return model(tokens).logits_BxLxV


def test_export_hf_and_quantized_from_a_qat_run(tmp_path):
  run = tmp_path / "run"
  assert main(["distillax", "train", "--config", QAT, "--workdir", str(run),
               "--config.train.steps=3"]) == 0
  # --config may place the model differently from training (mesh, rules): same job.
  assert main(["distillax", "export", "--config", QAT, "--workdir", str(run),
               "--output", str(tmp_path / "hf"), "--config.mesh.model=2",
               "--config.partitioning.strategy=fsdp_tp"]) == 0
  assert main(["distillax", "export", "--config", QAT, "--workdir", str(run),
               "--output", str(tmp_path / "int4"), "--format", "quantized"]) == 0
  # Refuses to overwrite.
  assert main(["distillax", "export", "--config", QAT, "--workdir", str(run),
               "--output", str(tmp_path / "hf")]) == 2

  mesh = pt.create_mesh({"data": 8, "model": 1})
  rules = pt.rules_from_config({"strategy": "fsdp"})
  trained = load_trained_model(str(run), mesh, rules)
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, 200, (8, 16)), jnp.int32)
  want = np.asarray(logits(trained, tokens))
  got = np.asarray(logits(hf.load(str(tmp_path / "hf")), tokens))
  np.testing.assert_allclose(got, want, atol=1e-5)
  # The int4 file equals the fake-quant (PTQ-rounded) forward of the same weights, placed alike
  # (int8 activation rounding flips on last-bit differences of another reduction order).
  qcfg = {"rules": [("", None, None, None), (".*", "int4", "int8", None)]}  # as qat.py
  fake = quant.quantize_post_training(trained, qcfg, tokens[:1])
  loaded = quant.load_quantized(str(tmp_path / "int4"), mesh=mesh, rules=rules,
                                sample_tokens=tokens[:1])
  np.testing.assert_allclose(np.asarray(logits(loaded, tokens)),
                             np.asarray(logits(fake, tokens)), atol=1e-4)
  report = quant.size_report(str(tmp_path / "int4"))
  assert report["quantized_tensors_ratio_vs_fp32"] > 6
