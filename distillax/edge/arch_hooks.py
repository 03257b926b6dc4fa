"""What write_gguf asks of llama.cpp's olmo2, phi3, qwen3next, llama4, deepseek2 and glm4moe
architectures beyond the shared layout (edge/layout.py), one `ArchHooks` each: their refusals,
`{arch}.*` keys, merged tensors and names, and tensors of no parameter. The families themselves
are edge/olmo2_phi3.py, edge/qwen3next_llama4.py and edge/deepseek.py; arch_checks.py,
export.py and layout.py consult `HOOKS`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from distillax.edge import deepseek
from distillax.edge import olmo2_phi3 as op
from distillax.edge import qwen3next_llama4 as ql
from distillax.edge.gemma4_qwen35 import add_qwen35_hparams, check_qwen35
from distillax.models.config import TransformerConfig

Tensors = list[tuple[tuple[str, ...], str, np.ndarray]]  # (sources, pseudo name, array)


def _none(*_args) -> list:
  return []


@dataclasses.dataclass(frozen=True)
class ArchHooks:
  """One architecture's part of a GGUF export."""

  check: Callable[[TransformerConfig], None]  # raises what llama.cpp would run otherwise
  hparams: Callable  # (writer, config): its `{arch}.*` keys
  # (config, rows, params) -> tensors made of several parameters, written instead of them
  merged: Callable[..., Tensors] = _none
  # (config, rows) -> tensors written beside their sources (a tied output's second copy)
  copies: Callable[..., Tensors] = _none
  extra: Callable[[TransformerConfig], list[tuple[str, np.ndarray]]] = _none  # no parameter's
  names: Callable[[TransformerConfig, int], dict[str, str]] = lambda config, layer: {}
  rope_scaling: str | None = None  # the RoPE scaling llama.cpp reads for it ('yarn': layout.py
  # writes YaRN's keys)
  sliding: bool = False  # whether llama.cpp runs sliding layers for it (checks say which)
  partial_rope: bool = False  # whether its RoPE turns rotary_dim features only
  interleaved_rope: bool = False  # whether it turns adjacent pairs (q/k rows permuted, as llama)
  dense_ffn_length: bool = False  # feed_forward_length is the dense layers' width (llama4)
  dense_layers: bool = False  # an MoE of it may have dense layers (its check says which)
  # config -> (head_count_kv, key_length, value_length) when not the heads' own (deepseek2's
  # absorbed latent attention)
  attention_lengths: Callable[[TransformerConfig], tuple[int, int, int]] | None = None
  # (config, {param: type}): refuses quant types of parameters it stores otherwise (deepseek2)
  check_types: Callable[[TransformerConfig, dict[str, str]], None] = _none


def _check_qwen3next(config: TransformerConfig) -> None:
  check_qwen35(config)  # the same Gated DeltaNet state sizes
  ql.check_qwen3next(config)


def _qwen3next_merged(config, rows, params) -> Tensors:
  return [t for i in range(config.num_layers) for t in ql.qwen3next_tensors(i, rows, params,
                                                                            config)]


def _deepseek2_merged(config, rows, params) -> Tensors:
  return [t for i in range(config.num_layers) for t in deepseek.deepseek_tensors(i, rows, params,
                                                                                 config)]


HOOKS = {
    "olmo2": ArchHooks(op.check_olmo2, op.add_olmo2_hparams, copies=op.olmo2_tensors,
                       rope_scaling="yarn", sliding=True),
    "phi3": ArchHooks(op.check_phi3, op.add_phi3_hparams,
                      merged=lambda config, rows, params: op.phi3_tensors(config, rows),
                      extra=op.phi3_rope_factors, names=lambda config, layer: op.PHI3_NAMES,
                      rope_scaling="longrope", partial_rope=True),
    "qwen3next": ArchHooks(_check_qwen3next, add_qwen35_hparams, merged=_qwen3next_merged,
                           names=ql.qwen3next_names, partial_rope=True),
    "llama4": ArchHooks(ql.check_llama4, ql.add_llama4_hparams, names=ql.llama4_names,
                        rope_scaling="llama3", interleaved_rope=True, dense_ffn_length=True,
                        dense_layers=True),
    "deepseek2": ArchHooks(lambda config: deepseek.check(config, "deepseek2"),
                           lambda writer, config: deepseek.add_hparams(writer, config,
                                                                       "deepseek2"),
                           merged=_deepseek2_merged, names=lambda config, layer: deepseek.NAMES,
                           rope_scaling="yarn", partial_rope=True, dense_ffn_length=True,
                           dense_layers=True, attention_lengths=deepseek.attention_lengths,
                           check_types=deepseek.check_types),
    "glm4moe": ArchHooks(lambda config: deepseek.check(config, "glm4moe"),
                         lambda writer, config: deepseek.add_hparams(writer, config, "glm4moe"),
                         names=lambda config, layer: {**deepseek.NAMES, **deepseek.GLM_NAMES},
                         partial_rope=True, dense_ffn_length=True, dense_layers=True),
}


def arch_tensors(hooks: ArchHooks, config: TransformerConfig, tensors: Tensors, rows: dict,
                 params: dict) -> Tensors:
  """`tensors` (one per parameter) as the architecture stores them: its merged tensors instead
  of the parameters they are made of, and its copies beside theirs."""
  merged = hooks.merged(config, rows, params)
  taken = {source for sources, _, _ in merged for source in sources}
  return [t for t in tensors if t[1] not in taken] + merged + hooks.copies(config, rows)
