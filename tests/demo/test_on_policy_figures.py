"""The demo's llama.cpp on-policy figure measures what it claims: greedy samples of a q4_0 GGUF
file in llama.cpp are distillax's greedy samples of the same quantized model, and the teacher's
NLL and the reverse KL computed from llama.cpp's logits (and their standard errors over prompts)
equal distillax's own figures for them."""

import numpy as np
import pytest

from distillax.demo.on_policy import distillax_se, gguf_figures, sample_gguf
from distillax.distill.on_policy.objective import OnPolicySettings
from distillax.distill.on_policy.eval import OnPolicyEvaluator
from distillax.models.presets import get_preset
from distillax.models.init import create_model
from distillax.quant import quantize_post_training
from distillax.edge.export import write_gguf

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

RULES = (("", None, None, None), (".*", "q4_0", "q8_0", None))


def test_llama_cpp_samples_and_figures_match_distillax(tmp_path):
  config = get_preset("tiny", vocab_size=384, num_layers=1)  # the byte vocabulary, padded
  student = create_model(config, seed=3)
  teacher = create_model(config.replace(num_layers=2), seed=4)
  path = str(tmp_path / "student-q4_0.gguf")
  write_gguf(student, path, quant="q4_0", rules=RULES, add_bos=False)
  quantized = quantize_post_training(student, {"rules": list(RULES)})
  prompts = [np.array([1, 70, 101, 32, 9], np.int32), np.array([1, 100, 101, 102], np.int32),
             np.array([1, 40, 41, 42, 43, 44], np.int32), np.array([1, 33], np.int32)]
  # Only the byte tokenizer's 259 ids are drawn, in distillax and in llama.cpp alike.
  settings = OnPolicySettings(max_new_tokens=10, temperature=0.0, eos_id=2, pad_id=0,
                              vocab_limit=259)
  ours = OnPolicyEvaluator(settings)(quantized, teacher, prompts, seed=0)
  samples = sample_gguf(path, prompts, settings, seed=0)
  # Greedy in both: the same tokens, unless two logits are within llama.cpp's rounding.
  agree = [sum(a == b for a, b in zip(ids, mine)) for (ids, _), (_, mine) in
           zip(samples, ours.samples)]
  assert agree == [len(mine) for _, mine in ours.samples]
  assert max(max(ids) for ids, _ in samples) < 259
  theirs = gguf_figures(path, teacher, prompts, settings, 0, None, None)
  for key in ("on_policy_teacher_nll", "on_policy_reverse_kl"):
    np.testing.assert_allclose(theirs[key], ours.figures[key], rtol=2e-3, atol=2e-4,
                               err_msg=key)
  assert theirs["on_policy_tokens"] == ours.figures["on_policy_tokens"]
  # The standard errors over prompts: the same samples scored per prompt by distillax's forward
  # and by llama.cpp's logits agree as the figures do.
  ours_se = distillax_se(quantized, teacher, prompts, [ids for _, ids in ours.samples], settings,
                         None, None)
  for key in ("on_policy_teacher_nll_se", "on_policy_reverse_kl_se"):
    assert ours_se[key] > 0, key
    np.testing.assert_allclose(theirs[key], ours_se[key], rtol=1e-2, atol=2e-4, err_msg=key)
