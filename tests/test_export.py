"""`distillax export` writes a run's student as HF safetensors and as int4, both loadable; the HF
export carries only the tokenizer's ids, in distillax and in transformers."""

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from distillax import partitioning as pt
from distillax import quant
from distillax.data.tokenizer import ByteTokenizer
from distillax.main import main
from distillax.models.hf import checkpoint as hf
from distillax.trainers import load_trained_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QAT = f"{ROOT}/distillax/configs/qat.py:tiny"


@nnx.jit
def logits(model, tokens):
  """One compiled forward (an eager one dispatches every op on 8 devices, one by one)."""
  return model(tokens).logits_BxLxV


def _transformers_emits_only_real_tokens(folder: str, tokens, want, vocab: int) -> None:
  """transformers' logits have the tokenizer's rows only, equal to distillax's for those ids,
  and sampling at temperature 100 (every row nearly as likely) draws no other id."""
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
  with torch.no_grad():
    theirs = model(torch.tensor(tokens[:2])).logits.numpy()
    torch.manual_seed(0)
    drawn = model.generate(torch.tensor(tokens[:2]), do_sample=True, temperature=100.0, top_k=0,
                           top_p=1.0, max_new_tokens=64, min_new_tokens=64)[:, tokens.shape[1]:]
  assert theirs.shape[-1] == vocab
  np.testing.assert_allclose(theirs, want[:2, :, :vocab], atol=1e-4)
  assert drawn.shape == (2, 64) and int(drawn.max()) < vocab


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
  # The byte tokenizer's 259 ids of the model's 384 rows: the padded rows are not exported.
  vocab = ByteTokenizer().vocab_size
  assert (want.shape[-1], got.shape[-1]) == (384, vocab)
  np.testing.assert_allclose(got, want[..., :vocab], atol=1e-5)
  _transformers_emits_only_real_tokens(str(tmp_path / "hf"), np.asarray(tokens), want, vocab)
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
