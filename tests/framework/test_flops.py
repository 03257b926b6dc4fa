"""Analytic FLOPs against hand arithmetic and XLA's own count; peaks, MFU and the CPU probe."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.errors import ConfigError
from distillax.framework import flops, throughput


@dataclasses.dataclass(frozen=True)
class Cfg:
  """Stands in for distillax.models.config.TransformerConfig: flops.py reads fields by name."""
  vocab_size: int
  embed_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  mlp_activation: str = "swiglu"
  tie_embeddings: bool = False
  sliding_window: int | None = None
  sliding_window_pattern: int = 2
  layer_types: tuple | None = None


TINY = Cfg(vocab_size=10, embed_dim=4, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2,
           mlp_dim=8)


def test_forward_flops_by_hand():
  # batch 1, seq 3 -> 3 tokens.
  got = flops.forward_flops_breakdown(TINY, batch=1, seq_len=3)
  assert got["qkv_proj"] == 2 * 3 * 4 * (2 * 2 + 2 * 1 * 2)   # q: 4 wide, k and v: 2 wide each
  assert got["out_proj"] == 2 * 3 * 4 * 4
  assert got["attn_scores"] == 2 * 1 * 2 * 3 * 3 * 2 / 2     # causal: half the 3x3 scores
  assert got["attn_values"] == 2 * 1 * 2 * 3 * 3 * 2 / 2
  assert got["mlp"] == 3 * 2 * 3 * 4 * 8                     # gate, up, down
  assert got["logits"] == 2 * 3 * 4 * 10
  assert got["total"] == 192 + 96 + 36 + 36 + 576 + 240
  assert flops.forward_flops(TINY, 1, 3, causal=False) == 1176 + 72

  gelu = dataclasses.replace(TINY, mlp_activation="gelu", num_layers=2)
  assert flops.forward_flops_breakdown(gelu, 1, 3)["mlp"] == 2 * (2 * 2 * 3 * 4 * 8)


def test_sliding_window_layers_count_only_their_band():
  # 4 layers, pattern 2: layers 0 and 2 local (window 2), 1 and 3 global; L = 8.
  local = dataclasses.replace(TINY, num_layers=4, sliding_window=2, sliding_window_pattern=2)
  got = flops.forward_flops_breakdown(local, batch=1, seq_len=8)
  local_pairs = 8 * 2 - 2 * 2 / 2     # the band of width 2 under the diagonal
  global_pairs = 8 * 8 / 2
  assert got["attn_scores"] == 2 * 1 * 2 * 2 * (2 * local_pairs + 2 * global_pairs)
  full = flops.forward_flops_breakdown(local, batch=1, seq_len=8, causal=False)
  assert full["attn_scores"] == 2 * 1 * 2 * 2 * 4 * 64
  wide = dataclasses.replace(local, sliding_window=16)  # wider than the sequence: plain causal
  assert flops.forward_flops_breakdown(wide, 1, 8)["attn_scores"] == 2 * 1 * 2 * 2 * 4 * 32
  # Per-layer types (a student of teacher blocks) win over the pattern: 3 local, 1 global.
  typed = dataclasses.replace(local, layer_types=("sliding_attention",) * 3 + ("full_attention",))
  assert flops.layer_windows(typed) == [2, 2, 2, None]
  assert flops.forward_flops_breakdown(typed, batch=1, seq_len=8)["attn_scores"] == (
      2 * 1 * 2 * 2 * (3 * local_pairs + global_pairs))


def test_train_step_flops_counts_backward_twice_and_teacher_once():
  teacher = dataclasses.replace(TINY, embed_dim=8, num_heads=4, num_kv_heads=4, num_layers=2)
  out = flops.train_step_flops(TINY, 2, 3, teacher_cfg=teacher)
  student = 2 * 1176  # linear in batch
  teacher_forward = flops.forward_flops(teacher, 2, 3)
  assert out["student_forward"] == student
  assert out["student_backward"] == 2 * student
  assert out["teacher_forward"] == teacher_forward > 0
  assert out["total"] == 3 * student + teacher_forward
  assert flops.train_step_flops(TINY, 2, 3)["teacher_forward"] == 0


def test_defaults_and_missing_fields():
  @dataclasses.dataclass
  class Sparse:
    vocab_size: int = 10
    embed_dim: int = 4
    num_layers: int = 1
    num_heads: int = 2
    num_kv_heads: int = None  # -> num_heads
    head_dim: int = None      # -> embed_dim // num_heads
    mlp_dim: int = 8
  full = dataclasses.replace(TINY, num_kv_heads=2)
  assert flops.forward_flops(Sparse(), 1, 3) == flops.forward_flops(full, 1, 3)

  @dataclasses.dataclass
  class NoMlp:
    vocab_size: int = 10
    embed_dim: int = 4
    num_layers: int = 1
    num_heads: int = 2
  with pytest.raises(ConfigError, match="mlp_dim"):
    flops.forward_flops(NoMlp(), 1, 3)


def _matmul_param_count(cfg) -> int:
  """Parameters used in matmuls, counted from the shapes: every projection plus the output
  projection once (the embedding lookup is a gather, norms are elementwise)."""
  mlp_matrices = 3 if getattr(cfg, "mlp_activation", "swiglu") in ("swiglu", "geglu") else 2
  per_layer = (cfg.embed_dim * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
               + cfg.num_heads * cfg.head_dim * cfg.embed_dim
               + mlp_matrices * cfg.embed_dim * cfg.mlp_dim)
  return cfg.num_layers * per_layer + cfg.embed_dim * cfg.vocab_size


def test_matmul_params_give_the_2nd_rule_when_attention_is_negligible():
  cfg = Cfg(vocab_size=512, embed_dim=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
            mlp_dim=512)
  tokens = 4
  without_attention = flops.forward_flops(cfg, 1, tokens) - sum(
      flops.forward_flops_breakdown(cfg, 1, tokens)[k] for k in ("attn_scores", "attn_values"))
  assert without_attention == 2 * _matmul_param_count(cfg) * tokens


# --- an independent reference: a plain JAX decoder with the same shapes, counted by XLA --------

def _init_params(cfg, key):
  d, h, kv, hd, f, v = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim,
                        cfg.vocab_size)
  gated = cfg.mlp_activation in ("swiglu", "geglu")
  keys = iter(jax.random.split(key, 8 * cfg.num_layers + 2))
  normal = lambda shape: 0.05 * jax.random.normal(next(keys), shape, jnp.float32)
  layers = []
  for _ in range(cfg.num_layers):
    layer = dict(q=normal((d, h, hd)), k=normal((d, kv, hd)), v=normal((d, kv, hd)),
                 o=normal((h, hd, d)), up=normal((d, f)), down=normal((f, d)))
    if gated:
      layer["gate"] = normal((d, f))
    layers.append(layer)
  params = dict(embed=normal((v, d)), layers=layers)
  if not cfg.tie_embeddings:
    params["unembed"] = normal((d, v))
  return params


def _reference_forward(cfg, params, tokens_BxL):
  """Full (masked) attention: XLA computes the whole LxL matrix, so compare with causal=False."""
  x_BxLxD = params["embed"][tokens_BxL]
  seq_len = tokens_BxL.shape[1]
  mask_LxL = jnp.tril(jnp.ones((seq_len, seq_len), bool))
  group = cfg.num_heads // cfg.num_kv_heads
  for layer in params["layers"]:
    h_BxLxD = x_BxLxD * jax.lax.rsqrt(jnp.mean(x_BxLxD ** 2, -1, keepdims=True) + 1e-6)
    q_BxLxHxK = jnp.einsum("bld,dhk->blhk", h_BxLxD, layer["q"])
    k_BxLxGxK = jnp.einsum("bld,dgk->blgk", h_BxLxD, layer["k"])
    v_BxLxGxK = jnp.einsum("bld,dgk->blgk", h_BxLxD, layer["v"])
    q_BxLxGxRxK = q_BxLxHxK.reshape(*q_BxLxHxK.shape[:2], cfg.num_kv_heads, group, cfg.head_dim)
    s_BxGxRxLxL = jnp.einsum("blgrk,bmgk->bgrlm", q_BxLxGxRxK, k_BxLxGxK) / np.sqrt(cfg.head_dim)
    p_BxGxRxLxL = jax.nn.softmax(jnp.where(mask_LxL, s_BxGxRxLxL, -1e9), axis=-1)
    a_BxLxGxRxK = jnp.einsum("bgrlm,bmgk->blgrk", p_BxGxRxLxL, v_BxLxGxK)
    a_BxLxHxK = a_BxLxGxRxK.reshape(q_BxLxHxK.shape)
    x_BxLxD = x_BxLxD + jnp.einsum("blhk,hkd->bld", a_BxLxHxK, layer["o"])
    h_BxLxD = x_BxLxD * jax.lax.rsqrt(jnp.mean(x_BxLxD ** 2, -1, keepdims=True) + 1e-6)
    up_BxLxF = h_BxLxD @ layer["up"]
    if "gate" in layer:
      up_BxLxF = jax.nn.silu(h_BxLxD @ layer["gate"]) * up_BxLxF
    else:
      up_BxLxF = jax.nn.gelu(up_BxLxF)
    x_BxLxD = x_BxLxD + up_BxLxF @ layer["down"]
  unembed_DxV = params["embed"].T if cfg.tie_embeddings else params["unembed"]
  return x_BxLxD @ unembed_DxV


def _loss(cfg, params, tokens_BxL):
  logits_BxLxV = _reference_forward(cfg, params, tokens_BxL)
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits_BxLxV), tokens_BxL[..., None], -1))


def _xla_flops(fn, *args):
  return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


STUDENT = Cfg(vocab_size=256, embed_dim=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
              mlp_dim=192, mlp_activation="swiglu")
TEACHER = Cfg(vocab_size=256, embed_dim=96, num_layers=1, num_heads=6, num_kv_heads=6, head_dim=16,
              mlp_dim=256, mlp_activation="gelu", tie_embeddings=True)
BATCH, SEQ = 2, 32


@pytest.mark.parametrize("cfg", [STUDENT, TEACHER], ids=["swiglu_gqa", "gelu_tied"])
def test_forward_matches_xla_cost_analysis(cfg):
  params = _init_params(cfg, jax.random.key(0))
  tokens = jnp.zeros((BATCH, SEQ), jnp.int32)
  xla = _xla_flops(lambda p, t: _reference_forward(cfg, p, t), params, tokens)
  analytic = flops.forward_flops(cfg, BATCH, SEQ, causal=False)
  # XLA also counts norms, softmax and activations: a few percent on top of the matmuls.
  assert analytic <= xla <= 1.05 * analytic, (xla, analytic)


@pytest.mark.parametrize("preset", ["tiny", "tiny_gemma", "tiny_gemma4"])
def test_the_real_model_matches_xla_cost_analysis(preset):
  # The project's own Transformer computes the full masked score matrix (also for its sliding
  # window layers), so XLA's count is compared with causal=False.
  from flax import nnx
  from distillax.models.presets import get_preset
  from distillax.models.transformer import Transformer
  cfg = get_preset(preset)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  tokens = jnp.zeros((BATCH, SEQ), jnp.int32)
  xla = _xla_flops(lambda s, t: nnx.merge(graphdef, s)(t).logits_BxLxV, state, tokens)
  analytic = flops.forward_flops(cfg, BATCH, SEQ, causal=False)
  assert analytic <= xla <= 1.10 * analytic, (xla, analytic)


def test_distill_step_matches_xla_cost_analysis():
  student = _init_params(STUDENT, jax.random.key(1))
  teacher = _init_params(TEACHER, jax.random.key(2))
  tokens = jnp.zeros((BATCH, SEQ), jnp.int32)

  def distill_step(student, teacher, tokens):
    teacher_logits = jax.lax.stop_gradient(_reference_forward(TEACHER, teacher, tokens))
    def loss_fn(student):
      student_logits = _reference_forward(STUDENT, student, tokens)
      return jnp.mean((student_logits - teacher_logits) ** 2)
    return jax.grad(loss_fn)(student)

  xla = _xla_flops(distill_step, student, teacher, tokens)
  analytic = flops.train_step_flops(STUDENT, BATCH, SEQ, teacher_cfg=TEACHER, causal=False)
  assert analytic["total"] <= xla <= 1.05 * analytic["total"], (xla, analytic)

  train_only = _xla_flops(lambda p, t: jax.grad(lambda p: _loss(STUDENT, p, t))(p), student, tokens)
  expected = flops.train_step_flops(STUDENT, BATCH, SEQ, causal=False)["total"]
  assert expected <= train_only <= 1.05 * expected, (train_only, expected)


# --- peaks, MFU -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind,peak", [
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5", 459e12),
    ("TPU v5p", 459e12), ("TPU v6 lite", 918e12), ("TPU v6e", 918e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12),
])
def test_table_peaks_match_datasheets(kind, peak):
  assert throughput.table_peak(kind)[0] == pytest.approx(peak)


@pytest.mark.parametrize("kind,bandwidth", [
    ("TPU v4", 1200e9), ("TPU v5 lite", 819e9), ("TPU v5e", 819e9), ("TPU v5", 2765e9),
    ("TPU v5p", 2765e9), ("TPU v6 lite", 1640e9), ("NVIDIA A100-SXM4-80GB", 2039e9),
    ("NVIDIA A100 80GB PCIe", 1935e9), ("NVIDIA A100-SXM4-40GB", 1555e9),
    ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA H100 NVL", 3.9e12),
    ("NVIDIA H200", 4.8e12), ("NVIDIA H200 NVL", 4.8e12),
])
def test_table_hbm_bandwidths_match_datasheets(kind, bandwidth):
  assert throughput.table_hbm_bandwidth(kind)[0] == pytest.approx(bandwidth)


def test_hbm_bandwidth_per_device_is_none_off_an_accelerator_it_knows():
  """A decode roofline needs the chip's HBM bandwidth: a TPU v5e gives 819 GB/s; a CPU (no HBM)
  and an accelerator missing from the table give None."""
  assert throughput.hbm_bandwidth_per_device(FakeDevice("tpu", "TPU v5 lite"))[0] == 819e9
  assert throughput.hbm_bandwidth_per_device(FakeDevice("cpu", "cpu"))[0] is None
  bandwidth, source = throughput.hbm_bandwidth_per_device(FakeDevice("gpu", "Mystery 9"))
  assert bandwidth is None and "Mystery 9" in source


@dataclasses.dataclass
class FakeDevice:
  platform: str
  device_kind: str


def test_unknown_accelerator_warns_and_has_no_peak(caplog, monkeypatch):
  monkeypatch.setattr(throughput, "_warned_kinds", set())  # warned once per process otherwise
  with caplog.at_level(logging.WARNING):
    peak, source = throughput.peak_flops_per_device(FakeDevice("gpu", "Mystery Accelerator 9"))
  assert peak is None and "Mystery Accelerator 9" in source
  assert "Mystery Accelerator 9" in caplog.text
  assert throughput.mfu(1e12, 1.0, 8, peak) is None
  assert throughput.peak_flops_per_device(FakeDevice("tpu", "TPU v4"))[0] == 275e12


def test_mfu_and_rates_by_hand():
  # 8e12 FLOPs per step in 0.5 s on 4 devices of 10 TFLOP/s peak: 4 TFLOP/s each, 40%.
  assert throughput.tflops_per_device(8e12, 0.5, 4) == pytest.approx(4.0)
  assert throughput.mfu(8e12, 0.5, 4, 10e12) == pytest.approx(0.4)
  rates = throughput.Throughput(tokens_per_step=1000, model_flops_per_step=8e12, num_devices=4,
                                peak_flops_per_device=10e12).rates(num_steps=10, seconds=5.0)
  assert rates == pytest.approx({"step_time_s": 0.5, "tokens_per_s": 2000.0,
                                 "tflops_per_device": 4.0, "mfu": 0.4})
  no_peak = throughput.Throughput(1000, 8e12, 4).rates(10, 5.0)
  assert "mfu" not in no_peak and no_peak["tflops_per_device"] == pytest.approx(4.0)
  assert throughput.Throughput(1000, 8e12, 4).rates(0, 5.0) == {}


def test_cpu_probe_counts_2n3_per_matmul():
  ticks = iter(np.arange(0, 100, 1e-3))  # every clock read advances 1 ms: each matmul "takes" 1 ms
  best = throughput.measure_cpu_matmul_flops(sizes=(64, 128), repeats=2,
                                             clock=lambda: float(next(ticks)))
  assert best == pytest.approx(2 * 128 ** 3 / 1e-3)


class FakeClock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_cpu_probe_times_each_matmul_until_its_result_is_ready():
  """A fake matmul whose work happens only while its result is awaited: dispatch costs nothing,
  block_until_ready advances the fake clock by that call's seconds. A probe that timed the
  dispatch alone would report 2n^3 / 1e-9; one that timed the warm-up call (given the shortest
  time here), averaged the repeats or kept the last size would report another rate."""
  clock = FakeClock()
  # Per size: the untimed warm-up call first, then the timed repeats.
  seconds = {64: [1e-5, 1e-3, 2e-3, 1e-3],
             128: [1e-5, 8e-3, 4e-3, 6e-3],
             32: [1e-5, 1e-3, 1e-3, 1e-3]}
  calls = []

  class Result:
    def __init__(self, work_s):
      self.work_s = work_s

    def block_until_ready(self):
      clock.now += self.work_s
      return self

  def matmul(a, b):
    n = a.shape[0]
    assert a.shape == b.shape == (n, n) and a.dtype == b.dtype == np.float32
    calls.append(n)
    return Result(seconds[n][calls.count(n) - 1])

  best = throughput.measure_cpu_matmul_flops(sizes=(64, 128, 32), repeats=3, clock=clock,
                                             matmul=matmul)
  assert calls == [64] * 4 + [128] * 4 + [32] * 4
  rates = {64: 2 * 64 ** 3 / 1e-3, 128: 2 * 128 ** 3 / 4e-3, 32: 2 * 32 ** 3 / 1e-3}
  assert best == pytest.approx(max(rates.values())) == pytest.approx(rates[128])


def test_cpu_peak_is_measured_once_and_shared_by_host_devices(monkeypatch):
  calls = []
  monkeypatch.setattr(throughput, "_cpu_probe_cache", {})
  monkeypatch.setattr(throughput, "measure_cpu_matmul_flops",
                      lambda: calls.append(1) or 80e9)
  peak, source = throughput.peak_flops_per_device(jax.devices("cpu")[0])
  again, _ = throughput.peak_flops_per_device()
  assert len(calls) == 1
  assert peak == again == pytest.approx(80e9 / jax.local_device_count())
  assert "probe" in source and "80.0 GFLOP/s" in source


def test_mixture_of_experts_counts_the_routed_experts_and_the_router():
  @dataclasses.dataclass(frozen=True)
  class MoECfg(Cfg):
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_mlp_dim: int = 0

  moe = MoECfg(**dataclasses.asdict(TINY), num_experts=5, num_experts_per_tok=2, moe_mlp_dim=3)
  got = flops.forward_flops_breakdown(moe, batch=1, seq_len=3)
  # 3 tokens x (2 experts x gate, up, down of 4 x 3, and the 4 x 5 router).
  assert got["mlp"] == 2 * 3 * (2 * 3 * 4 * 3 + 4 * 5)
  assert got["total"] == 192 + 96 + 36 + 36 + 2 * 3 * (72 + 20) + 240
  same_width = dataclasses.replace(moe, moe_mlp_dim=0)  # 0: each expert is mlp_dim wide
  assert flops.forward_flops_breakdown(same_width, 1, 3)["mlp"] == 2 * 3 * (2 * 3 * 4 * 8 + 20)
  gpt_oss = dataclasses.replace(moe, mlp_activation="clamped_swiglu")  # gated: gate, up, down
  assert flops.forward_flops_breakdown(gpt_oss, 1, 3)["mlp"] == got["mlp"]


def test_gated_deltanet_layers_count_their_projections_and_state_contractions():
  """tiny_qwen35's shapes by hand: D 64, 4 heads of 16 over 2 kv heads, MLP 128 (SwiGLU), vocab
  256; three Gated DeltaNet layers (2 key heads, 4 value heads, 16 features each) and one gated
  attention layer. 1 x 8 tokens."""
  from distillax.models.presets import get_preset
  got = flops.forward_flops_breakdown(get_preset("tiny_qwen35"), batch=1, seq_len=8)
  T = 8
  # DeltaNet: q, k 2 x 32 wide, v and z 2 x 64, a and b 2 x 4, out 64 -> 64; state 3 x 4 x 16 x 16.
  deltanet = 2 * T * 64 * (64 + 128 + 8 + 64) + 3 * 2 * T * 4 * 16 * 16
  assert got["linear_attention"] == 3 * deltanet
  # The attention layer: q 64 + its gate 64 + k, v 2 x 32; causal scores over 8 x 8 / 2 pairs.
  assert got["qkv_proj"] == 2 * T * 64 * (64 + 64 + 64)
  assert got["out_proj"] == 2 * T * 64 * 64
  assert got["attn_scores"] == got["attn_values"] == 2 * 4 * 16 * 32
  assert got["mlp"] == 4 * 3 * 2 * T * 64 * 128
  assert got["total"] == sum(v for k, v in got.items() if k != "total")


# ---- what a compiled step runs as HLO matmuls (plan's FLOPs check) ------------------------------

def test_hlo_matmul_adjustment_by_hand():
  """TINY over 1 x 3 tokens: forward 1176, of which attention products 72 and logits 240."""
  adjust = lambda **kw: flops.hlo_matmul_adjustment(TINY, 1, 3, **kw)
  assert adjust() == 0
  assert adjust(remat="full") == 1176 - 240  # every layer's forward again, not the logits
  assert adjust(remat="save_dots_no_batch") == 72
  assert adjust(remat="save_dots") == 0
  # The attention kept: the layer's forward again less its products (72), and with the q, k, v
  # kept, less their projections too (2 x 3 tokens x 4 x 8 wide = 192).
  assert adjust(remat="save_attention") == 1176 - 240 - 72
  assert adjust(remat="save_attention_qkv") == 1176 - 240 - 72 - 192
  # With the MLP's up product kept, less one of its three matrices (2 x 3 x 4 x 8 = 192); with
  # the gate's too, less two.
  assert adjust(remat="save_attention_up") == 1176 - 240 - 72 - 192
  assert adjust(remat="save_attention_mlp") == 1176 - 240 - 72 - 2 * 192
  # A frozen base: no weight-gradient matmuls (all but the attention products'), and 6 FLOPs
  # per token for each of 10 adapter parameters.
  assert adjust(weights_train=False, adapter_params=10) == -(1176 - 72) + 6 * 3 * 10
  # A fused attention kernel hides the products: forward and two gradients (and the recomputed
  # forward under remat), and the teacher's forward.
  assert adjust(fused=("attention",)) == -3 * 72
  assert adjust(fused=("attention",), remat="full") == 1176 - 240 - 4 * 72
  assert adjust(fused=("attention",), remat="save_attention") == 1176 - 240 - 72 - 3 * 72
  assert flops.hlo_matmul_adjustment(TINY, 1, 3, TINY, fused=("attention",)) == -4 * 72
  # tokamax's fused cross-entropy: the logits, their input and weight gradients.
  assert adjust(fused=("logits",)) == -3 * 240
  # The vocabulary slices recompute the logits (80 per token) of the positions they score: the
  # batch's, or another shape's (on-policy scoring: 2 x 5 positions).
  assert adjust(sliced=True) == 240
  assert adjust(sliced=True, sliced_shape=(2, 5)) == 80 * 2 * 5


def test_rope_swap_adjustment_by_hand():
  """RoPE over whole heads (a TPU): a 2 x 2 swap on each of 3 heads (2 query, 1 key) of 3
  tokens, 2 x 3 x 3 x 2 x 2 = 72 a pass: forward and input gradient, a third where the remat
  runs the projections again, none under full remat; a teacher's forward once."""
  swap = lambda teacher=None, remat="none": flops.rope_swap_adjustment(TINY, 1, 3, teacher, remat)
  assert flops.rope_swap_flops(TINY, 1, 3) == 72
  assert swap() == 2 * 72
  assert swap(remat="save_attention") == swap(remat="save_attention_mlp") == 3 * 72
  assert swap(remat="save_attention_qkv") == swap(remat="save_dots") == 2 * 72
  assert swap(remat="full") == 0
  assert swap(TINY) == 3 * 72 and swap(TINY, remat="full") == 72


