"""OLMo 3 students as GGUF (llama.cpp's olmo2), run in llama.cpp (the edge extra, f32 KV cache,
reference kernels) against distillax's forward: the logits of 40 tokens, and greedy decoding
token for token (llama.cpp's KV-cached decode against distillax's full forward), with a top-1
margin that dwarfs the two runtimes' logit difference. What llama.cpp fixes in code and a model
would run differently is refused in one line.

Measured here (40 tokens), max |logit difference| (logit scale):
  olmo2  f32 7.1e-6 (6.7), YaRN x8 on the full layer, its sliding layers unscaled; tied:
         3.6e-5 (35.2), the embedding written again as output.weight
"""

import numpy as np
import pytest

from distillax.edge.export import gguf_architecture
from distillax.errors import UserError
from distillax.models.presets import get_preset
from tests.edge.helpers import VOCAB
from tests.edge.test_llama_cpp import run
from tests.support.models import PEAKED, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONFIGS = {
    # OLMo 3: three sliding layers (window 8 < the 40 tokens, plain RoPE) then a full one with
    # YaRN x8 over 32 positions; base 50 so RoPE turns far within 40 tokens.
    "olmo2": get_preset("tiny_olmo3", vocab_size=VOCAB, rope_theta=50.0, rope_local_theta=50.0),
}
# Tied, the embedding is written a second time as llama.cpp's output.weight (a PEAKED tied model
# predicts each token itself, so its greedy run repeats one id: compared, not required to vary).
CONFIGS["olmo2_tied"] = CONFIGS["olmo2"].replace(tie_embeddings=True)


@pytest.mark.parametrize("name,tolerance", [("olmo2", 1e-4), ("olmo2_tied", 1e-4)])
def test_llama_cpp_runs_these_families_as_distillax_does(tmp_path, name, tolerance):
  arch = name.split("_")[0]
  assert gguf_architecture(CONFIGS[name]) == arch
  model = random_model(CONFIGS[name], init=PEAKED)
  r = run(model, tmp_path / "m.gguf", "f32", generate=True)
  delta = float(np.abs(r["llama_cpp"] - r["distillax"]).max())
  print(f"\n{name} f32: max |dlogit| llama.cpp vs distillax {delta:.1e} (logit scale "
        f"{np.abs(r['distillax']).max():.1f}); greedy margin {r['margin']:.3f}")
  assert np.abs(r["distillax"]).max() > 1.0 and delta <= tolerance
  assert r["reference"]["tokens"] == r["distillax_tokens"]
  if not model.config.tie_embeddings:
    assert len(set(r["distillax_tokens"])) > 8  # a sequence, not one repeated id
  assert r["margin"] > 100 * delta  # no near-tie decided it


@pytest.mark.parametrize("changes,says", [
    ({"head_dim": 32}, r"head_dim = embed_dim / num_heads = 16; head_dim=32 cannot be stored"),
    ({"sliding_window_pattern": 2}, "slides three layers in four"),
    ({"rope_local_theta": None}, "turns its sliding layers unscaled .* set rope_local_theta=50.0"),
    ({"rope_attention_factor": 1.5}, r"scales cos/sin by 0.1 ln\(factor\) \+ 1 = 1.207944"),
])
def test_what_llama_cpps_olmo2_runs_otherwise_is_refused(changes, says):
  with pytest.raises(UserError, match=says):
    gguf_architecture(CONFIGS["olmo2"].replace(**changes))
