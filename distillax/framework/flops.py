"""Analytic model FLOPs of a decoder transformer, for TFLOP/s and MFU.

Only matmuls are counted (2*m*n*k each): they are what an accelerator's peak refers to, and
elementwise work (norms, softmax, activations) is a few percent at any realistic size. The
embedding lookup is a gather, not a matmul, so it costs nothing here; the output projection to the
vocabulary is counted whether or not it shares the embedding matrix.

Attention is counted as the work a causal kernel must do: half of the full L x L score and value
products (`causal=True`), and only the band of a sliding-window layer. A naive implementation that
masks a full matrix does more; MFU is still reported against the useful part, as MaxText and PaLM
do. `causal=False` counts the full matrix (what such a naive kernel executes).

Training counts the forward three times (forward + backward, which is two matmuls per forward
matmul: one for the input gradient, one for the weight gradient). Distillation adds the frozen
teacher's forward once: it gets no backward pass.

The config is read by attribute name only (vocab_size, embed_dim, num_layers, num_heads,
num_kv_heads, head_dim, mlp_dim, mlp_activation; optionally sliding_window,
sliding_window_pattern and layer_types), so any object with those fields works, e.g.
`distillax.models.config.TransformerConfig`. tie_embeddings does not change the count.

Qwen3.5's Gated DeltaNet layers (`token_mixers` naming 'linear_attention') count their
projections and the delta rule's per-token state contractions (`linear_attention` key) instead of
attention; its full-attention layers add the output gate's projection (`attn_output_gate`).

A mixture of experts (num_experts > 0; num_experts_per_tok k, moe_mlp_dim F, 0 = mlp_dim) counts
what a dropless grouped matmul does: each token's k experts (k gated MLPs of width F) plus the
router (embed x num_experts) and a shared expert where there is one, in the layers with experts
(moe_layers; the others a dense MLP of width mlp_dim), the active-parameter convention of MoE MFU
figures; the dense reference path (`moe_impl='dense'`) executes num_experts / k times the expert
work. DeepSeek's multi-head latent attention (kv_lora_rank > 0) counts its own projections.
"""

from __future__ import annotations

from typing import Any

from distillax.errors import ConfigError

# models/remat.py's policies that keep the attention kernel's output (its forward not run again).
SAVING_ATTENTION = ("save_attention", "save_attention_qkv", "save_attention_up",
                    "save_attention_mlp")

# Activations whose MLP has a gate matrix next to the up matrix: three matmuls instead of two.
GATED_ACTIVATIONS = ("swiglu", "geglu", "reglu", "clamped_swiglu")  # the last: gpt-oss


def _field(cfg: Any, name: str, default: Any = None) -> Any:
  value = getattr(cfg, name, default)
  if value is None and default is None:
    raise ConfigError(f"model config {type(cfg).__name__} has no field '{name}': "
                      f"FLOPs counting needs it (set {name} in the model config)")
  return value


def _shape_numbers(cfg: Any) -> dict[str, int]:
  """The integer sizes the count needs, with the usual defaults filled in."""
  num_heads = int(_field(cfg, "num_heads"))
  embed_dim = int(_field(cfg, "embed_dim"))
  num_kv_heads = getattr(cfg, "num_kv_heads", None) or num_heads
  head_dim = getattr(cfg, "head_dim", None) or embed_dim // num_heads
  return dict(vocab=int(_field(cfg, "vocab_size")), embed=embed_dim,
              layers=int(_field(cfg, "num_layers")), heads=num_heads,
              kv_heads=int(num_kv_heads), head_dim=int(head_dim), mlp=int(_field(cfg, "mlp_dim")))


def mlp_matrix_count(activation: str) -> int:
  """Number of D x F matrices in one MLP block: 3 for gated (SwiGLU/GeGLU), else 2."""
  return 3 if str(activation).lower() in GATED_ACTIVATIONS else 2


