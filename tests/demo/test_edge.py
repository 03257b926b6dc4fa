"""The demo's edge rows measure what they claim: llama.cpp's validation loss over the packed
segments equals distillax's segment-masked loss on the same batch, the memory is the llama.cpp
child's own, and the ratios the report states are computed as written."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.data import make_eval_iterator, make_tokenizer
from distillax.demo import edge
from distillax.framework import losses
from distillax.models.config import get_preset
from distillax.models.init import create_model
from distillax.quant.gguf_export import write_gguf

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def batches():
  tok = make_tokenizer("byte")
  return list(make_eval_iterator({"tokenizer": "byte"}, global_batch_size=8, seq_len=32,
                                 num_batches=2, tokenizer=tok))


def test_segments_are_the_packed_documents_with_every_trained_target(batches):
  segs = edge.segments(batches)
  assert len(segs) >= len(batches) * 8  # every row holds at least one piece
  for b, row, first, inputs, targets, mask in segs:
    batch = batches[b]
    slots = slice(first, first + len(inputs))
    assert batch[losses.BATCH_INPUTS][row][slots].tolist() == inputs
    assert batch[losses.BATCH_TARGETS][row][slots].tolist() == targets
    assert batch[losses.BATCH_POSITIONS][row][slots].tolist() == list(range(len(inputs)))
    assert len(set(batch[losses.BATCH_SEGMENTS][row][slots].tolist())) == 1
  total = sum(float(np.sum(b[losses.BATCH_MASK])) for b in batches)
  assert sum(sum(s[-1]) for s in segs) == total


def _distillax_loss(model, batch) -> float:
  graph, state = nnx.split(model)

  @jax.jit
  def sums(state, batch):
    m = nnx.merge(graph, state)
    logits = m(batch[losses.BATCH_INPUTS], **losses.model_inputs(batch)).logits_BxLxV
    nll, _, tokens = losses.cross_entropy_sums(logits, batch[losses.BATCH_TARGETS],
                                               batch[losses.BATCH_MASK])
    return nll, tokens

  nll, tokens = sums(state, {k: jnp.asarray(v) for k, v in batch.items()})
  return float(nll) / float(tokens)


def _own_rss_bytes() -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_llama_cpp_loss_over_segments_is_distillaxs_packed_loss(batches, tmp_path):
  model = create_model(get_preset("tiny", vocab_size=384), seed=3)
  path = tmp_path / "m.gguf"
  write_gguf(model, path, quant="f32")
  segs = edge.segments(batches[:1])
  speed = {**edge.speed_tokens(batches, 8), "rounds": 1}
  (row,) = edge.measure({"f32": str(path)}, segs, speed, (), 8, 1).values()
  want = _distillax_loss(model, batches[0])
  assert row["val_loss"] == pytest.approx(want, abs=1e-5)
  assert row["val_perplexity"] == pytest.approx(math.exp(want), rel=1e-4)
  assert row["file_bytes"] == os.path.getsize(path)
  assert row["prompt_tokens"] == 32 and row["decode_tokens"] == 8
  assert row["prompt_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0
  # The child's own memory: more than its interpreter alone, far less than this JAX process.
  assert 0 < row["rss_before_load_bytes"] <= row["peak_rss_bytes"] < _own_rss_bytes()
  assert (row["kernels"], row["kv_cache"]) == ("reference", "f32")  # the judge's path


def test_the_qat_file_also_runs_as_a_device_runs_it_by_default(batches, tmp_path):
  """The deployed row: the same q4_0 file on the kernels llama.cpp picks for this CPU, with a
  float16 KV cache, next to the judged row (reference kernels, float32 cache)."""
  from distillax.quant import gguf_runtime
  model = create_model(get_preset("tiny", vocab_size=384), seed=3)
  path = tmp_path / "m.gguf"
  write_gguf(model, path, quant="q4_0", rules=((".*", "q4_0", "q8_0", None),))
  speed = {**edge.speed_tokens(batches, 4), "rounds": 1}
  rows = edge.measure({"q4_0_qat": str(path)}, edge.segments(batches[:1]), speed, [[1, 2]], 4, 1)
  judged, deployed = rows["q4_0_qat"], rows[edge.DEPLOYED_ROW]
  assert (judged["kernels"], judged["kv_cache"]) == ("reference", "f32")
  assert (deployed["kernels"], deployed["kv_cache"]) == (gguf_runtime.deployment_kernels(), "f16")
  assert deployed["file_bytes"] == judged["file_bytes"] and "greedy" not in deployed
  # Measured 2e-4 nats/token apart here (f16 cache and kernel rounding); not the same run.
  assert abs(deployed["val_loss"] - judged["val_loss"]) < 1e-2
  assert "AVX" in judged["system_info"] or "NEON" in judged["system_info"]


def test_recovery_and_greedy_agreement():
  assert edge.recovery(ptq=2.0, qat=1.25, full=1.0) == pytest.approx(0.75)
  assert edge.recovery(ptq=2.0, qat=2.5, full=1.0) == pytest.approx(-0.5)  # QAT worse: < 0
  assert math.isnan(edge.recovery(ptq=1.0, qat=0.9, full=1.0))  # PTQ costs nothing
  assert edge.greedy_agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]]) == [2, 2]
  assert edge.greedy_agreement([[7]], [[8]]) == [0]


def test_max_segment_diff_compares_each_segment_with_its_own_slots():
  segs = [(0, 0, 0, [5, 6], [6, 7], [1.0, 1.0]), (0, 0, 2, [8], [9], [1.0]),
          (1, 0, 0, [1], [2], [1.0])]
  token_nll = np.array([[1.0, 2.0, 4.0, 0.0]])
  # segment sums 3.0 and 4.0 (batch 1 is not compared)
  assert edge.max_segment_diff(segs, [3.5, 4.0, 100.0], token_nll) == pytest.approx(0.5)
