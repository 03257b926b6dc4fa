"""benchmarks/linear_attention.py's measurement at toy size, in this process: the chunked and
recurrent Gated DeltaNet layers agree (loss and gradients) and the reported ratios are those of
their rows."""

import pytest

from benchmarks import linear_attention as bench


def test_chunked_and_recurrent_layers_agree_and_the_ratios_are_their_rows():
  s = {"tokens": 40, "embed_dim": 16, "key_heads": 1, "value_heads": 2, "head_dim": 8,
       "chunk": 16, "reps": 1}
  res = bench.measure_layer(s)
  assert res["check"]["pass"], res["check"]
  rows = {r["impl"]: r for r in res["rows"]}
  assert sorted(rows) == ["chunked", "recurrent"]
  assert res["temp_chunked_over_recurrent"] == pytest.approx(
      rows["chunked"]["temp_bytes"] / rows["recurrent"]["temp_bytes"])
  assert res["time_chunked_over_recurrent"] > 0
  assert rows["chunked"]["loss"] == pytest.approx(rows["recurrent"]["loss"], rel=1e-4)