def layer_windows(cfg: Any) -> list[int | None]:
  """Attention span of each layer: None = global, else the sliding window (Gemma 2 style).

  With `sliding_window` set, layer i attends globally iff (i + 1) % sliding_window_pattern == 0
  (pattern 0: every layer local), or as `layer_types` says when set, matching
  distillax.models.config.TransformerConfig.
  """
  num_layers = int(_field(cfg, "num_layers"))
  window = getattr(cfg, "sliding_window", None)
  if not window:
    return [None] * num_layers
  types = getattr(cfg, "layer_types", None)
  if types is not None:
    return [int(window) if t == "sliding_attention" else None for t in types]
  pattern = getattr(cfg, "sliding_window_pattern", 2)
  return [None if pattern and (i + 1) % pattern == 0 else int(window) for i in range(num_layers)]


def attended_pairs(seq_len: int, window: int | None, causal: bool = True) -> float:
  """(query, key) pairs a kernel computes per head: L^2 full, L^2/2 causal, ~L*W - W^2/2 local.

  The causal figures are the continuous approximations (L^2/2 rather than L(L+1)/2) that MFU
  conventions use; they meet at W = L.
  """
  if not causal:
    return float(seq_len * seq_len)
  if window is None or window >= seq_len:
    return seq_len * seq_len / 2.0
  return seq_len * window - window * window / 2.0


def forward_flops_breakdown(cfg: Any, batch: int, seq_len: int, *,
                            causal: bool = True) -> dict[str, float]:
  """Matmul FLOPs of one forward pass over a [batch, seq_len] block of tokens, by component.

  Keys: qkv_proj, out_proj (attention output), attn_scores (Q.K^T), attn_values (P.V), mlp,
  logits (output projection), linear_attention (Gated DeltaNet layers, when there are some),
  per_layer_inputs (Gemma 4's, when there are some), total. All layers are included.
  """
  n = _shape_numbers(cfg)
  tokens = batch * seq_len
  layers = n["layers"]
  mixers = getattr(cfg, "token_mixers", None) or ("full_attention",) * layers
  attends = [t != "linear_attention" for t in mixers]  # Qwen3.5: Gated DeltaNet layers do not
  attention_layers = sum(attends)
  # Gemma 4: full layers of global_head_dim; the last layers share k/v (no projections) and
  # may have double-wide MLPs.
  global_dim = int(getattr(cfg, "global_head_dim", 0) or 0)
  # Gemma 4 31B: full layers of global_num_kv_heads whose keys are their values (one projection)
  global_kv = int(getattr(cfg, "global_num_kv_heads", 0) or 0)
  keys_as_values = bool(getattr(cfg, "attention_k_eq_v", False))
  first_shared = layers - int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
  wide = bool(getattr(cfg, "double_wide_shared_mlp", False))
  gate = bool(getattr(cfg, "attn_output_gate", False))  # Qwen3.5's output gate
  qkv = out_proj = attn_product = 0.0
  for i, (window, attend) in enumerate(zip(layer_windows(cfg), attends)):
    if not attend:
      continue
    q_width = n["heads"] * (global_dim if global_dim and window is None else n["head_dim"])
    kv_heads = global_kv if global_kv and window is None else n["kv_heads"]
    kv_width = kv_heads * q_width // n["heads"] if i < first_shared else 0
    kv_projections = 1 if keys_as_values and window is None else 2
    qkv += 2.0 * tokens * n["embed"] * (q_width * (2 if gate else 1) + kv_projections * kv_width)
    out_proj += 2.0 * tokens * q_width * n["embed"]
    attn_product += 2.0 * batch * q_width * attended_pairs(seq_len, window, causal)
  mlp_matrices = mlp_matrix_count(getattr(cfg, "mlp_activation", "swiglu"))
  mlp_layers = layers + (layers - first_shared if wide else 0)  # a double-wide MLP counts twice
  out = {
      "qkv_proj": qkv,
      "out_proj": out_proj,
      "attn_scores": attn_product,
      "attn_values": attn_product,
      "mlp": mlp_layers * mlp_matrices * 2.0 * tokens * n["embed"] * n["mlp"],
      "logits": 2.0 * tokens * n["embed"] * n["vocab"],
  }
  per_layer = int(getattr(cfg, "per_layer_input_dim", 0) or 0)
  if per_layer:  # Gemma 4: the embeddings' projection, then each layer's gate and projection
    out["per_layer_inputs"] = 3 * layers * 2.0 * tokens * n["embed"] * per_layer
  if attention_layers < layers:
    out["linear_attention"] = (layers - attention_layers) * gated_deltanet_flops(cfg, tokens)
  if int(getattr(cfg, "kv_lora_rank", 0) or 0):  # DeepSeek's latent attention
    out.update(latent_attention_flops(cfg, batch, seq_len, causal))
  experts = int(getattr(cfg, "num_experts", 0) or 0)
  if experts:
    out["mlp"] = _moe_mlp_flops(cfg, n, tokens, mlp_matrices, experts)
  out["total"] = sum(out.values())
  return out


