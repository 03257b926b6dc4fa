"""How the train losses over the vocabulary run (`train.loss_impl`), and a record of what each
traced token loss ran, for `plan`.

- 'chunked': the vocabulary-chunk engine (vocab_chunks.py), which every distillation term can
  use: the logits of a chunk of positions at a time, plus the argmax accuracy.
- 'sliced': the vocabulary-slice engine (vocab_slices.py), faster on a TPU, for the losses it
  computes (next-token CE; one LogitKD from a live teacher, a hidden-state cache's head, a
  top-k cache of any K or several teachers; several LogitKDs over the whole vocabulary in one
  pass, each its own temperature and divergence; on-policy GeneralizedJSD or SampledTokenKL),
  with the metrics of their train and eval objectives, over any student output layer
  (soft-capped, fake-quantized or adapted).
- What still runs on the chunk engine, and why (vocab_chunks.py's docstring has the list):
  cross-tokenizer ULD, for a capability reason (it sorts each row's whole distribution);
  several logit terms of which one reads a top-k or a top-k cache (each its own bucket pass);
  and train.loss_impl='chunked', chosen by hand.
- 'auto' (the default): 'sliced' where it may run, else 'chunked'; but where a train step
  compiles for a TPU, the LogitKDs of a teacher run in the step take the chunk engine at
  ~1,024-token chunks, which the chip measured faster there (the slices make the teacher's
  logits twice: distill/tpu_chunks.py has the figures).

'tokamax' (tokamax 0.0.12's fused `linear_softmax_cross_entropy_loss`) was removed: on a TPU v5e
its Mosaic kernel's loss was 4.9% off the chunk engine's with a vocabulary that is not a whole
number of its blocks (as 151,936 is not), and its train step was slower than the sliced
engine's (953 against 895 ms: benchmarks/results/tpu/levers_call2.jsonl).
"""

from __future__ import annotations

from distillax.errors import ConfigError
from distillax.models import layer_scope

LOSS_IMPLS = ("auto", "chunked", "sliced")
REMOVED = {"tokamax": "it was removed (on a TPU its fused loss disagreed with the exact one by "
                      "4.9% and ran slower than 'sliced')"}

_COUNTER = layer_scope.ChoiceCounter("distillax_loss_choices")


def record(choice: str) -> None:
  _COUNTER.add(choice)


def recorded_choices():
  """Counts of how the token losses traced inside ran: what `plan` reports beside the attention
  and MoE choices."""
  return _COUNTER.counted()


def check_loss_impl(value, job: str, sliced: bool = False) -> None:
  """`train.loss_impl`: one of LOSS_IMPLS. 'sliced' (framework/vocab_slices.py) for a job whose
  train losses it computes (`sliced`: next-token CE, LogitKDs, on-policy scoring),
  whatever the student's output layer (plain, fake-quantized or adapted:
  `Transformer.output_operands`).
  'auto': 'sliced' where it may run, else 'chunked' (resolve_loss_impl)."""
  if value not in LOSS_IMPLS:
    why = f": {REMOVED[value]}" if value in REMOVED else ""
    raise ConfigError(f"train.loss_impl={value!r}{why}; choose one of {', '.join(LOSS_IMPLS)}")
  if value == "sliced" and not sliced:
    raise ConfigError(f"train.loss_impl='sliced': the {job} job's train losses are not ones "
                      f"vocabulary slices compute (next-token CE, LogitKDs, on-policy "
                      f"scoring); set "
                      f"--config.train.loss_impl=chunked")


def resolve_loss_impl(value, sliced: bool) -> str:
  """What train.loss_impl runs: 'auto' is 'sliced' where the job's losses allow it (on the TPU
  v5e it was 1.20x the chunked engine's KD step, 1.22x its train step:
  benchmarks/results/tpu/levers_call2.jsonl), else 'chunked'."""
  if value != "auto":
    return value
  return "sliced" if sliced else "chunked"
