"""Fixtures for the data tests."""

import pytest

from tests.data.data_testing import random_texts, write_text_files


@pytest.fixture
def corpus(tmp_path):
  """40 text files of varied length in tmp_path/corpus; returns (folder, texts)."""
  texts = random_texts(40, seed=0)
  folder = str(tmp_path / "corpus")
  write_text_files(folder, texts)
  return folder, texts
