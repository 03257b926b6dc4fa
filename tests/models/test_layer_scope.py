"""plan's per-layer table: the choices recorded inside each marked block, grouped by model and
by what ran."""

from distillax.models import layer_scope


def test_layers_that_ran_the_same_are_grouped_per_model():
  """A 6-layer model whose layers 2 and 5 ran another attention (Gemma 3's global layers, say),
  a 1-layer model that sampled and scored (two choices in one layer), and a probe trace that is
  no part of the step."""
  with layer_scope.recorded_by_layer() as by_layer:
    for layer in range(6):
      with layer_scope.serving((layer,), 6):
        layer_scope.record("attention", "blockwise" if layer in (2, 5) else "splash")
    with layer_scope.serving(range(6), 6):  # a scanned stack: every layer at once
      layer_scope.record("experts", "ragged")
    with layer_scope.serving((0,), 1):
      layer_scope.record("attention", "reference")
      layer_scope.record("attention", "splash")
      layer_scope.record("attention", "reference")
    with layer_scope.unrecorded(), layer_scope.serving((0,), 1):
      layer_scope.record("attention", "blockwise")
    layer_scope.record("attention", "outside any layer")
  assert by_layer == {
      "layers 0-1, 3-4 of 6": {"attention": "splash", "experts": "ragged"},
      "layers 2, 5 of 6": {"attention": "blockwise", "experts": "ragged"},
      "layer 0 of 1": {"attention": "reference + splash"}}
  assert layer_scope.ranges([9, 0, 1, 2, 3, 6, 8]) == "0-3, 6, 8-9"
