"""`distillax export --format gguf`: a QAT run trained with llama.cpp's types exports as GGUF
that llama.cpp runs with the QAT forward's logits and the run's tokenizer; bad flags fail in one
line, before anything is loaded or written."""

import os

import numpy as np
import pytest

from distillax import partitioning as pt
from distillax.data.tokenizer import ByteTokenizer
from distillax.main import main
from distillax.quant import gguf_runtime, quantize_for_training
from distillax.trainers import load_trained_model
from tests.quant.edge_helpers import IDS, logits

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QAT = f"{ROOT}/distillax/configs/qat.py:tiny"
RULES = (("layers/1/mlp", "q8_0", "q8_0", None), (".*", "q4_0", "q8_0", None))
RULES_FLAG = f"--config.qat.rules={RULES!r}"


def export(run, output, *flags):
  return main(["distillax", "export", "--config", QAT, "--workdir", str(run), "--output",
               str(output), RULES_FLAG, *flags])


def test_qat_run_exports_as_gguf_that_llama_cpp_runs(tmp_path, capsys):
  run = tmp_path / "run"
  assert main(["distillax", "train", "--config", QAT, "--workdir", str(run),
               "--config.train.steps=3", RULES_FLAG]) == 0
  assert export(run, tmp_path / "q4", "--format", "gguf", "--quant", "q4_0") == 0
  assert "model-q4_0.gguf" in capsys.readouterr().out
  trained = load_trained_model(str(run), pt.create_mesh({"data": 8, "model": 1}),
                               pt.rules_from_config({"strategy": "fsdp"}))
  qat = quantize_for_training(trained, {"rules": RULES})
  llm = gguf_runtime.load(tmp_path / "q4" / "model-q4_0.gguf")
  try:
    got = gguf_runtime.logits(llm, IDS)
    np.testing.assert_allclose(got, logits(qat, IDS), atol=1e-3)
    assert np.abs(got - logits(trained, IDS)).max() > 0.02  # it is the rounded model
    text = "exported to llama.cpp"
    assert gguf_runtime.tokenize(llm, text, add_bos=True) == [2] + ByteTokenizer().encode(text)
  finally:
    llm.close()

  # One-line errors, nothing written: --quant without gguf, unknown --quant, int4 rules.
  assert export(run, tmp_path / "a", "--quant", "q4_0") == 2
  assert export(run, tmp_path / "b", "--format", "gguf", "--quant", "q5_k") == 2
  assert main(["distillax", "export", "--config", QAT, "--workdir", str(run), "--output",
               str(tmp_path / "c"), "--format", "gguf", "--quant", "q4_0"]) == 2  # int4 rules
  err = capsys.readouterr().err
  assert "--quant applies to --format gguf" in err and "'q5_k' is unknown" in err
  assert "weight_qtype='int4' has no GGUF type" in err
  assert not any((tmp_path / d).exists() for d in "abc")