@dataclasses.dataclass(frozen=True)
class DeltaNetCfg(Cfg):
  token_mixers: tuple = ("linear_attention", "full_attention")
  linear_attention_impl: str = "chunked"
  linear_attention_chunk: int = 4
  linear_num_key_heads: int = 1
  linear_num_value_heads: int = 2
  linear_key_head_dim: int = 3
  linear_value_head_dim: int = 5


def test_chunked_linear_attention_extra_by_hand():
  """One DeltaNet layer, chunks of 4, 2 value heads, d_k 3, d_v 5; 1 x 6 tokens pad to 8. Per
  token and head: C (3 d_k + 2 d_v) = 4 x 19 key/solve/score products, one doubling of the
  4 x 4 inverse, 2 x 16; 2 FLOPs each."""
  cfg = DeltaNetCfg(vocab_size=10, embed_dim=4, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=2, mlp_dim=8)
  assert flops.chunked_linear_attention_extra(cfg, 1, 6) == 2 * 8 * 2 * (4 * 19 + 2 * 16)
  recurrent = dataclasses.replace(cfg, linear_attention_impl="recurrent")
  assert flops.chunked_linear_attention_extra(recurrent, 1, 6) == 0


def test_chunked_linear_attention_extra_matches_the_compiled_chunked_form():
  """The chunked form as XLA compiles it, its dots counted with trip counts (the chunk scan):
  the recurrence's 3 (d_k x d_v) products per token and head plus the extra."""
  from distillax.framework import hlo_flops
  from distillax.models.linear_attention import gated_delta_rule_chunked
  B, L, H, K, V, C = 2, 24, 2, 8, 16, 8
  cfg = DeltaNetCfg(vocab_size=10, embed_dim=4, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=2, mlp_dim=8, token_mixers=("linear_attention",),
                    linear_attention_chunk=C, linear_num_value_heads=H, linear_key_head_dim=K,
                    linear_value_head_dim=V)
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((B, L, H, K), (B, L, H, K),
                                                          (B, L, H, V), (B, L, H), (B, L, H))]
  fn = jax.jit(lambda *a: gated_delta_rule_chunked(*a, chunk_size=C)[0])
  compiled = hlo_flops.matmul_flops(fn.lower(*args).compile().as_text())
  assert not compiled["trip_count_unknown"]
  assert compiled["flops"] == 3 * 2 * B * L * H * K * V + flops.chunked_linear_attention_extra(
      cfg, B, L)