def _moe_mlp_flops(cfg: Any, n: dict[str, int], tokens: int, mlp_matrices: int,
                   experts: int) -> float:
  """The MLPs of a mixture of experts: in each layer with experts, the k routed experts of
  width moe_mlp_dim, the router and the shared expert beside them (and its output gate); in
  each layer without (moe_layers), a dense MLP of width mlp_dim."""
  k = int(_field(cfg, "num_experts_per_tok"))
  width = int(getattr(cfg, "moe_mlp_dim", 0) or n["mlp"])
  shared = int(getattr(cfg, "shared_expert_mlp_dim", 0) or 0)
  shared_gate = 1 if getattr(cfg, "shared_expert_gate", False) else 0
  moe_layers = getattr(cfg, "moe_layers", None)
  with_experts = n["layers"] if moe_layers is None else len(moe_layers)
  per_moe_layer = mlp_matrices * (k * width + shared) + experts + shared_gate
  dense = (n["layers"] - with_experts) * mlp_matrices * n["mlp"]
  return 2.0 * tokens * n["embed"] * (with_experts * per_moe_layer + dense)


def latent_attention_flops(cfg: Any, batch: int, seq_len: int, causal: bool = True
                           ) -> dict[str, float]:
  """Multi-head latent attention (DeepSeek V2/V3; models/attention/mla.py) as training runs
  it: queries through their low-rank pair (or one projection), the compressed key/value latent
  and shared RoPE key, the latent expanded to every head's keys and values, scores over
  head_dim features and values of v_head_dim."""
  D, H = int(_field(cfg, "embed_dim")), int(_field(cfg, "num_heads"))
  dqk = int(_field(cfg, "head_dim"))
  dv = int(getattr(cfg, "v_head_dim", 0) or dqk)
  rope, rkv = int(_field(cfg, "qk_rope_head_dim")), int(_field(cfg, "kv_lora_rank"))
  rq = int(getattr(cfg, "q_lora_rank", 0) or 0)
  tokens, layers = batch * seq_len, int(_field(cfg, "num_layers"))
  q = (D * rq + rq * H * dqk) if rq else D * H * dqk
  kv = D * (rkv + rope) + rkv * H * (dqk - rope + dv)
  pairs = attended_pairs(seq_len, None, causal)
  return {"qkv_proj": 2.0 * tokens * layers * (q + kv),
          "out_proj": 2.0 * tokens * layers * H * dv * D,
          "attn_scores": 2.0 * batch * layers * H * dqk * pairs,
          "attn_values": 2.0 * batch * layers * H * dv * pairs}


def gated_deltanet_flops(cfg: Any, tokens: int) -> float:
  """Matmul FLOPs of one Gated DeltaNet layer over `tokens` tokens: its projections (q, k of
  the key heads; v, the output gate z, decay and write strength of the value heads; the output)
  and the delta rule's three (d_k x d_v) contractions per token and value head (read, write,
  query the state), the recurrence's own work whatever form computes it."""
  D = int(_field(cfg, "embed_dim"))
  Hk, Hv = int(_field(cfg, "linear_num_key_heads")), int(_field(cfg, "linear_num_value_heads"))
  dk, dv = int(_field(cfg, "linear_key_head_dim")), int(_field(cfg, "linear_value_head_dim"))
  projections = 2.0 * tokens * D * (2 * Hk * dk + 2 * Hv * dv + 2 * Hv + Hv * dv)
  return projections + 3 * 2.0 * tokens * Hv * dk * dv


def forward_flops(cfg: Any, batch: int, seq_len: int, *, causal: bool = True) -> float:
  """Matmul FLOPs of one forward pass over [batch, seq_len] tokens."""
  return forward_flops_breakdown(cfg, batch, seq_len, causal=causal)["total"]


