"""The pass over a job's data before anything compiles (data/survey.py): every record checked,
records with nothing to train counted and logged once, and a split or a process's share with no
token to train refused in one line. Chats are rendered by a ChatML template file for the byte
tokenizer: no tokenizer to train, no model, no compile."""

import logging

import numpy as np
import pytest

from distillax.data import make_tokenizer, make_train_iterator
from distillax.data.survey import check_data
from distillax.errors import UserError
from tests.data import chat_testing as ct
from tests.data.data_testing import data_config

BYTES = make_tokenizer("byte")


def _chats(count, unanswered, seed):
  """`count` chats; those at `unanswered` keep only their user and system turns."""
  out = []
  for i, messages in enumerate(ct.conversations(count, seed=seed)):
    if i in unanswered:
      messages = [m for m in messages if m["role"] != "assistant"]
    out.append({"messages": messages})
  return out


@pytest.fixture
def template(tmp_path):
  path = tmp_path / "chatml.jinja"
  path.write_text(ct.CHATML)
  return str(path)


def _config(tmp_path, template, train, evaluation, **fields):
  source = ct.write_jsonl(tmp_path / "train.jsonl", train)
  eval_source = ct.write_jsonl(tmp_path / "eval.jsonl", evaluation)
  return data_config(source=source, eval_source=eval_source, chat_template=template, **fields)


def test_some_chats_without_an_answer_are_skipped_counted_and_logged_once(tmp_path, template,
                                                                         caplog):
  train, evaluation = _chats(10, {1, 4, 7}, seed=5), _chats(4, {2}, seed=6)
  cfg = _config(tmp_path, template, train, evaluation)
  with caplog.at_level(logging.WARNING):
    survey = check_data(cfg, BYTES)
  assert survey.records == {"train": 10, "eval": 4}
  assert survey.skipped == {"train": 3, "eval": 1}
  lines = [r.getMessage() for r in caplog.records if "nothing to train" in r.getMessage()]
  assert len(lines) == 1 and "3 of the 10 train records, 1 of the 4 eval records" in lines[0]
  # The data still trains: one pass holds every answered chat and none of the others.
  batches = list(make_train_iterator(data_config(**{**cfg, "num_epochs": 1, "shuffle_buffer": 0}),
                                     global_batch_size=2, seq_len=64, seed=0,
                                     process_index=0, process_count=1))
  text = BYTES.decode(np.concatenate([b["inputs_BxL"].ravel() for b in batches]))
  for i, record in enumerate(train):
    user = next(m["content"] for m in record["messages"] if m["role"] == "user")
    assert (user in text) == (i not in {1, 4, 7}), i


def test_a_split_with_no_token_to_train_is_one_line(tmp_path, template):
  answered = _chats(4, set(), seed=7)
  cfg = _config(tmp_path, template, _chats(6, set(range(6)), seed=8), answered)
  with pytest.raises(UserError) as raised:
    check_data(cfg, BYTES)
  message = str(raised.value)
  assert "\n" not in message
  for fragment in ("the 6 train records", "train.jsonl", "no token to train",
                   "assistant turn", "--config.data.loss_on=all"):
    assert fragment in message, fragment
  # Every token trained: nothing is skipped.
  assert check_data({**cfg, "loss_on": "all"}, BYTES).skipped == {"train": 0, "eval": 0}
  # Only the eval records lack answers: the eval (which divides by its tokens) is refused.
  cfg = _config(tmp_path, template, answered, _chats(3, {0, 1, 2}, seed=9))
  with pytest.raises(UserError, match=r"the 3 eval records of data source '.*eval\.jsonl' "
                                      r"have no token to train"):
    check_data(cfg, BYTES)
  # The prompt-only recipes (sequence KD) need answers in eval only.
  assert check_data(_config(tmp_path, template, _chats(2, {0, 1}, seed=8), answered), BYTES,
                    splits=("eval",)).skipped["train"] == 2


def test_a_process_whose_share_has_nothing_to_train_is_named(tmp_path, template):
  """Process p reads documents p, p + P, ...: with answers only at even places, process 1 of 2
  would wait forever for a token while process 0 trains."""
  train = _chats(6, {1, 3, 5}, seed=10)
  cfg = _config(tmp_path, template, train, _chats(4, set(), seed=11))
  with pytest.raises(UserError, match=r"process 1's share \(3 train records\).*fewer processes"):
    check_data(cfg, BYTES, process_count=2)
  assert check_data(cfg, BYTES, process_count=3).skipped["train"] == 3


def test_every_record_is_read_before_training(tmp_path, template):
  """A bad record at the very end of a file fails the pass, not a step hours in."""
  train = _chats(5, set(), seed=12)
  train[-1]["messages"][-1]["role"] = "bot"
  cfg = _config(tmp_path, template, train, _chats(2, set(), seed=13))
  with pytest.raises(UserError, match=r"train\.jsonl: line 5: message \d of 'messages' has role "
                                      r"'bot'.*rename it to 'assistant'"):
    check_data(cfg, BYTES)
  path = tmp_path / "train.jsonl"
  path.write_bytes(path.read_bytes().replace(b'"bot"', b'"assistant"') + b'{"text": "caf\xe9"}\n')
  with pytest.raises(UserError, match=r"train\.jsonl: line 6 is not UTF-8"):
    check_data(cfg, BYTES)
  # Parquet rows, read one row group at a time, are named by row.
  rows = _chats(7, {0}, seed=14)
  rows[6]["messages"][0]["role"] = "narrator"
  parquet = ct.write_parquet(tmp_path / "train.parquet", rows, row_group_size=3)
  with pytest.raises(UserError, match=r"train\.parquet: row 6: message 0 .*'narrator'.*rename it "
                                      r"to one of these"):
    check_data({**cfg, "source": parquet}, BYTES)


def test_text_files_train_by_their_size_and_are_not_records(tmp_path, caplog):
  """An empty text file (an empty __init__.py of the default corpus) is skipped without a word;
  a folder of only empty files has nothing to train."""
  (tmp_path / "text").mkdir()
  for name, text in (("a.txt", "some text"), ("b.txt", ""), ("c.txt", "more")):
    (tmp_path / "text" / name).write_text(text)
  cfg = data_config(source=str(tmp_path / "text"), eval_source=str(tmp_path / "text" / "a.txt"))
  with caplog.at_level(logging.WARNING):
    survey = check_data(cfg, BYTES)
  assert survey.records == {"train": 0, "eval": 0} and survey.skipped == {"train": 0, "eval": 0}
  assert not [r for r in caplog.records if "nothing to train" in r.getMessage()]
  with pytest.raises(UserError, match=r"the 1 train records .*b\.txt' have no token to train"):
    check_data({**cfg, "source": str(tmp_path / "text" / "b.txt")}, BYTES)
