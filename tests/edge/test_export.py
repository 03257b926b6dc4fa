"""GGUF export read back with the llama.cpp project's own reader (`gguf.GGUFReader`): every tensor
equals the (QAT-rounded) weights bit for bit, in llama.cpp's names, layouts and types; the
metadata and the vocabulary say what llama.cpp needs; what llama.cpp would run differently is
refused. (tests/edge/test_llama_cpp.py runs the files in llama.cpp.)"""

import gguf
import numpy as np
import pytest
from flax import nnx

from distillax.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer
from distillax.errors import UserError
from distillax.models.hf import checkpoint as hf
from distillax.models.layers import rope_inverse_frequencies
from distillax.models.transformer import with_layer_layout
from distillax.quant import QuantSiteParam, full_precision, quantize_for_training
from distillax.quant.graph import get_path
from distillax.edge.export import gguf_architecture, write_gguf
from distillax.edge.vocab import vocab_of
from tests.edge.helpers import CONFIGS, field
from tests.support.models import PEAKED, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Hugging Face tensor names -> llama.cpp's (convert_hf_to_gguf.py's mapping for these archs).
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
HF_TO_GGUF_GEMMA2 = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                     "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                     "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def expected_tensors(model, arch):
  """{GGUF name: float32 array} from the Hugging Face export of the same model (a separately
  tested layout) with llama.cpp's conventions applied as convert_hf_to_gguf.py does."""
  names = dict(HF_TO_GGUF)
  names.update(HF_TO_GGUF_GEMMA2 if arch == "gemma2" else
               {"post_attention_layernorm.weight": "ffn_norm.weight"})
  config, out = model.config, {}
  for hf_name, array in hf.hf_tensors(model):
    array = np.asarray(array, np.float32)
    if hf_name.startswith("model.layers."):
      layer, suffix = hf_name[len("model.layers."):].split(".", 1)
      name = f"blk.{layer}.{names[suffix]}"
    else:
      name = names[hf_name]
    if arch == "llama" and suffix_of(hf_name) in ("q_proj.weight", "k_proj.weight"):
      heads = config.num_heads if "q_proj" in hf_name else config.num_kv_heads
      array = array.reshape(heads, 2, array.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(
          array.shape)
    if config.norm_scale_plus_one and hf_name.endswith("norm.weight"):
      array = (np.float32(1) + array).astype(np.float32)
    out[name] = array
  return out


def suffix_of(hf_name):
  return hf_name.rsplit(".", 2)[-2] + "." + hf_name.rsplit(".", 1)[-1]


def read(path):
  reader = gguf.GGUFReader(path)
  tensors = {}
  for t in reader.tensors:
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    tensors[t.name] = (t.tensor_type.name, np.asarray(values, np.float32))
  return reader, tensors


def assert_bitwise(got, want, name):
  assert got.shape == want.shape, name
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=name)


def test_f32_tensors_read_back_as_the_weights(tmp_path):
  model = random_model(CONFIGS["llama"], init=PEAKED)
  write_gguf(model, tmp_path / "m.gguf", quant="f32")
  reader, tensors = read(tmp_path / "m.gguf")
  want = expected_tensors(model, "llama")
  assert set(tensors) == set(want) | {"rope_freqs.weight"}
  for name, array in want.items():
    assert tensors[name][0] == "F32"
    assert_bitwise(tensors[name][1], array, name)
  # llama.cpp divides each RoPE frequency by its factor: the factors are our scaled frequencies.
  plain = rope_inverse_frequencies(CONFIGS["llama"].replace(rope_scaling_factor=None))
  scaled = rope_inverse_frequencies(CONFIGS["llama"])
  np.testing.assert_allclose(tensors["rope_freqs.weight"][1], np.asarray(plain / scaled),
                             rtol=1e-6)
  assert field(reader, "general.architecture") == "llama"
  assert field(reader, "general.file_type") == 0  # ALL_F32


# q8_0 for the MLP of layer 0 (unrolled; a scanned model's rules see one 'layers/mlp' module,
# so there every layer's MLP), q4_0 elsewhere, output projection included; q8_0 activations.
RULES = {False: ((r"layers/0/mlp", "q8_0", "q8_0", None), (".*", "q4_0", "q8_0", None)),
         True: ((r"layers/mlp", "q8_0", "q8_0", None), (".*", "q4_0", "q8_0", None))}


