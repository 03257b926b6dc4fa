"""A Gemma 3-style Hugging Face tokenizer through distillax's import: SentencePiece-style pieces
('▁' for spaces, byte fallback), <pad> 0, <eos> 1, <bos> 2, the turn markers <start_of_turn> /
<end_of_turn>, image markers, and <image_soft_token> as its last id, one past the text model's
table as in Gemma 3 1B (262,145 tokens over 262,144 rows). Built here with `tokenizers` and
saved by transformers (nothing is downloaded); its chat template is written in Gemma 3's form
(BOS, '<start_of_turn>user' / 'model' turns closed by '<end_of_turn>', a system prompt folded
into the first user turn)."""

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from distillax.data import ChatRecord, check_vocab, encode_chat, make_tokenizer  # noqa: E402
from distillax.data.chat import template_for  # noqa: E402
from distillax.errors import ConfigError  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
MARKERS = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>"]
TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') }}"
    "{%- if m['content'] is string -%}{{ m['content'] | trim }}"
    "{%- else -%}{%- for item in m['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- else -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
MESSAGES = ({"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "hello, héllo!"},
            {"role": "user", "content": "and now?"},
            {"role": "assistant", "content": "world"})


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory):
  from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
  vocab = {t: i for i, t in enumerate(SPECIALS)}
  vocab.update({f"<0x{b:02X}>": len(SPECIALS) + b for b in range(256)})
  for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz,.!?\n", "▁hello", "▁world"]:
    vocab.setdefault(piece, len(vocab))
  merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o"),
            ("▁", "w"), ("▁w", "o"), ("▁wo", "r"), ("▁wor", "l"), ("▁worl", "d")]
  for a, b in merges:
    vocab.setdefault(a + b, len(vocab))
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
  tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                         normalizers.Replace(" ", "▁")])
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t in MARKERS + ["<image_soft_token>"]])
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>",
                                              eos_token="<eos>", pad_token="<pad>",
                                              unk_token="<unk>")
  fast.chat_template = TEMPLATE
  folder = tmp_path_factory.mktemp("gemma3_tokenizer")
  fast.save_pretrained(str(folder))
  return str(folder)


def test_a_gemma3_tokenizer_reads_its_ids_and_chat_as_transformers_does(gemma3_folder):
  ours = make_tokenizer(f"hf:{gemma3_folder}")
  theirs = transformers.AutoTokenizer.from_pretrained(gemma3_folder)
  assert (ours.pad_id, ours.eos_id, ours.bos_id) == (0, 1, 2)
  assert {"<start_of_turn>", "<end_of_turn>"} <= set(ours.control_tokens)
  text = "hello world, héllo 日本"  # byte fallback for what the pieces lack
  assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
  assert ours.decode(ours.encode(text)) == text
  want = theirs.apply_chat_template(list(MESSAGES), tokenize=False)
  assert template_for(ours).render(list(MESSAGES)) == want
  assert want.startswith("<bos><start_of_turn>user\nBe brief.\n\nhello world<end_of_turn>")
  ids, mask = encode_chat(ChatRecord(MESSAGES), ours, template_for(ours))
  assert ids.tolist() == list(theirs.apply_chat_template(list(MESSAGES), tokenize=True,
                                                          return_dict=True)["input_ids"])
  # Trained: each answer and the <end_of_turn> closing it (the model learns to stop there).
  trained = [ours._tok.decode(ids[np.flatnonzero(np.diff(np.r_[0, mask, 0]) == 1)[k]:
                                  np.flatnonzero(np.diff(np.r_[0, mask, 0]) == -1)[k]].tolist(),
                              skip_special_tokens=False) for k in range(2)]
  assert trained == ["hello, héllo!<end_of_turn>", "world<end_of_turn>"], trained


def test_a_table_one_row_short_of_the_gemma3_tokenizer_fits_but_not_shorter(gemma3_folder):
  """<image_soft_token> (the last id) is special and in no text or template: a model without
  its row fits, as Gemma 3 1B does. <end_of_image> too; <start_of_image> is in the template and
  <end_of_turn> ends every turn: a table without them is refused."""
  tokenizer = make_tokenizer(f"hf:{gemma3_folder}")
  n = tokenizer.vocab_size
  check_vocab(tokenizer, n - 1)
  check_vocab(tokenizer, n - 2)
  for short in (3, 4, 6):
    with pytest.raises(ConfigError, match=f"vocab_size={n - short} is smaller"):
      check_vocab(tokenizer, n - short)
