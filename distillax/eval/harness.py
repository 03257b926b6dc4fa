"""lm-evaluation-harness's LM interface over distillax's own compiled forward and sampler.

`DistillaxLM` answers lm-eval's three request kinds for a model `distillax generate` loads (a
run in the form it trained: QAT fake-quant from qat.start_step on, LoRA merged; or a Hugging
Face directory), with the tokenizer it was trained with:

- loglikelihood: (context, continuation) pairs are tokenized as lm-eval's HF backend does
  (TemplateLM: trailing spaces of the context move to the continuation; the pair is encoded
  whole and split at the context's length), truncated on the left to max_length + 1 tokens, and
  scored by models/scoring.py (padded to a few length buckets, a fixed batch).
- loglikelihood_rolling: lm-eval's own rolling windows of max_length tokens, each scored as a
  loglikelihood request, summed per document.
- generate_until: the KV-cached sampler (greedy unless a task asks to sample), prompts
  right-padded to a power of two and batched; text cut at the first stop string.

BOS: a prompt starts as the model's training documents did (the run's data.add_bos; a Hugging
Face directory: BOS when its tokenizer has one), and an empty context is the prefix token (BOS,
else EOS), as in lm-eval.
"""

from __future__ import annotations

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.models.utils import postprocess_generated_text

from distillax.errors import UserError
from distillax.models.completions import complete_batch
from distillax.models.scoring import TokenScorer


class DistillaxLM(TemplateLM):
  """lm-eval's LM for a `distillax.generate.LoadedModel`."""

  def __init__(self, loaded, *, batch_size: int = 8, max_gen_toks: int = 256):
    super().__init__()
    self.loaded = loaded
    self.tok = loaded.tokenizer
    self.batch_size = batch_size
    self._max_gen_toks = max_gen_toks
    self._scorer = None
    self._sampler = None

  @property
  def scorer(self) -> TokenScorer:
    if self._scorer is None:
      self._scorer = TokenScorer(self.loaded.model, batch_size=self.batch_size,
                                 mesh=self.loaded.placement[0], vocab_limit=self.tok.vocab_size)
    return self._scorer

  @property
  def sampler(self):
    from distillax.models.sampler import Sampler
    if self._sampler is None:
      self._sampler = Sampler(self.loaded.model)
    return self._sampler

  @property
  def max_length(self) -> int:
    return int(self.loaded.model.config.max_seq_len)

  @property
  def eot_token_id(self) -> int:
    if self.tok.eos_id is None:
      raise UserError(f"{self.tok!r} has no EOS token, which lm-eval's requests need")
    return int(self.tok.eos_id)

  @property
  def prefix_token_id(self) -> int:
    return int(self.tok.bos_id) if self.tok.bos_id is not None else self.eot_token_id

  @property
  def tokenizer_name(self) -> str:
    return repr(self.tok)

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    """The ids of `string`, BOS first when the model's documents started with one (or when
    `add_special_tokens` says so)."""
    bos = self.loaded.add_bos if add_special_tokens is None else add_special_tokens
    ids = list(self.tok.encode(string))
    return ([self.tok.bos_id] if bos and self.tok.bos_id is not None else []) + ids

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    """(sum of the continuation's log-probabilities, whether every continuation token was the
    model's greedy choice) per (key, context ids, continuation ids)."""
    # An empty continuation (a choice of no tokens) has log-likelihood 0: nothing to score.
    scored = [i for i, (_, _, cont) in enumerate(requests) if cont]
    rows = [(list(requests[i][1]) + list(requests[i][2]))[-(self.max_length + 1):]
            for i in scored]
    out = [(0.0, True)] * len(requests)
    for i, (logprob_T, argmax_T) in zip(scored, self.scorer(rows) if rows else []):
      n = len(requests[i][2])
      out[i] = (float(logprob_T[-n:].sum()), bool(argmax_T[-n:].all()))
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """The log-likelihood of each whole document: lm-eval's disjoint windows of max_length
    tokens (each predicted from the prefix token, then from the window before)."""
    windows, owner = [], []
    for i, (string,) in enumerate(req.args for req in requests):
      for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1)):
        windows.append((None, ctx, cont))
        owner.append(i)
    totals = [0.0] * len(requests)
    for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
      totals[i] += logprob
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Each context's continuation, decoded and cut at the request's stop strings; requests
    with the same generation settings are decoded together."""
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
    out = [""] * len(requests)
    for members in groups.values():
      kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self._max_gen_toks)
      for start in range(0, len(members), self.batch_size):
        picked = members[start:start + self.batch_size]
        texts = self._generate([requests[i].args[0] for i in picked], dict(kwargs))
        for i, text in zip(picked, texts):
          out[i] = text
    return out

  def _generate(self, contexts: list[str], kwargs: dict) -> list[str]:
    until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
    steps = int(kwargs.pop("max_gen_toks"))
    if self.max_length - steps < 1:
      raise UserError(f"a task asks for max_gen_toks={steps} new tokens, the model's "
                      f"max_seq_len is {self.max_length}: no room is left for the context")
    temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
    rows = complete_batch(self.sampler, [self.tok_encode(c) for c in contexts],
                          batch_size=self.batch_size, max_new_tokens=steps,
                          pad_id=self.tok.pad_id, stop_ids=tuple(self.loaded.stop_ids),
                          vocab_limit=self.tok.vocab_size, temperature=temperature,
                          top_p=kwargs.get("top_p"), top_k=kwargs.get("top_k"),
                          seed=int(kwargs.get("seed", 0) or 0))
    return [postprocess_generated_text(self.tok.decode(ids), until, None) for ids in rows]
