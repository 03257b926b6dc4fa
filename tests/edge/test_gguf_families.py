"""Gemma 3 and SmolLM3 students as GGUF (llama.cpp's gemma3 and smollm3), run in llama.cpp (the
edge extra, f32 KV cache, reference kernels) against distillax's forward at the dense exports'
tolerances: the plain forward for f32, the QAT forward (q4_0 weights, q8_0 rows) for q4_0.
What llama.cpp fixes in code and a model would run differently is refused in one line.

Measured here (40 tokens, reference kernels), max |logit difference|:
  gemma3   f32 2.1e-4 (logit scale 3.9), q4_0 1.2e-6 (4.1), with llama.cpp's fp16 GELU table
           in distillax's forward (helpers.table_gelu; Gemma 2's f32 is 1.6e-4 the same way)
  smollm3  f32 4.8e-6 (logit scale 12.3), q4_0 3.8e-6
The q4_0 runs were measured by hand (add them to the parametrize list below to rerun them):
their block path is the one test_llama_cpp's gemma2 and llama q4_0 runs hold, and the gemma3
one took 4 to 16 s, with the machine's load deciding.
"""

import numpy as np
import pytest

from distillax.edge.gguf_export import gguf_architecture
from distillax.errors import UserError
from distillax.models.presets import get_preset
from tests.edge.helpers import VOCAB
from tests.edge.test_llama_cpp import run
from tests.support.models import PEAKED, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONFIGS = {
    # 5 sliding layers (window 8 < the 40 tokens, RoPE base 10k) then a global one at 1M with
    # linear x8 scaling; llama.cpp scales queries by head_dim at this size.
    "gemma3": get_preset("tiny_gemma3", vocab_size=VOCAB, query_pre_attn_scalar=None),
    # SmolLM3's every-4th RoPE-free layer, at theta 50 so RoPE turns far within 40 tokens.
    "smollm3": get_preset("tiny", vocab_size=VOCAB, num_layers=4, rope_free_layers=(3,),
                          rope_theta=50.0),
}


@pytest.mark.parametrize("arch,quant,tolerance", [
    ("gemma3", "f32", 1e-3), ("smollm3", "f32", 1e-4)])
def test_gemma3_and_smollm3_match_llama_cpp(tmp_path, arch, quant, tolerance):
  assert gguf_architecture(CONFIGS[arch]) == arch
  model = random_model(CONFIGS[arch], init=PEAKED)
  r = run(model, tmp_path / "m.gguf", quant, llama_cpp_gelu=arch == "gemma3")
  delta = float(np.abs(r["llama_cpp"] - r["distillax"]).max())
  print(f"\n{arch} {quant}: max |dlogit| llama.cpp vs distillax {delta:.1e} (logit scale "
        f"{np.abs(r['distillax']).max():.1f})")
  assert delta <= tolerance


@pytest.mark.parametrize("changes,says", [
    ({"sliding_window_pattern": 2}, "slides five layers in six"),
    ({"rope_local_theta": 20_000.0}, "base 10000"),
    ({"query_pre_attn_scalar": 24.0}, r"scales queries by 16\*\*-0.5"),
])
def test_what_llama_cpps_gemma3_runs_otherwise_is_refused(changes, says):
  with pytest.raises(UserError, match=says):
    gguf_architecture(CONFIGS["gemma3"].replace(**changes))


def test_what_llama_cpps_smollm3_runs_otherwise_is_refused():
  with pytest.raises(UserError, match=r"every 4th layer \[3\]"):
    gguf_architecture(CONFIGS["smollm3"].replace(rope_free_layers=(1,)))