@pytest.mark.parametrize("scan_layers", [False, True])
def test_qat_weights_read_back_bit_for_bit(tmp_path, scan_layers):
  model = with_layer_layout(random_model(CONFIGS["llama"], init=PEAKED), scan_layers)
  qat = quantize_for_training(model, {"rules": RULES[scan_layers]})
  write_gguf(qat, tmp_path / "m.gguf", quant="q4_0", rules=RULES[scan_layers])
  # The weights the QAT forward reads (rounded on read), in the plain unrolled model.
  rounded = full_precision(qat)
  for path, var in nnx.iter_graph(qat):
    if isinstance(var, QuantSiteParam):
      get_path(rounded, path).set_value(var[...])
  rounded = with_layer_layout(rounded, False)
  reader, tensors = read(tmp_path / "m.gguf")
  want = expected_tensors(rounded, "llama")
  for name, array in want.items():
    assert_bitwise(tensors[name][1], array, name)
  types = {name: kind for name, (kind, _) in tensors.items()}
  assert types["blk.0.ffn_down.weight"] == types["blk.0.ffn_up.weight"] == "Q8_0"
  assert types["blk.1.ffn_down.weight"] == ("Q8_0" if scan_layers else "Q4_0")
  assert types["blk.0.attn_output.weight"] == types["blk.1.attn_q.weight"] == "Q4_0"
  assert types["output.weight"] == "Q4_0"
  assert types["token_embd.weight"] == "F32"  # untied: a lookup, never a quantized matmul
  assert {types[n] for n in types if "norm" in n or n == "rope_freqs.weight"} == {"F32"}
  assert field(reader, "general.file_type") == 2  # MOSTLY_Q4_0
  # Rounding happened: the q4_0 blocks differ from the full-precision weights.
  fp = expected_tensors(with_layer_layout(model, False), "llama")
  assert not np.array_equal(tensors["blk.1.attn_q.weight"][1], fp["blk.1.attn_q.weight"])


