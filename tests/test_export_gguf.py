"""`distillax export --format gguf`: a QAT run trained with llama.cpp's types exports as GGUF
that llama.cpp runs with the QAT forward's logits and the run's tokenizer, and `distillax
generate` decodes that run as llama.cpp decodes the export; bad flags fail in one line, before
anything is loaded or written."""

import contextlib
import io
import os

import numpy as np
import pytest

from distillax import partitioning as pt
from distillax.data.tokenizer import ByteTokenizer
from distillax.main import main
from distillax.edge import runtime as gguf_runtime
from distillax.generate import generate_tokens, load_model_dir
from distillax.quant import quantize_for_training
from distillax.trainers import load_trained_model
from tests.edge.helpers import IDS, logits

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QAT = f"{ROOT}/distillax/configs/qat.py:tiny"
RULES = (("layers/1/mlp", "q8_0", "q8_0", None), (".*", "q4_0", "q8_0", None))
RULES_FLAG = f"--config.qat.rules={RULES!r}"
# Max |llama.cpp logit - QAT forward logit| per (kernel path, KV cache), with the figure measured
# on an AVX-512 CPU without AMX (AMD EPYC; logit scale ~3.9, QAT vs full precision 1.18):
#   reference, f32 cache  4.8e-7  -> 1e-3: the judge; llama.cpp's portable kernels, which
#                                    quant/ggml.py models, forced on every CPU
#   repack,    f32 cache  0.033   -> 0.1:  llama.cpp's repacked AVX2/AVX-512 q4_0 GEMM rounds its
#                                    activations and sums in its own order
#   deployment, f16 cache 0.072   -> 0.2:  what a device gets by default (the f16 cache adds
#                                    the rest: reference + f16 cache measures 0.072 too)
# Every row stays at most a sixth of the distance that separates QAT from full precision.
KERNEL_ROWS = (("reference", True, 1e-3), ("repack", True, 0.1), ("deployment", False, 0.2))


def export(run, output, *flags):
  return main(["distillax", "export", "--config", QAT, "--workdir", str(run), "--output",
               str(output), RULES_FLAG, *flags])


@pytest.fixture(scope="module")
def q4_run(tmp_path_factory):
  """(a 3-step QAT run with RULES, its q4_0 GGUF file, what the export printed)."""
  root = tmp_path_factory.mktemp("qat_gguf")
  run = root / "run"
  assert main(["distillax", "train", "--config", QAT, "--workdir", str(run),
               "--config.train.steps=3", RULES_FLAG]) == 0
  with contextlib.redirect_stdout(io.StringIO()) as printed:
    assert export(run, root / "q4", "--format", "gguf", "--quant", "q4_0") == 0
  return run, root / "q4" / "model-q4_0.gguf", printed.getvalue()


def test_qat_run_exports_as_gguf_that_llama_cpp_runs(q4_run, tmp_path, capsys):
  run, _, printed = q4_run
  assert "model-q4_0.gguf" in printed
  # The export names the form it loaded: the plain weights, which the q4_0 file rounds again.
  assert f"{run} loaded as full precision (qat.rules' fake quantization off)" in printed
  trained = load_trained_model(str(run), pt.create_mesh({"data": 8, "model": 1}),
                               pt.rules_from_config({"strategy": "fsdp"}))
  qat = quantize_for_training(trained, {"rules": RULES})
  # The file holds the byte tokenizer's 259 ids of the model's 384 rows: those ids' logits.
  vocab = ByteTokenizer().vocab_size
  want, full = logits(qat, IDS)[:, :vocab], logits(trained, IDS)[:, :vocab]
  assert np.abs(want - full).max() > 1.0  # what QAT rounding changes, for the tolerances below
  rows = [(k, cache, tol) for k, cache, tol in KERNEL_ROWS
          if k == "deployment" or k in gguf_runtime.kernel_paths()]
  for kernels, exact_cache, tolerance in rows:
    kernels = gguf_runtime.deployment_kernels() if kernels == "deployment" else kernels
    llm = gguf_runtime.load(q4_run[1], kernels=kernels,
                            exact_cache=exact_cache)
    try:
      assert llm.n_vocab() == vocab
      got = gguf_runtime.logits(llm, IDS)
      # Per position: the fake-quant forward and llama.cpp sum a matmul input in different
      # orders, so an activation that lands within a rounding of a q8_0 half-way point can take
      # the next code in one of them: that position's logits move by ~1e-2 (one of 40 here,
      # since the counter-based init's weights). Every other position is within the tolerance.
      apart_per_position = np.abs(got - want).max(axis=-1)
      off = np.flatnonzero(apart_per_position > tolerance)
      assert len(off) <= 1 and apart_per_position.max() < max(2e-2, tolerance), (
          f"{kernels} kernels, f32 cache: {exact_cache}: positions {off.tolist()} apart by "
          f"{apart_per_position[off].tolist()} (tolerance {tolerance})")
      assert np.abs(got - full).max() > 5 * tolerance  # it is the rounded model
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


