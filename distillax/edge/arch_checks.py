"""Which llama.cpp architecture a distillax model is exported as (`gguf_architecture`), and what
llama.cpp would run differently from it, refused in one UserError line before anything is
written: a sliding window where llama.cpp attends fully, a RoPE scaling the architecture does
not read, an MoE that drops tokens or has dense layers llama.cpp's architecture has not, and
each architecture's fixed patterns (gpt-oss, gemma2, gemma3, smollm3 here; gemma4 and qwen35 in
edge/gemma4_qwen35.py; the others' in edge/arch_hooks.py). edge/export.py writes the file.
"""

from __future__ import annotations

from distillax.edge.arch_hooks import HOOKS
from distillax.edge.gemma4_qwen35 import QWEN35_ARCHS, check_gemma4, check_qwen35
from distillax.errors import UserError
from distillax.models.config import TransformerConfig
from distillax.models.hf.config_out import hf_architecture

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                 "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "llama",
                 "GptOssForCausalLM": "gpt-oss", "Gemma3ForCausalLM": "gemma3",
                 "SmolLM3ForCausalLM": "smollm3", "Gemma4ForCausalLM": "gemma4",
                 "Qwen3_5ForCausalLM": "qwen35", "Qwen3_5MoeForCausalLM": "qwen35moe",
                 "Olmo3ForCausalLM": "olmo2", "Phi3ForCausalLM": "phi3",
                 "Qwen3NextForCausalLM": "qwen3next", "Llama4ForCausalLM": "llama4",
                 "DeepseekV3ForCausalLM": "deepseek2", "Glm4MoeForCausalLM": "glm4moe"}
_SLIDING = ("gemma2", "gpt-oss")  # the archs whose even layers slide in llama.cpp
# The MoE archs some of whose layers may have a dense MLP (llama4: interleaved; deepseek2,
# glm4moe: the first ones; their hooks' checks say which)
_DENSE_LAYER_ARCHS = tuple(arch for arch, hooks in HOOKS.items() if hooks.dense_layers)
_ROPE_SCALING = {"llama": "llama3", "gpt-oss": "yarn", "gemma3": "linear",  # what each reads
                 **{arch: hooks.rope_scaling for arch, hooks in HOOKS.items()}}


def gguf_architecture(config: TransformerConfig) -> str:
  """llama.cpp's architecture for a config, or a UserError naming what llama.cpp would change."""
  hf_arch = hf_architecture(config)
  if hf_arch not in ARCHITECTURES:
    raise UserError(f"GGUF export of {hf_arch} models (model.num_experts={config.num_experts}) "
                    f"is not supported yet; GGUF takes {', '.join(ARCHITECTURES)}: export this "
                    f"one with --format hf")
  arch = ARCHITECTURES[hf_arch]
  local = [config.layer_uses_sliding_window(i) for i in range(config.num_layers)]
  slides = _SLIDING + ("gemma3", "gemma4") + tuple(a for a, h in HOOKS.items() if h.sliding)
  if (arch not in slides and any(local)
      and config.sliding_window < config.max_seq_len):
    raise UserError(f"llama.cpp's {arch} architecture attends over the whole context; "
                    f"sliding_window={config.sliding_window} < max_seq_len={config.max_seq_len} "
                    f"would run differently there (set sliding_window to None or >= max_seq_len)")
  scaling = None if config.rope_scaling_factor is None else config.rope_scaling_type
  if scaling not in (None, _ROPE_SCALING.get(arch)):
    only = [a for a, s in _ROPE_SCALING.items() if s == scaling]
    named = " and ".join([", ".join(only[:-1]), only[-1]] if len(only) > 2 else only)
    raise UserError(f"llama.cpp applies {scaling} RoPE scaling only to the {named} "
                    f"architecture{'s' * (len(only) > 1)}, not {arch}; set "
                    f"rope_scaling_factor=None")
  if config.num_experts:
    _check_experts(config, arch)
  if arch == "gpt-oss":
    _check_gpt_oss(config)
  if arch in ("gemma3", "smollm3"):
    _check_fixed_layer_patterns(config, arch)
  if arch == "gemma4":
    check_gemma4(config)
  if arch in QWEN35_ARCHS:
    check_qwen35(config)
  if arch in HOOKS:  # olmo2, phi3, qwen3next, llama4, deepseek2, glm4moe (edge/arch_hooks.py)
    HOOKS[arch].check(config)
  if arch == "gemma2":
    _check_gemma2(config)
  return arch


def _check_gemma2(config: TransformerConfig) -> None:
  """What llama.cpp's gemma2 fixes in code: the even layers sliding, both soft-caps, and its
  query scale."""
  _check_gemma2_windows(config)
  if config.attn_logit_softcap is None or config.final_logit_softcap is None:
    raise UserError("llama.cpp's gemma2 always soft-caps attention and output logits; set "
                    "attn_logit_softcap and final_logit_softcap")
  scale = config.query_pre_attn_scalar or config.head_dim
  llama_cpp_scale = (config.embed_dim // config.num_heads if config.num_layers == 46
                     else config.head_dim)  # llama.cpp's rule (27B: embed / heads)
  if scale != llama_cpp_scale:
    raise UserError(f"llama.cpp's gemma2 scales queries by {llama_cpp_scale}**-0.5 for "
                    f"{config.num_layers} layers; query_pre_attn_scalar={scale} would differ")


