"""The Hugging Face export as people use it: transformers' AutoTokenizer and
AutoModelForCausalLM load it with no extra step, apply_chat_template and generate work on it,
its tokenizer gives distillax's ids, and every file is readable by others (0644).

The chat tokenizer is a byte-level BPE trained here on the embedded corpus and saved by
transformers with a ChatML template (tests/data/chat_testing.py); nothing is downloaded.
"""

import os
import stat

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from distillax.data import ByteTokenizer, make_tokenizer
from distillax.data.chat import template_for
from distillax.models.hf import checkpoint as hf
from distillax.models.presets import get_preset
from distillax.models.hf.tokenizer import FILE_MODE
from distillax.models.sampler import Sampler
from tests.data import chat_testing as ct
from tests.support.models import forward, random_model

TEXTS = ["hello", "héllo wörld 日本 🙂", "a<s>b</s><pad> <|im_end|>", "  two  spaces\n\ttab",
         "def f(x):\n    return x  # ok"]


def _modes(folder) -> dict[str, int]:
  return {name: stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode)
          for name in os.listdir(folder)}


@pytest.fixture(scope="module")
def chat_export(tmp_path_factory):
  """(distillax model, its tokenizer, export folder) with a ChatML tokenizer."""
  folder = ct.save_tokenizer(tmp_path_factory.mktemp("tokenizer"), ct.CHATML)
  tokenizer = make_tokenizer(f"hf:{folder}")
  model = random_model(get_preset("tiny").replace(vocab_size=ct.VOCAB_SIZE), seed=3)
  out = tmp_path_factory.mktemp("export")
  hf.save(model, out, tokenizer=tokenizer)
  return model, tokenizer, str(out)


def test_transformers_chats_with_the_export_as_it_is(chat_export):
  model, tokenizer, out = chat_export
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
          "chat_template.jinja", "generation_config.json"} <= set(os.listdir(out))
  assert set(_modes(out).values()) == {FILE_MODE}
  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  for text in TEXTS + ct.corpus_sentences(8, seed=1):
    assert hf_tok(text, add_special_tokens=False).input_ids == tokenizer.encode(text), text
  messages = ct.conversation(5, turns=1)[:-1]  # system + user: the model answers
  prompt = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                      return_tensors="pt")
  rendered = template_for(tokenizer).render(messages, add_generation_prompt=True)
  ids = tokenizer.encode(rendered)
  assert prompt["input_ids"][0].tolist() == ids
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert hf_model.generation_config.eos_token_id == tokenizer.eos_id
  assert hf_model.generation_config.pad_token_id == tokenizer.pad_id
  with torch.no_grad():
    hf_logits = hf_model(**prompt).logits.numpy()
  ours = np.asarray(forward(model, jnp.asarray([ids], jnp.int32)).logits_BxLxV)
  assert np.max(np.abs(hf_logits - ours)) <= 1e-4
  # Greedy generation agrees with distillax's sampler token for token.
  with torch.no_grad():
    generated = hf_model.generate(**prompt, max_new_tokens=8, do_sample=False)
  theirs = generated[0, len(ids):].tolist()
  mine = Sampler(model)(np.asarray([ids], np.int32), max_new_tokens=8, eos_id=tokenizer.eos_id,
                        pad_id=tokenizer.pad_id).tokens_BxT[0].tolist()
  assert theirs == mine[:len(theirs)] and len(theirs) >= 1


def test_the_byte_tokenizer_exports_as_an_equivalent_hf_tokenizer(tmp_path):
  model = random_model(get_preset("tiny").replace(vocab_size=384), seed=4)
  hf.save(model, tmp_path, tokenizer=ByteTokenizer())
  assert set(_modes(tmp_path).values()) == {FILE_MODE}
  byte = ByteTokenizer()
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert (hf_tok.pad_token_id, hf_tok.eos_token_id, hf_tok.bos_token_id) == (0, 1, 2)
  for text in TEXTS + ["".join(chr(c) for c in range(1, 256))]:
    ids = hf_tok(text, add_special_tokens=False).input_ids
    assert ids == byte.encode(text), text
    assert hf_tok(text).input_ids == [byte.bos_id] + ids  # BOS first, as documents start
    assert hf_tok.decode(ids) == text == byte.decode(ids)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  prompt = hf_tok("def ", return_tensors="pt")
  with torch.no_grad():
    out = hf_model.generate(**prompt, max_new_tokens=4, do_sample=False)
  assert out.shape[1] > prompt["input_ids"].shape[1]
  assert hf_model.generation_config.bos_token_id == byte.bos_id