def train_step_flops(student_cfg: Any, batch: int, seq_len: int, teacher_cfg: Any = None, *,
                     causal: bool = True) -> dict[str, float]:
  """Model FLOPs of one training (or distillation) step over a global [batch, seq_len] batch.

  Returns {'student_forward', 'student_backward', 'teacher_forward', 'total'}: the backward is
  twice the forward, the teacher (if any) runs forward only. Divide 'total' by step time and
  device count for TFLOP/s per device.
  """
  student_forward = forward_flops(student_cfg, batch, seq_len, causal=causal)
  teacher_forward = 0.0
  if teacher_cfg is not None:
    teacher_forward = forward_flops(teacher_cfg, batch, seq_len, causal=causal)
  out = {
      "student_forward": student_forward,
      "student_backward": 2.0 * student_forward,
      "teacher_forward": teacher_forward,
  }
  out["total"] = sum(out.values())
  return out


# Attention implementations whose products are one custom call (a kernel), not HLO matmuls.
FUSED_ATTENTION = ("splash", "cudnn", "tokamax")
# Parts of a step a kernel can hide from the HLO (`hlo_matmul_adjustment`'s `fused`): the
# attention products, the output layer inside a fused cross-entropy.
FUSIBLE = ("attention", "logits")


def chunked_linear_attention_extra(cfg: Any, batch: int, seq_len: int) -> float:
  """Matmul FLOPs the chunked Gated DeltaNet form (models/linear_attention.py, chunks of C
  tokens, the sequence padded to whole chunks) runs beyond the recurrence's own three
  (d_k x d_v) contractions per token and value head, in every linear-attention layer of a
  (batch, seq_len) forward: per chunk and head the masked
  key products (C^2 d_k), the unit-lower inverse by doubling (2 C^3 per doubling), the two
  solves (C^2 (d_k + d_v)), the intra-chunk scores (C^2 d_k) and their product with the written
  values (C^2 d_v). A few percent of a real model's forward; most of a tiny one's."""
  mixers = getattr(cfg, "token_mixers", None) or ()
  layers = sum(t == "linear_attention" for t in mixers)
  if not layers or getattr(cfg, "linear_attention_impl", "chunked") != "chunked":
    return 0.0
  C = int(getattr(cfg, "linear_attention_chunk", 64))
  heads = int(_field(cfg, "linear_num_value_heads"))
  dk, dv = int(_field(cfg, "linear_key_head_dim")), int(_field(cfg, "linear_value_head_dim"))
  doublings = max(C - 1, 1).bit_length() - 1
  per_token = C * (3 * dk + 2 * dv) + 2 * doublings * C * C
  tokens = batch * -(-seq_len // C) * C
  return layers * 2.0 * tokens * heads * per_token


def hlo_matmul_adjustment(student_cfg: Any, batch: int, seq_len: int, teacher_cfg: Any = None,
                          *, causal: bool = True, remat: str = "none",
                          weights_train: bool = True, adapter_params: int = 0,
                          fused: tuple[str, ...] = (), sliced: bool = False,
                          sliced_shape: tuple[int, int] | None = None) -> float:
  """What a compiled train step runs as HLO matmuls minus what `train_step_flops` counts (the
  model-FLOPs convention of MFU): the figure `plan` adds to a job's model FLOPs to check the
  compiled step's matmuls against.

  - A backward is one matmul per forward matmul for the input gradient, plus one for the weight
    gradient only where the weights train (`weights_train=False`: a frozen LoRA or QLoRA base,
    whose `adapter_params` then add 6 FLOPs per token each); the attention products, two
    activations each, always take two.
  - Rematerialisation recomputes forward matmuls in the backward: `remat='full'` every layer's
    (not the output projection: the vocabulary-chunk engine forms its gradients in the
    forward), 'save_dots_no_batch' the attention products, 'save_attention' every layer's but
    the attention products, 'save_attention_qkv' those less the q, k, v projections too,
    'save_attention_up' / 'save_attention_mlp' less one / two of each MLP's matrices (a MoE's
    router counted in its MLP: approximate there);
    'save_dots' and 'none' nothing.
  - The chunked Gated DeltaNet form runs more than the recurrence it computes
    (`chunked_linear_attention_extra`), forward and both gradients.
  - `fused` (of FUSIBLE): parts that run inside a kernel, a custom call whose work the HLO does
    not show (splash or cuDNN attention, tokamax's fused cross-entropy): left out, forward,
    gradients and recomputation, the teacher's too.
  - `sliced`: the vocabulary-slice losses (train.loss_impl='sliced', framework/vocab_slices.py)
    recompute each slice's student logits in the backward (a teacher's slice logits are
    recomputed too, but the compilers keep them: the tiny KD step's TPU matmuls read 0.85x
    with them counted, 0.87x without). Not where the compiler merges the recompute with the
    forward's logits: the TPU compiler does over one slice (plan/local.one_slice_merged; the
    tiny LoRA step's TPU matmuls are then the same over one slice as over token chunks).
    `sliced_shape`: the (rows, positions) those losses score where they are not the step's
    batch (on-policy scoring: its samples' prompts and completions).
  """
  s = forward_flops_breakdown(student_cfg, batch, seq_len, causal=causal)
  attention = s["attn_scores"] + s["attn_values"]
  block = s["total"] - s["logits"]
  one_mlp_matrix = s["mlp"] / mlp_matrix_count(getattr(student_cfg, "mlp_activation", "swiglu"))
  recomputed = {"full": block, "save_dots_no_batch": attention, "save_attention": block - attention,
                "save_attention_qkv": block - attention - s["qkv_proj"],
                "save_attention_up": block - attention - one_mlp_matrix,
                "save_attention_mlp": block - attention - 2 * one_mlp_matrix}.get(remat, 0.0)
  out = recomputed + 6.0 * batch * seq_len * adapter_params
  if not weights_train:
    out -= s["total"] - attention
  out += chunked_linear_attention_extra(student_cfg, batch, seq_len) * (
      4 if remat in ("full", *SAVING_ATTENTION) else 3)
  once = 3 if weights_train else 2  # forward, input gradient, weight gradient
  if "attention" in fused:
    out -= attention * (4 if remat in ("full", "save_dots_no_batch") else 3)
  if "logits" in fused:
    out -= s["logits"] * once
  if sliced:
    out += s["logits"] if sliced_shape is None else forward_flops_breakdown(
        student_cfg, *sliced_shape, causal=causal)["logits"]
  if teacher_cfg is not None:
    t = forward_flops_breakdown(teacher_cfg, batch, seq_len, causal=causal)
    out += chunked_linear_attention_extra(teacher_cfg, batch, seq_len)
    out -= (t["attn_scores"] + t["attn_values"]) if "attention" in fused else 0.0
  return out


def rope_swap_adjustment(student_cfg: Any, batch: int, seq_len: int, teacher_cfg: Any,
                         remat: str) -> float:
  """What a TPU compile runs as HLO matmuls beyond `hlo_matmul_adjustment`'s (plan adds both):
  the swaps of RoPE over whole heads (models/layers._rope_whole_heads), in every model not under
  full remat: `rope_swap_flops` in the student's forward and input gradient, again in the
  recompute of remats that run the q and k projections again; a teacher's forward once."""
  out = 0.0
  if remat != "full":
    again = remat in ("save_attention", "save_attention_up", "save_attention_mlp")
    out += rope_swap_flops(student_cfg, batch, seq_len) * (3 if again else 2)
  if teacher_cfg is not None and getattr(teacher_cfg, "remat", "none") != "full":
    out += rope_swap_flops(teacher_cfg, batch, seq_len)
  return out


def rope_swap_flops(cfg: Any, batch: int, seq_len: int) -> float:
  """One pass of the whole-head RoPE's swap matmuls (models/layers._rope_whole_heads): a
  (rotary x rotary) +-1 matrix on each query and key head of every token and layer, 2 FLOPs a
  term. MLA's decoupled RoPE and RoPE-free layers are not told apart: an estimate there."""
  if int(getattr(cfg, "qk_rope_head_dim", 0) or 0):
    return 0.0
  rotary = int(cfg.head_dim * float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0))
  heads = int(cfg.num_heads) + int(cfg.num_kv_heads)
  return 2.0 * batch * seq_len * int(cfg.num_layers) * heads * rotary * rotary