def test_llama_cpp_samples_only_real_tokens_from_the_export(q4_run):
  """llama.cpp's own sampler at temperature 100 (every row nearly as likely), no top-k, top-p
  or min-p: 100 ids (the tiny model's context is 128), none past the byte tokenizer's 259 (the
  file has no padded rows)."""
  llm = gguf_runtime.load(q4_run[1], kernels="reference", exact_cache=True)
  try:
    drawn = []
    for token in llm.generate([2] + ByteTokenizer().encode("def "), temp=100.0, top_k=0,
                              top_p=1.0, min_p=0.0, reset=True):
      drawn.append(token)
      if len(drawn) == 100:
        break
  finally:
    llm.close()
  assert len(drawn) == 100 and max(drawn) < ByteTokenizer().vocab_size


def test_generate_on_a_q4_0_qat_run_gives_llama_cpp_greedy_tokens(q4_run, capsys):
  """`distillax generate` decodes a QAT run in the form it trained (fake-quant q8_0 / q4_0
  weights by RULES, q8_0 activations), the one `eval` judges: llama.cpp's greedy tokens on the run's q4_0
  GGUF (the reference kernels, the judge; f32 KV cache), among the tokenizer's ids."""
  run, gguf, _ = q4_run
  byte = ByteTokenizer()
  prompt = [byte.bos_id] + byte.encode("def ")
  llm = gguf_runtime.load(gguf, kernels="reference", exact_cache=True)
  try:
    want = gguf_runtime.greedy(llm, prompt, 16, vocab_limit=byte.vocab_size)
  finally:
    llm.close()
  want = want[:want.index(byte.eos_id)] if byte.eos_id in want else want
  capsys.readouterr()
  assert generate_tokens(load_model_dir(str(run)), prompt, max_new_tokens=16) == want
  assert "loaded as fake-quant q8_0/q4_0 weights, q8_0 activations" in capsys.readouterr().err
  # The command prints that text, and names the form on stderr in one line.
  assert main(["distillax", "generate", "--model", str(run), "--prompt", "def ",
               "--max_new_tokens", "16"]) == 0
  out = capsys.readouterr()
  assert out.out == byte.decode(want) + "\n"
  said = [line for line in out.err.splitlines() if line.startswith("distillax generate:")]
  assert said == [f"distillax generate: {run} loaded as fake-quant q8_0/q4_0 weights, q8_0 "
                  f"activations (qat.rules: the forward QAT trains); checkpoint step 3"]
  # eval judges that same form, and says so.
  assert main(["distillax", "eval", "--model", str(run)]) == 0
  assert (f"distillax eval: {run} evaluated as fake-quant q8_0/q4_0 weights, q8_0 activations "
          f"(qat.rules: the forward QAT trains); checkpoint step 3") in capsys.readouterr().err
  # --full_precision decodes the plain weights (what generate did before), which llama.cpp's
  # q4_0 file does not run: other tokens.
  plain = generate_tokens(load_model_dir(str(run), full_precision=True), prompt,
                          max_new_tokens=16)
  assert plain != want
  assert "loaded as full precision (qat.rules' fake quantization off)" in capsys.readouterr().err
