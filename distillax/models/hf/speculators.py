"""An EAGLE-3 head in the `speculators` format (what vLLM's `--speculative-config` loads).

config.json: `speculators_model_type: "eagle3"`, the draft's decoder layer as a transformers
config (`transformer_layer_config`: LlamaConfig, or Qwen3Config when the target normalises
queries and keys), `draft_vocab_size`, the target layers the head fuses
(`eagle_aux_hidden_state_layer_ids`) and `speculators_config` (algorithm, greedy proposals of
`speculative_tokens`, the verifier's architecture). model.safetensors holds the weights under
speculators' names (torch Linear layout: (out, in)), the draft vocabulary's maps when it is
reduced (`d2t`: int64 offsets, target id = draft id + d2t[draft id]; `t2d`: a bool mask over the
target's ids) and the target's embedding (`embed_tokens.weight`, which vLLM may also share from
the target). Read against speculators 0.9.0's models/eagle3 (core.py, model_definitions.py,
model.py's DraftVocabMixin); tests/test_export_speculators.py loads an export with it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from distillax.errors import UserError
from distillax.models.eagle3 import Eagle3Head
from distillax.models.hf.config_out import hf_architecture, rope_parameters

SPECULATORS_VERSION = "0.9.0"  # the format version written (and tested against)


def check_exportable(head: Eagle3Head) -> None:
  """Refuses, in one line, a head whose layer speculators' Llama/Qwen 3 layer cannot express."""
  c = head.config.layer
  why = [w for bad, w in ((c.mlp_activation != "swiglu", f"mlp_activation={c.mlp_activation!r}"),
                          (c.norm_scale_plus_one, "(1 + scale) norms"),
                          (c.qkv_bias, "q/k/v biases"),
                          (c.query_pre_attn_scalar is not None, "query_pre_attn_scalar"),
                          (c.final_logit_softcap is not None, "final_logit_softcap")) if bad]
  if why:
    raise UserError(f"the head's layer has {', '.join(why)}, which speculators' eagle3 layer "
                    f"(Llama / Qwen 3) does not express; export a head of a Llama, Qwen or "
                    f"Mistral target")


def layer_config(head: Eagle3Head, target_vocab: int) -> dict[str, Any]:
  """The transformers config of the head's decoder layer (`transformer_layer_config`)."""
  c = head.config.layer
  qwen3 = bool(c.qk_norm)
  return {"model_type": "qwen3" if qwen3 else "llama",
          "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
          "vocab_size": target_vocab, "hidden_size": c.embed_dim, "intermediate_size": c.mlp_dim,
          "num_hidden_layers": 1, "num_attention_heads": c.num_heads,
          "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
          "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
          "rope_parameters": rope_parameters(c), "rope_theta": c.rope_theta,
          "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
          "torch_dtype": c.param_dtype}


def speculators_config(head: Eagle3Head, target_config, *, target_vocab: int,
                       proposals: int, verifier_path: str | None = None) -> dict[str, Any]:
  """config.json of the export; `target_vocab`: the served target's ids (its tokenizer's)."""
  cfg = head.config
  return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
          "speculators_version": SPECULATORS_VERSION,
          "transformer_layer_config": layer_config(head, target_vocab),
          "draft_vocab_size": cfg.draft_vocab_size, "norm_before_residual": False,
          "norm_before_fc": False, "fc_norm": False, "norm_output": False,
          "embed_requires_grad": False, "target_hidden_size": None,
          "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
          "speculators_config": {
              "algorithm": "eagle3", "default_proposal_method": "greedy",
              "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": proposals,
                                    "verifier_accept_k": 1, "accept_tolerance": 0.0}],
              "verifier": {"name_or_path": verifier_path,
                           "architectures": [hf_architecture(target_config)]}}}


def _host(x) -> np.ndarray:
  return np.asarray(jax.device_get(x))


def speculators_tensors(head: Eagle3Head, target_vocab: int) -> dict[str, np.ndarray]:
  """The head's weights under speculators' names, in the torch layout."""
  cfg, c = head.config, head.config.layer
  D = c.embed_dim
  flat = lambda w: _host(w[...]).reshape(2 * D, -1).T  # (2D, heads, head_dim) -> (out, in)
  out = {"fc.weight": _host(head.fc[...]).T,
         "layers.0.self_attn.q_proj.weight": flat(head.q),
         "layers.0.self_attn.k_proj.weight": flat(head.k),
         "layers.0.self_attn.v_proj.weight": flat(head.v),
         "layers.0.self_attn.o_proj.weight": _host(head.o[...]).reshape(-1, D).T,
         "layers.0.input_layernorm.weight": _host(head.input_norm.scale[...]),
         "layers.0.hidden_norm.weight": _host(head.hidden_norm.scale[...]),
         "layers.0.post_attention_layernorm.weight": _host(head.mlp_norm.scale[...]),
         "layers.0.mlp.gate_proj.weight": _host(head.mlp.gate[...]).T,
         "layers.0.mlp.up_proj.weight": _host(head.mlp.up[...]).T,
         "layers.0.mlp.down_proj.weight": _host(head.mlp.down[...]).T,
         "norm.weight": _host(head.final_norm.scale[...]),
         "lm_head.weight": _host(head.lm_head[...]).T,
         "embed_tokens.weight": _host(head.embedding[...])[:target_vocab]}
  if c.qk_norm:
    out["layers.0.self_attn.q_norm.weight"] = _host(head.q_norm.scale[...])
    out["layers.0.self_attn.k_norm.weight"] = _host(head.k_norm.scale[...])
  if cfg.draft_vocab_size != target_vocab:
    ids = _host(head.d2t[...]).astype(np.int64)
    out["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
    t2d = np.zeros((target_vocab,), bool)
    t2d[ids] = True
    out["t2d"] = t2d
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save(head: Eagle3Head, target_config, output: str, *, target_vocab: int, proposals: int,
         verifier_path: str | None = None) -> None:
  """Writes config.json and model.safetensors of `head` to the directory `output`."""
  check_exportable(head)
  if head.config.draft_vocab_size > target_vocab:
    raise UserError(f"the head's draft vocabulary ({head.config.draft_vocab_size}) is larger "
                    f"than the target's {target_vocab} ids")
  config = speculators_config(head, target_config, target_vocab=target_vocab,
                              proposals=proposals, verifier_path=verifier_path)
  tensors = speculators_tensors(head, target_vocab)
  os.makedirs(output, exist_ok=True)
  with open(os.path.join(output, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, allow_nan=False)
  save_file(tensors, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
