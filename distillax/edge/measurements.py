"""Figures of GGUF files in llama.cpp, on the tokens distillax trains and evaluates on.

  segs = segments(batches)                  # every packed document, its positions from 0
  row = file_figures(path, segs, speed)     # val loss over segs, bytes, tokens/s, peak RSS
  runs = interleaved_rounds(paths, speed, rounds=3)   # several files' speed, paired by round
  max_segment_diff(segs, row["segment_nll"], token_nll_BxL)   # against distillax's own NLL
  greedy_agreement(llama_cpp_tokens, distillax_tokens)

Every figure comes from `gguf_runtime.measure_in_subprocess`: one child process per file (numpy
and llama_cpp only), so the memory is llama.cpp's and a crash in llama.cpp stays in the child.
The demo's edge stage and `benchmarks/edge.py` are built on these.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from distillax.data import batch as batch_spec
from distillax.edge import runtime as gguf_runtime

# What a row keeps of the child's figures (see gguf_runtime.measure_in_subprocess).
RUN_FIGURES = ("prompt_tokens_per_s", "decode_tokens_per_s", "peak_rss_bytes",
               "rss_before_load_bytes", "n_threads", "prompt_tokens", "decode_tokens", "kernels",
               "system_info")
# Figures measured once per file and round in `interleaved_rounds`.
ROUND_FIGURES = ("prompt_s", "decode_s", "peak_rss_bytes", "rss_before_load_bytes")

Segment = tuple[int, int, int, list[int], list[int], list[float]]


def segments(batches) -> list[Segment]:
  """(batch index, row, first slot, inputs, targets, loss mask) of every packed segment with a
  trained target, in batch, row, slot order: a segment's positions restart at 0, so llama.cpp
  evaluating it alone from position 0 computes what distillax's segment-masked forward
  computes."""
  out = []
  for b, batch in enumerate(batches):
    seg = batch[batch_spec.SEGMENT_IDS]
    for row in range(seg.shape[0]):
      for s in np.unique(seg[row][seg[row] > 0]):
        slots = np.flatnonzero(seg[row] == s)  # contiguous: packing lays a piece in one run
        mask = batch[batch_spec.LOSS_MASK][row][slots]
        if mask.sum() > 0:
          out.append((b, row, int(slots[0]), batch[batch_spec.INPUTS][row][slots].tolist(),
                      batch[batch_spec.TARGETS][row][slots].tolist(), mask.tolist()))
  return out


def file_figures(path: str | os.PathLike, segs: Sequence[Segment], speed: Mapping[str, Any], *,
                 n_threads: int | None = None, kernels: str = "reference",
                 exact_cache: bool = True, greedy_prompts: Sequence[Sequence[int]] = (),
                 greedy_tokens: int = 32, vocab_limit: int | None = None) -> dict[str, Any]:
  """One file in one child process: val_loss / val_perplexity over the segments' trained
  tokens, the file's bytes, the KV cache type, the RUN_FIGURES (speed of `speed`'s prompt and
  decode tokens, memory, kernel path, llama.cpp's system info), each segment's CE sum
  ("segment_nll") and llama.cpp's greedy continuation of each of greedy_prompts ("greedy").
  vocab_limit: the tokenizer's size, whose ids the losses take their softmax over."""
  r = gguf_runtime.measure_in_subprocess(
      path, sequences=[s[3:] for s in segs], speed=dict(speed), n_threads=n_threads,
      greedy_prompts=greedy_prompts, greedy_tokens=greedy_tokens, kernels=kernels,
      exact_cache=exact_cache, vocab_limit=vocab_limit)
  nll, tokens = float(sum(r["nll"])), float(sum(sum(s[-1]) for s in segs))
  out = {"val_loss": nll / tokens, "val_perplexity": math.exp(nll / tokens),
         "file_bytes": os.path.getsize(path), "kv_cache": "f32" if exact_cache else "f16",
         **{k: r[k] for k in RUN_FIGURES}, "segment_nll": r["nll"],
         "greedy": r.get("greedy", [])}
  return out


def interleaved_rounds(paths: Mapping[str, str | os.PathLike], speed: Mapping[str, Any], *,
                       rounds: int, n_threads: int | None = None, kernels: str = "reference",
                       exact_cache: bool = True,
                       on_round: Callable[[int, dict], None] | None = None) -> dict[str, dict]:
  """Speed and memory of several files, one child process per (round, file), the files in the
  same order every round, so a slow moment of a shared machine hits them alike and ratios can
  be paired by round. {name: {ROUND_FIGURES: one value per round (the child's median over its
  own `speed["rounds"]` for times), "kernels", "system_info"}}; on_round(i, so_far) after each."""
  runs = {name: {key: [] for key in ROUND_FIGURES} for name in paths}
  for i in range(rounds):
    for name, path in paths.items():
      got = gguf_runtime.measure_in_subprocess(path, speed=dict(speed), n_threads=n_threads,
                                               exact_cache=exact_cache, kernels=kernels)
      runs[name]["kernels"], runs[name]["system_info"] = got["kernels"], got["system_info"]
      for key in ROUND_FIGURES:
        runs[name][key].append(float(statistics.median(got[key])) if key.endswith("_s")
                               else got[key])
    if on_round is not None:
      on_round(i, runs)
  return runs


def max_segment_diff(segs: Sequence[Segment], llama_cpp_nll: Sequence[float], token_nll_BxL,
                     batch_index: int = 0) -> float:
  """max over the segments of one batch of |llama.cpp's CE sum - distillax's| (token_nll_BxL:
  distillax's per-token -log p(target) of that batch)."""
  diffs = []
  for (b, row, first, inputs, _, mask), theirs in zip(segs, llama_cpp_nll):
    if b == batch_index:
      ours = token_nll_BxL[row][first:first + len(inputs)]
      diffs.append(abs(theirs - float(np.sum(np.asarray(mask, np.float64) * ours))))
  return max(diffs)


def greedy_agreement(llama_cpp_tokens, distillax_tokens) -> list[int]:
  """Per prompt, how many leading tokens the two greedy continuations share."""
  out = []
  for a, b in zip(llama_cpp_tokens, distillax_tokens):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
      n += 1
    out.append(n)
  return out
