"""llama.cpp's figures measure what they claim: its validation loss over the packed segments
equals distillax's segment-masked loss on the same batch (in total and segment by segment), the
memory is the llama.cpp child's own, and interleaved rounds time every file once a round."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.data import batch as batch_spec
from distillax.edge import measurements
from distillax.edge.export import write_gguf
from distillax.framework import losses
from distillax.models.presets import get_preset
from distillax.models.init import create_model
from tests.edge.helpers import byte_eval_batches

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def batches():
  return byte_eval_batches()


@pytest.fixture(scope="module")
def model():
  return create_model(get_preset("tiny", vocab_size=384), seed=3)


def _speed(batch, decode_tokens: int) -> dict:
  inputs = batch[batch_spec.INPUTS]
  return {"prompt": inputs[0].tolist(), "decode": inputs[1][:decode_tokens].tolist(), "rounds": 1}


def test_segments_are_the_packed_documents_with_every_trained_target(batches):
  segs = measurements.segments(batches)
  assert len(segs) >= len(batches) * 8  # every row holds at least one piece
  for b, row, first, inputs, targets, mask in segs:
    batch = batches[b]
    slots = slice(first, first + len(inputs))
    assert batch[batch_spec.INPUTS][row][slots].tolist() == inputs
    assert batch[batch_spec.TARGETS][row][slots].tolist() == targets
    assert batch[batch_spec.POSITIONS][row][slots].tolist() == list(range(len(inputs)))
    assert len(set(batch[batch_spec.SEGMENT_IDS][row][slots].tolist())) == 1
  total = sum(float(np.sum(b[batch_spec.LOSS_MASK])) for b in batches)
  assert sum(sum(s[-1]) for s in segs) == total


def _distillax_token_nll(model, batch):
  """distillax's per-token NLL of `batch` and its masked mean (the segment-masked forward)."""
  graph, state = nnx.split(model)

  @jax.jit
  def run(state, batch):
    m = nnx.merge(graph, state)
    logits = m(batch[batch_spec.INPUTS], **losses.model_inputs(batch)).logits_BxLxV
    nll, _, tokens = losses.cross_entropy_sums(logits, batch[batch_spec.TARGETS],
                                               batch[batch_spec.LOSS_MASK])
    return losses.token_nll(logits, batch[batch_spec.TARGETS]), nll / tokens

  token_nll_BxL, mean = run(state, {k: jnp.asarray(v) for k, v in batch.items()})
  return np.asarray(token_nll_BxL), float(mean)


def _own_rss_bytes() -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_llama_cpp_loss_over_segments_is_distillaxs_packed_loss(batches, model, tmp_path):
  path = tmp_path / "m.gguf"
  write_gguf(model, path, quant="f32")
  segs = measurements.segments(batches[:1])
  row = measurements.file_figures(path, segs, _speed(batches[0], 8), n_threads=1,
                                  greedy_prompts=[[5, 6, 7]], greedy_tokens=3)
  token_nll_BxL, want = _distillax_token_nll(model, batches[0])
  assert row["val_loss"] == pytest.approx(want, abs=1e-5)
  assert row["val_perplexity"] == pytest.approx(math.exp(want), rel=1e-4)
  assert len(row["segment_nll"]) == len(segs)
  assert measurements.max_segment_diff(segs, row["segment_nll"], token_nll_BxL) < 1e-4
  assert [len(g) for g in row["greedy"]] == [3]
  assert row["file_bytes"] == os.path.getsize(path)
  assert row["prompt_tokens"] == 32 and row["decode_tokens"] == 8
  assert row["prompt_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0
  # The child's own memory: more than its interpreter alone, far less than this JAX process.
  assert 0 < row["rss_before_load_bytes"] <= row["peak_rss_bytes"] < _own_rss_bytes()
  assert (row["kernels"], row["kv_cache"]) == ("reference", "f32")  # the judge's path


def test_interleaved_rounds_time_every_file_once_a_round(batches, model, tmp_path):
  paths = {}
  for quant in ("q8_0", "f32"):  # not alphabetical: the given order is the order run
    paths[quant] = str(tmp_path / f"m-{quant}.gguf")
    write_gguf(model, paths[quant], quant=quant)
  seen = []
  runs = measurements.interleaved_rounds(
      paths, {**_speed(batches[0], 4), "rounds": 2}, rounds=2, n_threads=1, exact_cache=False,
      on_round=lambda i, so_far: seen.append((i, [len(so_far[n]["decode_s"]) for n in paths])))
  assert seen == [(0, [1, 1]), (1, [2, 2])]
  assert list(runs) == ["q8_0", "f32"]
  for run in runs.values():
    assert all(len(run[key]) == 2 for key in measurements.ROUND_FIGURES)
    assert all(t > 0 for t in run["prompt_s"] + run["decode_s"])
    assert all(0 < a <= b for a, b in zip(run["rss_before_load_bytes"], run["peak_rss_bytes"]))
    assert run["kernels"] == "reference" and run["system_info"]


def test_max_segment_diff_compares_each_segment_with_its_own_slots():
  segs = [(0, 0, 0, [5, 6], [6, 7], [1.0, 1.0]), (0, 0, 2, [8], [9], [1.0]),
          (1, 0, 0, [1], [2], [1.0])]
  token_nll = np.array([[1.0, 2.0, 4.0, 0.0]])
  # segment sums 3.0 and 4.0 (batch 1 is not compared)
  assert measurements.max_segment_diff(segs, [3.5, 4.0, 100.0], token_nll) == pytest.approx(0.5)


def test_greedy_agreement_counts_the_shared_leading_tokens():
  assert measurements.greedy_agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]]) == [2, 2]
  assert measurements.greedy_agreement([[7]], [[8]]) == [0]
