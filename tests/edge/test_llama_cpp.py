"""The runtime as the judge: llama.cpp (llama-cpp-python, the edge extra) loads each GGUF export
and its logits match distillax's forward: the plain forward for f32 / f16, the QAT forward with
llama.cpp's rounding (q8_0 / q4_0 weights, q8_0 activations) for q8_0 / q4_0; greedy decoding
agrees token for token; llama.cpp tokenizes text to the ids distillax does.

Measured on this machine (x86-64 with AVX-512; llama.cpp 0.3.36's portable CPU kernels, see
edge/runtime.py; float32 KV cache), max |logit difference| on 40 tokens, logit scale
(max |logit|) ~12 for the Llama and Qwen 2 models:
  f32   3e-6  (Qwen 3: 1.5e-5 at logit scale 73)       tolerance 1e-4
  f16   2.8e-3 (llama.cpp also rounds activations to fp16 at f16 weights)  tolerance 1e-2
  q8_0  5e-6 vs the QAT forward (0.05 vs full precision)   tolerance 1e-3
  q4_0  5e-6 vs the QAT forward (0.57 vs full precision)   tolerance 1e-3
Gemma / Gemma 2: llama.cpp's CPU GeGLU reads GELU from an fp16 table (ggml-cpu vec.h,
GGML_GELU_FP16); with that table in distillax's forward (helpers.table_gelu) q4_0 agrees
to 1.4e-6 and f32 to 1.6e-4 (fp16 rounding boundaries of the gate), without it to 0.046 (q4_0)
and 1e-3 (f32) at logit scale ~5.8. The tolerances leave room for other CPUs' summation orders
while staying far below what separates QAT rounding from full precision.
"""

import llama_cpp
import numpy as np
import pytest

from distillax.data.tokenizer import ByteTokenizer
from distillax.edge import arch_checks
from distillax.edge import runtime as gguf_runtime
from distillax.edge.export import write_gguf
from distillax.models.transformer import with_config
from distillax.quant import quantize_for_training
from tests.edge.helpers import CONFIGS, IDS, greedy, logits
from tests.support.models import PEAKED, random_model
from tests.edge.test_export import byte_level_bpe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FORMATS = ("f32", "f16", "q8_0", "q4_0")
QAT_RULES = {"q8_0": ((".*", "q8_0", "q8_0", None),), "q4_0": ((".*", "q4_0", "q8_0", None),)}
TOLERANCE = {"f32": 1e-4, "f16": 1e-2, "q8_0": 1e-3, "q4_0": 1e-3}
PROMPT, NEW_TOKENS = IDS[:8], 32
TEXTS = ["hello world", "  two  spaces,\ttabs\nand a new line\r\n", "naïve café — 日本語 🙂!",
         "<s> and </s> are text here", "1234567 + 89 = ?", " leading and trailing  "]


def run(model, path, quant, llama_cpp_gelu=False, generate=False, kernels=("reference",)):
  """Exports `model` as `quant`, runs it in llama.cpp (one load per kernel path) and in
  distillax (the model llama.cpp should compute: QAT-rounded for q8_0 / q4_0)."""
  rules = QAT_RULES.get(quant)
  write_gguf(model, path, quant=quant, rules=rules)
  reference = quantize_for_training(model, {"rules": rules}) if rules else model
  out = {"distillax": logits(reference, IDS, llama_cpp_gelu)}
  if generate:
    out["distillax_tokens"], out["margin"] = greedy(reference, PROMPT, NEW_TOKENS,
                                                    llama_cpp_gelu)
  for path_name in kernels:
    llm = gguf_runtime.load(path, kernels=path_name)
    try:
      out[path_name] = {"logits": gguf_runtime.logits(llm, IDS)}
      if generate:
        out[path_name]["tokens"] = gguf_runtime.greedy(llm, PROMPT, NEW_TOKENS)
    finally:
      llm.close()
  out["llama_cpp"] = out["reference"]["logits"]  # every host can force it
  return out


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
  """Every format on every kernel path this CPU can force (gguf_runtime.kernel_paths)."""
  folder = tmp_path_factory.mktemp("llama")
  model = random_model(CONFIGS["llama"], init=PEAKED)
  full = logits(model, IDS)
  return {q: {**run(model, folder / f"{q}.gguf", q, generate=True,
                    kernels=gguf_runtime.kernel_paths()), "full": full}
          for q in FORMATS}


def test_the_host_reports_its_kernel_paths():
  """The reference path runs everywhere; llama.cpp's repacked kernels wherever its build has
  REPACK and the CPU no AMX (whose matmul crashes in this build); the deployment path is the
  last one this host can force. A path it cannot force is refused in one line."""
  info = gguf_runtime.system_info()
  paths = gguf_runtime.kernel_paths()
  assert paths[0] == "reference" and set(paths) <= set(gguf_runtime.KERNEL_PATHS)
  assert ("repack" in paths) == ("REPACK = 1" in info and "AMX_INT8 = 1" not in info)
  assert gguf_runtime.deployment_kernels() == paths[-1]
  with pytest.raises(gguf_runtime.UserError, match="kernels='fast' is unknown"):
    gguf_runtime.load(__file__, kernels="fast")


