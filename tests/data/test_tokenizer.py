"""Tokenizers: byte-level ids, SentencePiece and Hugging Face round trips, vocab checks."""

import io

import numpy as np
import pytest

from tests.data.chat_testing import training_lines
from tests.data.data_testing import (data_config, random_texts, reconstruct_documents,
                                     write_text_files)
from distillax.data import (ByteTokenizer, check_vocab, make_eval_iterator, make_tokenizer,
                            padded_vocab_size)
from distillax.errors import ConfigError, UserError

SAMPLE = 'def f(x):\n\treturn  x + "é€中🙂"\n\n  end '


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
  spm = pytest.importorskip("sentencepiece")
  buffer = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(training_lines()), model_writer=buffer, vocab_size=400,
      model_type="bpe", normalization_rule_name="identity", remove_extra_whitespaces=False,
      add_dummy_prefix=False, byte_fallback=True, character_coverage=1.0,
      pad_id=0, unk_id=1, bos_id=2, eos_id=3, minloglevel=2, num_threads=1)
  path = tmp_path_factory.mktemp("spm") / "tiny.model"
  path.write_bytes(buffer.getvalue())
  return str(path)


@pytest.fixture(scope="module")
def hf_tokenizer_json(tmp_path_factory):
  tokenizers = pytest.importorskip("tokenizers")
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(training_lines(), trainer)
  path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
  tok.save(str(path))
  return str(path)


def test_byte_tokenizer_ids_and_round_trip():
  tok = make_tokenizer("byte")
  assert isinstance(tok, ByteTokenizer)
  assert (tok.vocab_size, tok.pad_id, tok.eos_id, tok.bos_id) == (259, 0, 1, 2)
  ids = tok.encode(SAMPLE)
  assert ids == [b + 3 for b in SAMPLE.encode("utf-8")]
  assert tok.decode(ids) == SAMPLE
  np.testing.assert_array_equal(tok.encode_array(SAMPLE), ids)
  assert tok.encode_array(SAMPLE).dtype == np.int32
  # Specials and ids a padded model vocab might emit are dropped on decode.
  assert tok.decode([2] + ids + [1, 0, 300, 383]) == SAMPLE


def test_sentencepiece_round_trip(spm_model):
  tok = make_tokenizer(f"spm:{spm_model}")
  import sentencepiece
  reference = sentencepiece.SentencePieceProcessor(model_file=spm_model)
  assert tok.vocab_size == reference.get_piece_size() == 400
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
  ids = tok.encode(SAMPLE)
  assert ids == reference.encode(SAMPLE)
  assert len(ids) < len(SAMPLE.encode())  # merges learned: fewer ids than bytes
  assert tok.decode(ids) == SAMPLE
  assert max(ids) < tok.vocab_size


def test_hugging_face_round_trip(hf_tokenizer_json):
  tok = make_tokenizer(f"hf:{hf_tokenizer_json}")
  import tokenizers
  reference = tokenizers.Tokenizer.from_file(hf_tokenizer_json)
  assert tok.vocab_size == reference.get_vocab_size() == 320
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  ids = tok.encode(SAMPLE)
  assert ids == reference.encode(SAMPLE, add_special_tokens=False).ids
  assert tok.decode(ids) == SAMPLE
  assert tok.decode([1] + ids + [2]) == SAMPLE


@pytest.mark.parametrize("kind", ["spm", "hf"])
def test_file_tokenizers_through_the_pipeline(tmp_path, kind, request):
  path = request.getfixturevalue("spm_model" if kind == "spm" else "hf_tokenizer_json")
  tok = make_tokenizer(f"{kind}:{path}")
  texts = [t for t in random_texts(12, seed=7, min_len=1)]
  write_text_files(str(tmp_path / "c"), texts)
  cfg = data_config(source=str(tmp_path / "c"), eval_source=str(tmp_path / "c"),
                    tokenizer=f"{kind}:{path}")
  batches = list(make_eval_iterator(cfg, global_batch_size=2, seq_len=20, process_index=0,
                                    process_count=1))
  docs = reconstruct_documents(batches, eos_id=tok.eos_id)
  assert [d[0] for d in docs] == [tok.bos_id] * len(texts)
  assert [tok.decode(d) for d in docs] == texts
  assert all(b["inputs_BxL"].max() < tok.vocab_size for b in batches)


def test_check_vocab_and_padding():
  tok = ByteTokenizer()
  check_vocab(tok, 259)
  check_vocab(tok, 384)
  with pytest.raises(ConfigError, match=r"vocab_size=258 is smaller .* 259 ids.*384"):
    check_vocab(tok, 258)
  assert padded_vocab_size(tok) == 384
  assert padded_vocab_size(256) == 256 and padded_vocab_size(32001, 64) == 32064


def test_bad_tokenizer_specs(tmp_path):
  with pytest.raises(ConfigError, match="'bytes' is not a tokenizer spec"):
    make_tokenizer("bytes")
  with pytest.raises(UserError, match="no such file"):
    make_tokenizer(f"hf:{tmp_path}/missing.json")
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  pytest.importorskip("tokenizers")
  with pytest.raises(UserError, match="not a readable tokenizer.json"):
    make_tokenizer(f"hf:{bad}")
