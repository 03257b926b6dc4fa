"""`distillax eval --against`: a model's next-token distributions against its full-precision
twin's over the eval tokens, checked against NumPy on the same batches; a twin of another
shape is refused in one line."""

import json
import os

import numpy as np
import pytest

from distillax.configs import lm
from distillax.data.batch import INPUTS, LOSS_MASK, POSITIONS, SEGMENT_IDS, TARGETS
from distillax.main import main
from distillax.models.hf import checkpoint as hf
from distillax.models.presets import get_preset
from distillax.trainers import hf_checkpoint_recipe
from tests.support.models import forward, random_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LM = f"{ROOT}/distillax/configs/lm.py:tiny"
ONE_BATCH = ["--config", LM, "--config.train.eval_batches=1"]


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
  """Two random tiny models of one shape (Hugging Face directories) and their models."""
  root = tmp_path_factory.mktemp("against")
  tiny = get_preset("tiny").replace(vocab_size=384)  # lm.py:tiny's byte tokenizer, padded
  models = {name: random_model(tiny, seed=seed) for name, seed in
            (("fp", 0), ("other", 1))}
  for name, model in models.items():
    hf.save(model, root / name)
  hf.save(random_model(tiny.replace(num_layers=1), seed=2), root / "smaller")
  return root, models


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _figures(capsys, argv) -> dict:
  capsys.readouterr()
  assert main(["distillax", "eval"] + argv + ONE_BATCH) == 0
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_against_equals_numpy_and_is_exact_against_itself(twins, capsys):
  root, models = twins
  same = _figures(capsys, ["--model", str(root / "fp"), "--against", str(root / "fp")])
  assert (same["kl_max"], same["same_top1"], same["perplexity_ratio"]) == (0.0, 1.0, 1.0)
  got = _figures(capsys, ["--model", str(root / "other"), "--against", str(root / "fp")])
  config = lm.get_config("tiny")
  config.train.eval_batches = 1
  (batch,) = list(hf_checkpoint_recipe(config, str(root / "other"), purpose="").eval_iterator())
  args = [batch[k] for k in (INPUTS, POSITIONS, SEGMENT_IDS)]
  lq, lp = (_log_softmax(np.asarray(forward(models[n], *args).logits_BxLxV, np.float64))
            for n in ("other", "fp"))
  mask = batch[LOSS_MASK] > 0
  kl = (np.exp(lp) * (lp - lq)).sum(-1)[mask]
  nll = lambda logp: -np.take_along_axis(logp, batch[TARGETS][..., None], -1)[..., 0][mask]
  assert got["tokens"] == mask.sum()
  np.testing.assert_allclose(got["kl_mean"], kl.mean(), rtol=1e-5)
  np.testing.assert_allclose(got["kl_max"], kl.max(), rtol=1e-5)
  np.testing.assert_allclose(got["same_top1"], (lq.argmax(-1) == lp.argmax(-1))[mask].mean())
  np.testing.assert_allclose(got["perplexity_ratio"], np.exp(nll(lq).mean() - nll(lp).mean()),
                             rtol=1e-5)
  assert 0 < got["kl_mean"] and 0 <= got["same_top1"] < 1


def test_against_a_twin_of_another_shape_is_one_line(twins, capsys):
  root, _ = twins
  capsys.readouterr()
  assert main(["distillax", "eval", "--model", str(root / "fp"), "--against",
               str(root / "smaller")] + ONE_BATCH) == 2
  line = capsys.readouterr().err.strip().splitlines()[-1]
  assert f"--against {root / 'smaller'} has model.num_layers=1" in line
  assert "its own full-precision twin" in line


def test_against_on_a_gguf_file_is_llama_cpps_and_refuses_another_shape(twins, capsys, tmp_path):
  """`--model FILE.gguf` runs the file in llama.cpp: an f32 GGUF of `other` gives the figures
  distillax's own forward of `other` gives (llama.cpp's f32 logits differ by ~4e-6), and a twin
  of another shape is one line, exit 2."""
  from distillax.edge.export import write_gguf
  root, models = twins
  gguf = str(tmp_path / "other.gguf")
  write_gguf(models["other"], gguf)
  want = _figures(capsys, ["--model", str(root / "other"), "--against", str(root / "fp")])
  capsys.readouterr()
  assert main(["distillax", "eval", "--model", gguf, "--against", str(root / "fp")]
              + ONE_BATCH) == 0
  out = capsys.readouterr()
  got = json.loads(out.out.strip().splitlines()[-1])
  assert f"distillax eval: {gguf} run by llama.cpp (reference kernels, f32 KV cache)" in out.err
  assert got["tokens"] == want["tokens"] and got["same_top1"] == want["same_top1"]
  for key in ("kl_mean", "kl_p99", "kl_max", "perplexity_ratio", "nll_model", "nll_against"):
    np.testing.assert_allclose(got[key], want[key], rtol=1e-3, err_msg=key)
  assert got["kl_mean"] > 0.01  # another model: the comparison has something to find
  assert main(["distillax", "eval", "--model", gguf, "--against", str(root / "smaller")]
              + ONE_BATCH) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith(f"distillax eval: error: --against {root / 'smaller'} has "
                            f"model.num_layers=1, --model {gguf} 2: compare a GGUF file"), err
  # What eval cannot do with a GGUF file: one line each, before anything loads.
  for argv, fragment in (([], "is a GGUF file, which eval runs in llama.cpp with --generate"),
                         (["--tasks", "distillax_code_mc"], "for --tasks or the eval loss"),
                         (["--against", gguf], "is a GGUF file; compare against the full-")):
    model = str(root / "fp") if "--against" in argv else gguf
    assert main(["distillax", "eval", "--model", model, *argv]) == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("distillax eval: error: "), err
    assert fragment in err[0], err
