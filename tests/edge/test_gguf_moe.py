"""A mixture-of-experts student has no GGUF writer yet: export says so in one line, naming the
format that does take it, instead of failing on a missing table entry."""

import pytest

from distillax.edge.gguf_export import gguf_architecture
from distillax.errors import UserError
from distillax.models.presets import get_preset


def test_gguf_export_of_an_moe_model_is_refused_in_one_line():
  with pytest.raises(UserError) as raised:
    gguf_architecture(get_preset("tiny_moe"))
  message = str(raised.value)
  assert "\n" not in message
  assert message.startswith("GGUF export of MixtralForCausalLM models (model.num_experts=4) is "
                            "not supported yet; GGUF takes LlamaForCausalLM, ")
  assert message.endswith("export this one with --format hf")
