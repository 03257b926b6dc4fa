"""Helpers for the data tests: tiny corpora on disk and an independent reading of packed batches.

Imported as `tests.data.data_testing` (tests/ is a package; the repository root is on sys.path).
"""

import os
import random

import numpy as np


def random_texts(count, seed, min_len=0, max_len=120):
  """Distinct texts of varied length (some empty, some longer than a row), with non-ASCII."""
  rng = random.Random(seed)
  alphabet = "abcdefghij klmnop\nqrs\ttuvwxyz.,:()é€中🙂"
  texts = []
  for i in range(count):
    body = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
    texts.append(f"doc{i}:" + body if body else "")
  return texts


def write_text_files(folder, texts, suffix=".txt"):
  os.makedirs(folder, exist_ok=True)
  paths = []
  for i, text in enumerate(texts):
    path = os.path.join(folder, f"f{i:04d}{suffix}")
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)
    paths.append(path)
  return paths


def byte_ids(text, bos=2, eos=1):
  """The byte tokenizer's document encoding, written out independently: [BOS] bytes+3 [EOS]."""
  if not text:
    return []
  return [bos] + [b + 3 for b in text.encode("utf-8")] + [eos]


def check_row_invariants(batch, pad_id=0):
  """Segment ids run 1..S left to right then padding; positions restart per segment; targets
  inside a segment are the next input; the loss mask is exactly the non-padding slots."""
  seg_BxL = batch["segment_ids_BxL"]
  for b in range(seg_BxL.shape[0]):
    seg = seg_BxL[b]
    used = int(np.count_nonzero(seg))
    assert np.all(seg[:used] > 0) and np.all(seg[used:] == 0), "padding only at the row end"
    if used:
      assert seg[0] == 1
      assert set(np.diff(seg[:used]).tolist()) <= {0, 1}
    for s in range(1, int(seg.max()) + 1):
      idx = np.flatnonzero(seg == s)
      np.testing.assert_array_equal(batch["positions_BxL"][b, idx], np.arange(len(idx)))
      np.testing.assert_array_equal(batch["targets_BxL"][b, idx[:-1]],
                                    batch["inputs_BxL"][b, idx[1:]])
    np.testing.assert_array_equal(batch["loss_mask_BxL"][b], (seg > 0).astype(np.float32))
    assert np.all(batch["inputs_BxL"][b, used:] == pad_id)
    assert np.all(batch["positions_BxL"][b, used:] == 0)


def reconstruct_documents(batches, eos_id):
  """Token lists of the documents in packed batches read in order: a document's pieces are
  consecutive segments, and its last piece ends on the target EOS."""
  docs, current = [], []
  for batch in batches:
    for b in range(batch["segment_ids_BxL"].shape[0]):
      seg = batch["segment_ids_BxL"][b]
      for s in range(1, int(seg.max(initial=0)) + 1):
        idx = np.flatnonzero(seg == s)
        current.extend(batch["inputs_BxL"][b, idx].tolist())
        if batch["targets_BxL"][b, idx[-1]] == eos_id:
          docs.append(current + [eos_id])
          current = []
  assert current == [], "a document was left unfinished"
  return docs


def data_config(**fields):
  from distillax.data import default_data_config
  cfg = default_data_config()
  for key, value in fields.items():
    cfg[key] = value
  return cfg


# ---- an iterator's state kept outside the trainer's checkpoint (the tests' own round trips) ----

def save_iterator_state(iterator, path):
  """The iterator's state as a JSON file (data.iterator_state_json)."""
  from distillax.data import iterator_state_json
  with open(path, "w") as f:
    f.write(iterator_state_json(iterator))


def load_iterator_state(iterator, path):
  from distillax.data import restore_iterator_state
  with open(path) as f:
    restore_iterator_state(iterator, f.read())


def orbax_save_args(iterator):
  """grain's own orbax item for the iterator: `ocp.args.Composite(data=orbax_save_args(it))`
  in a CheckpointManager save (one `process_<i>-of-<n>.json` per JAX process)."""
  import grain
  return grain.checkpoint.CheckpointSave(iterator)


def orbax_restore_args(iterator):
  """The restore twin: orbax sets the state of `iterator` (a fresh one, built the same way)."""
  import grain
  return grain.checkpoint.CheckpointRestore(iterator)