def test_tied_gemma2_embedding_norms_and_metadata(tmp_path):
  config = CONFIGS["gemma2"]
  model = random_model(config, init=PEAKED)
  write_gguf(model, tmp_path / "m.gguf", quant="q4_0")  # no rules: every matmul weight
  reader, tensors = read(tmp_path / "m.gguf")
  qat = quantize_for_training(model, {"rules": ((".*", "q4_0", None, None),)})
  assert "output.weight" not in tensors  # llama.cpp reuses token_embd when tied
  assert tensors["token_embd.weight"][0] == "Q4_0"
  assert_bitwise(tensors["token_embd.weight"][1], np.asarray(qat.embedder.embedding[...]),
                 "token_embd.weight")
  want = expected_tensors(model, "gemma2")
  for name in [n for n in want if "norm" in n]:  # 1 + scale, float32
    assert tensors[name][0] == "F32"
    assert_bitwise(tensors[name][1], want[name], name)
  keys = {"gemma2.context_length": 128, "gemma2.embedding_length": 64, "gemma2.block_count": 2,
          "gemma2.feed_forward_length": 128, "gemma2.attention.head_count": 4,
          "gemma2.attention.head_count_kv": 2, "gemma2.attention.key_length": 16,
          "gemma2.attention.value_length": 16, "gemma2.attn_logit_softcapping": 50.0,
          "gemma2.final_logit_softcapping": 30.0, "gemma2.attention.sliding_window": 8,
          "gemma2.attention.sliding_window_pattern": 2, "gemma2.rope.freq_base": 10000.0}
  assert {k: field(reader, k) for k in keys} == keys
  assert field(reader, "gemma2.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)


def test_f16_keeps_norms_and_biases_in_f32(tmp_path):
  model = random_model(CONFIGS["qwen2"], init=PEAKED)
  write_gguf(model, tmp_path / "m.gguf", quant="f16")
  _, tensors = read(tmp_path / "m.gguf")
  want = expected_tensors(model, "qwen2")
  for name, array in want.items():
    small = "norm" in name or name.endswith(".bias")
    assert tensors[name][0] == ("F32" if small else "F16"), name
    expected = array if small else array.astype(np.float16).astype(np.float32)
    assert_bitwise(tensors[name][1], expected, name)


def test_byte_tokenizer_as_llama_cpp_byte_tokens(tmp_path):
  write_gguf(random_model(CONFIGS["qwen3"], init=PEAKED), tmp_path / "m.gguf")
  reader, _ = read(tmp_path / "m.gguf")
  tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
  assert field(reader, "tokenizer.ggml.model") == "llama" and len(tokens) == 384
  assert tokens[:3] == ["<pad>", "</s>", "<s>"] and types[:3] == [3, 3, 3]  # control
  tok = ByteTokenizer()
  assert tok.encode("A\n") == [0x41 + 3, 0x0A + 3]  # byte b is id b + 3
  for byte in (0x00, 0x0A, 0x41, 0xE2, 0xFF):
    assert (tokens[byte + 3], types[byte + 3]) == (f"<0x{byte:02X}>", 6)  # byte tokens
  assert tokens[tok.encode(" ")[0]] == "\u2581"  # llama.cpp's SPM reads spaces as U+2581
  assert tokens[259:] == [f"<unused{i}>" for i in range(259, 384)] and set(types[259:]) == {5}
  ids = {k: field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
  assert ids == {"bos": tok.bos_id, "eos": tok.eos_id, "padding": tok.pad_id}
  assert field(reader, "tokenizer.ggml.add_bos_token") is True
  assert field(reader, "tokenizer.ggml.add_space_prefix") is False


def byte_level_bpe(tmp_path):
  """A small byte-level BPE tokenizer.json (GPT-2's pre-tokenizer), trained here."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  text = ["the quick brown fox jumps over the lazy dog. " * 3, "Pack my box with five dozen "
          "liquor jugs! 1234567 + 89 = ?", "naïve café — déjà vu\n\tthe end"] * 20
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<pad>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(text, trainer)
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  return HuggingFaceTokenizer(str(path))


def test_hf_byte_level_bpe_as_gpt2_vocabulary(tmp_path):
  import json
  tok = byte_level_bpe(tmp_path)
  spec = json.loads((tmp_path / "tokenizer.json").read_text())
  vocab = vocab_of(tok, 512)
  assert (vocab.model, vocab.pre) == ("gpt2", "gpt-2")
  assert vocab.merges == [m if isinstance(m, str) else " ".join(m)
                          for m in spec["model"]["merges"]]
  by_id = {i: t for t, i in spec["model"]["vocab"].items()}
  assert vocab.tokens[:tok.vocab_size] == [by_id[i] for i in range(tok.vocab_size)]
  assert vocab.tokens[tok.vocab_size:] == [f"[PAD{i}]" for i in range(tok.vocab_size, 512)]
  assert vocab.types[0] == vocab.types[1] == 3  # the added special tokens: control
  assert vocab.eos_id == 0 and vocab.pad_id == 1


@pytest.mark.parametrize("change,quant,rules,match", [
    (dict(sliding_window=8), "f32", None, "sliding_window=8"),
    (dict(rope_scaling_factor=None), "q5_k", None, "--quant='q5_k'"),
    (dict(rope_scaling_factor=None), "q4_0", ((".*", "int4", None, None),), "int4"),
    (dict(rope_scaling_factor=None), "q4_0", ((".*", "q8_0", None, None),), "--quant q8_0"),
    (dict(rope_scaling_factor=None, mlp_dim=80), "q4_0", None, "multiple of 32"),
    (dict(qkv_bias=True), "f32", None, "only to the llama and llama4 architectures"),
])
def test_what_llama_cpp_would_run_differently_is_refused(tmp_path, change, quant, rules, match):
  model = random_model(CONFIGS["llama"].replace(**change), init=PEAKED)
  with pytest.raises(UserError, match=match):
    write_gguf(model, tmp_path / "m.gguf", quant=quant, rules=rules)
  assert not (tmp_path / "m.gguf").exists()


def test_gemma2_sliding_layers_llama_cpp_does_not_run_are_refused(tmp_path):
  """llama.cpp's gemma2 slides on the even layers, whatever the file says: every layer sliding
  (pattern 0) or a student's own layer types are refused, nothing written; a window that covers
  the whole context makes the pattern moot."""
  gemma2 = CONFIGS["gemma2"]
  assert gemma2.local_layers() == [True, False] and gemma2.sliding_window < gemma2.max_seq_len
  for change in (dict(sliding_window_pattern=0),
                 dict(layer_types=("full_attention", "sliding_attention"))):
    with pytest.raises(UserError, match=r"llama.cpp's gemma2 runs layers \['sliding', 'full'\]"):
      write_gguf(random_model(gemma2.replace(**change), init=PEAKED), tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()
  wide = gemma2.replace(sliding_window_pattern=0, sliding_window=gemma2.max_seq_len)
  assert gguf_architecture(wide) == "gemma2"


def test_gemma2_with_another_query_scale_is_refused(tmp_path):
  model = random_model(CONFIGS["gemma2"].replace(query_pre_attn_scalar=256.0), init=PEAKED)
  with pytest.raises(UserError, match="query_pre_attn_scalar=256"):
    write_gguf(model, tmp_path / "m.gguf")


def test_an_embedding_smaller_than_the_tokenizer_is_refused():
  with pytest.raises(UserError, match="vocab_size is 128"):
    vocab_of(ByteTokenizer(), 128)