@pytest.mark.parametrize("kernels", gguf_runtime.kernel_paths())
@pytest.mark.parametrize("quant", FORMATS)
def test_llama_cpp_logits_match_distillax(llama_runs, quant, kernels):
  r = {**llama_runs[quant], "llama_cpp": llama_runs[quant][kernels]["logits"]}
  assert np.abs(r["llama_cpp"] - r["distillax"]).max() <= TOLERANCE[quant]
  assert np.abs(r["distillax"]).max() > 5  # a logit scale that makes the tolerance meaningful
  if quant in QAT_RULES:  # llama.cpp computes the rounded model, not the full-precision one
    assert np.abs(r["llama_cpp"] - r["full"]).max() > 20 * TOLERANCE[quant]


@pytest.mark.parametrize("quant", FORMATS)
def test_greedy_generation_agrees_token_for_token(llama_runs, quant):
  r = llama_runs[quant]
  for kernels in gguf_runtime.kernel_paths():
    assert r[kernels]["tokens"] == r["distillax_tokens"], kernels
  assert len(set(r["distillax_tokens"])) > NEW_TOKENS // 2  # a sequence, not one repeated id
  # No near-tie decided it: every step's top-1 lead dwarfs the two runtimes' logit difference.
  assert r["margin"] > 100 * max(np.abs(r[k]["logits"] - r["distillax"]).max()
                                 for k in gguf_runtime.kernel_paths())
  assert r["margin"] > 1.0


@pytest.mark.parametrize("arch,quant,tolerance", [
    ("gemma2", "f32", 1e-3), ("gemma2", "q4_0", 1e-3), ("gemma", "f32", 1e-4),
    ("qwen2", "f32", 1e-4), ("qwen2", "q4_0", 1e-3), ("qwen3", "f32", 1e-4)])
def test_other_architectures_match(tmp_path, arch, quant, tolerance):
  model = random_model(CONFIGS[arch], init=PEAKED)
  r = run(model, tmp_path / "m.gguf", quant, llama_cpp_gelu=arch.startswith("gemma"))
  assert np.abs(r["llama_cpp"] - r["distillax"]).max() <= tolerance


def test_llama_cpp_gemma2_slides_on_even_layers_whatever_the_file_says(tmp_path, monkeypatch):
  """Why the GGUF export refuses a Gemma 2 whose sliding layers are not the even ones (a student of
  two sliding teacher blocks): written anyway, llama.cpp runs it as sliding/full, another model
  than the one trained."""
  every = random_model(CONFIGS["gemma2"].replace(sliding_window_pattern=0), init=PEAKED)
  assert every.config.local_layers() == [True, True]
  monkeypatch.setattr(arch_checks, "_check_gemma2_windows", lambda config: None)
  r = run(every, tmp_path / "m.gguf", "f32", llama_cpp_gelu=True)
  alternating = logits(with_config(every, sliding_window_pattern=2), IDS, True)
  assert np.abs(r["llama_cpp"] - alternating).max() <= 1e-3
  assert np.abs(r["llama_cpp"] - r["distillax"]).max() > 0.5


def vocab_only(path):
  return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def test_llama_cpp_tokenizes_like_the_byte_tokenizer(tmp_path):
  write_gguf(random_model(CONFIGS["qwen3"], init=PEAKED), tmp_path / "m.gguf")
  llm, tok = vocab_only(tmp_path / "m.gguf"), ByteTokenizer()
  try:
    for text in TEXTS:
      assert gguf_runtime.tokenize(llm, text) == tok.encode(text), text
      assert gguf_runtime.tokenize(llm, text, add_bos=True) == [tok.bos_id] + tok.encode(text)
      assert llm.detokenize(tok.encode(text)) == text.encode("utf-8")
  finally:
    llm.close()


def test_llama_cpp_tokenizes_like_the_hf_bpe_tokenizer(tmp_path):
  tok = byte_level_bpe(tmp_path)
  model = random_model(CONFIGS["qwen2"].replace(vocab_size=512), init=PEAKED)
  write_gguf(model, tmp_path / "m.gguf", tokenizer=tok, add_bos=False)
  llm = vocab_only(tmp_path / "m.gguf")
  try:
    for text in TEXTS + ["the lazy dog jumps over the quick brown fox", "Pack my box"]:
      ids = tok.encode(text)
      assert gguf_runtime.tokenize(llm, text) == ids, text
      assert llm.detokenize(ids) == text.encode("utf-8")
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges used
  finally:
    llm.close()


def test_demo_student_greedy_agrees_for_32_tokens(tmp_path):
  """The demo student's shapes with the demo's rules (q4_0 weights, q8_0 activations, the
  embedding f32), greedy for 32 tokens: llama.cpp's KV-cached decode vs distillax's QAT forward.
  Untied here so the peaked output rows define a successor per token (tied, each token would
  predict itself); the demo itself checks its trained, tied student the same way."""
  from distillax.configs import demo
  from distillax.models.config import TransformerConfig
  fields = {k: v for k, v in demo.get_config().student_model.items()
            if k in TransformerConfig.__dataclass_fields__}
  config = TransformerConfig(**{**fields, "vocab_size": CONFIGS["llama"].vocab_size,
                                "tie_embeddings": False})
  model = random_model(config, init=PEAKED)
  rules = tuple(demo.get_config().quant_rules)
  write_gguf(model, tmp_path / "demo.gguf", quant="q4_0", rules=rules)
  reference = quantize_for_training(model, {"rules": rules})
  llm = gguf_runtime.load(tmp_path / "demo.gguf")
  try:
    theirs = gguf_runtime.greedy(llm, PROMPT, NEW_TOKENS)
  finally:
    llm.close()
  ours, margin = greedy(reference, PROMPT, NEW_TOKENS)
  assert theirs == ours
  assert len(set(ours)) > NEW_TOKENS // 2 and margin > 1.0