def _check_experts(config: TransformerConfig, arch: str) -> None:
  """llama.cpp's MoE layers route softmax -> top-k -> renormalise (qwen3moe and llama alike:
  Mixtral's top-k -> softmax is the same numbers) and never drop a token."""
  if arch == "qwen3moe" and not config.norm_topk_prob:
    raise UserError("llama.cpp's qwen3moe renormalises the top-k router weights; "
                    "norm_topk_prob=False would run differently there (set it to True)")
  if config.moe_layers is not None and arch not in _DENSE_LAYER_ARCHS:
    dense = [i for i in range(config.num_layers) if not config.layer_is_moe(i)]
    raise UserError(f"llama.cpp's {arch} has experts in every layer; this model's layers "
                    f"{dense} have a dense MLP (model.moe_layers={list(config.moe_layers)}): "
                    f"export it with --format hf")
  if config.moe_capacity_factor is not None:
    raise UserError(f"llama.cpp runs every expert dropless; moe_capacity_factor="
                    f"{config.moe_capacity_factor} drops tokens in this model (set it to None)")


def _check_gpt_oss(config: TransformerConfig) -> None:
  """What llama.cpp's gpt-oss fixes in code: the clamped SwiGLU's constants, YaRN's attention
  factor (0.1 ln(factor) + 1) and the even layers sliding."""
  if (config.swiglu_alpha, config.swiglu_limit) != (1.702, 7.0):
    raise UserError(f"llama.cpp's gpt-oss clamps its SwiGLU with alpha 1.702 and limit 7.0; "
                    f"swiglu_alpha={config.swiglu_alpha}, swiglu_limit={config.swiglu_limit} "
                    f"would run differently there")
  if config.rope_attention_factor is not None:
    raise UserError(f"llama.cpp's gpt-oss scales YaRN's cos/sin by 0.1 ln(factor) + 1; "
                    f"rope_attention_factor={config.rope_attention_factor} would run differently "
                    f"there (set it to None)")
  if config.rope_scaling_factor is not None and not config.rope_yarn_truncate:
    raise UserError("llama.cpp floors and ceils the ends of YaRN's ramp; rope_yarn_truncate="
                    "False (gpt-oss's own setting) runs differently there (max |logit "
                    "difference| 1e-3 on a tiny model, 0.11 at q4_0): train the student with "
                    "--config.model.rope_yarn_truncate=True to deploy it in llama.cpp")
  _check_gemma2_windows(config, "gpt-oss")


def _check_gemma2_windows(config: TransformerConfig, arch: str = "gemma2") -> None:
  """llama.cpp's gemma2 (and gpt-oss) fix which layers slide: the even ones (it reads the window
  size from the file, but no per-layer pattern), so a model whose layers attend otherwise, e.g.
  a student made of teacher blocks that were all sliding, is refused rather than run
  differently. A window no shorter than the context makes a layer's type moot."""
  if config.sliding_window is None or config.sliding_window >= config.max_seq_len:
    return
  ours = config.local_layers()
  theirs = [i % 2 == 0 for i in range(config.num_layers)]
  if ours != theirs:
    name = lambda local: ["sliding" if x else "full" for x in local]
    raise UserError(f"llama.cpp's {arch} runs layers {name(theirs)} (even layers sliding; a GGUF "
                    f"cannot say otherwise) but this model's are {name(ours)} (sliding_window="
                    f"{config.sliding_window}); export it with --format hf, or derive the "
                    f"student from blocks that alternate sliding/full from the first")


def _check_fixed_layer_patterns(config: TransformerConfig, arch: str) -> None:
  """What llama.cpp's gemma3 and smollm3 fix in code: gemma3 slides five layers in six with its
  local RoPE at base 10k unscaled, never soft-caps attention and scales queries by head_dim
  (by embed / heads at 62 layers, the 27B); smollm3 turns no RoPE in every 4th layer."""
  n = config.num_layers
  if arch == "smollm3":
    every_4th = tuple(i for i in range(n) if (i + 1) % 4 == 0) or None
    if config.rope_free_layers != every_4th:
      raise UserError(f"llama.cpp's smollm3 leaves RoPE out of every 4th layer "
                      f"{list(every_4th or ())}; rope_free_layers={config.rope_free_layers} "
                      f"would run differently there (export it with --format hf)")
    return
  sliding = config.sliding_window is not None and config.sliding_window < config.max_seq_len
  if sliding and config.local_layers() != [(i + 1) % 6 != 0 for i in range(n)]:
    raise UserError(f"llama.cpp's gemma3 slides five layers in six (a GGUF cannot say otherwise) "
                    f"but this model's sliding layers are "
                    f"{[i for i, x in enumerate(config.local_layers()) if x]}; export it with "
                    f"--format hf, or derive the student from blocks in that pattern")
  if sliding and config.rope_local_theta != 10_000.0:
    raise UserError(f"llama.cpp's gemma3 turns its sliding layers at RoPE base 10000, unscaled; "
                    f"rope_local_theta={config.rope_local_theta} would run differently there")
  if config.attn_logit_softcap is not None:
    raise UserError(f"llama.cpp's gemma3 does not soft-cap attention; attn_logit_softcap="
                    f"{config.attn_logit_softcap} would run differently there (set it to None)")
  scale = config.query_pre_attn_scalar or config.head_dim
  llama_cpp_scale = config.embed_dim // config.num_heads if n == 62 else config.head_dim
  if scale != llama_cpp_scale:
    raise UserError(f"llama.cpp's gemma3 scales queries by {llama_cpp_scale}**-0.5 for {n} "
                    f"layers; query_pre_attn_scalar={scale} would differ")
