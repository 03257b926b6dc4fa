"""Every attention implementation against the reference path (models/attention/layer.py), and what
`model.attention_impl='auto'` picks for a platform and a call's needs.

The blockwise path must match the reference within 1e-5 in fp32, values and gradients, for every
architecture. The splash kernel runs in Pallas interpret mode on CPU, and as the Mosaic kernel on
a TPU in the chip run (scripts/chip_tests.sh, tests/support/chip.py). The cuDNN kernel cannot run
on CPU: it is UNVERIFIED until a GPU is lent (only its selection is tested here).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax.errors import ConfigError
from distillax.models.attention import blockwise as attention_blockwise
from distillax.models.attention import impl as attention_impl
from distillax.models.attention.layer import reference_attention
from distillax.models.attention.fused import cudnn_attention, splash_attention
from distillax.models.attention.impl import AttentionNeeds, choose
from distillax.models.config import GLOBAL_WINDOW
from distillax.models.presets import get_preset
from distillax.models.sampler import generate
from distillax.models.transformer import with_config, with_layer_layout
from tests.support import chip
from tests.support.models import random_model

TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(B, L, S, K, G, H, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (B, L, K, G, H)), jax.random.normal(keys[1], (B, S, K, H)),
          jax.random.normal(keys[2], (B, S, K, H)))


def _packed_segments(B, L):
  """Row 0: two documents then padding; other rows: one document."""
  seg = np.ones((B, L), np.int32)
  seg[0, L // 3:] = 2
  seg[0, L - 3:] = 0
  return jnp.asarray(seg)


def _out_and_grads(fn, q, k, v, *rest):
  """fn(q, k, v, *rest) and the (q, k, v) gradients of a fixed weighted sum of it (one compiled
  call: `rest` is traced, not differentiated)."""
  w = jax.random.normal(jax.random.key(9), jax.eval_shape(fn, q, k, v, *rest).shape)

  def loss(*a):
    out = fn(*a)
    return jnp.sum(out.astype(jnp.float32) * w), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
      q, k, v, *rest)
  return out, grads


def _both(fn_a, fn_b, q, k, v):
  """Outputs and (q, k, v) gradients of a weighted sum of each function's output."""
  return _out_and_grads(fn_a, q, k, v), _out_and_grads(fn_b, q, k, v)


@pytest.mark.parametrize("case", [
    dict(name="causal_gqa", window=None, softcap=None, segments=False, offset_known=True),
    dict(name="all_pairs", window=None, softcap=None, segments=True, offset_known=False),
    dict(name="packed_window_softcap", window=5, softcap=20.0, segments=True, offset_known=True),
    dict(name="traced_window", window="traced", softcap=None, segments=True, offset_known=True),
    dict(name="cache_offsets", window=3, softcap=None, segments=True, cached=True,
         offset_known=True),
    dict(name="cache_all_pairs", window=None, softcap=None, segments=True, cached=True,
         offset_known=False),
])
def test_blockwise_matches_reference_values_and_input_gradients(case):
  """Blocks of 4 over 14 queries / 14 (or 23 cached) keys: padding, skipped and partial blocks;
  with the causal offset known (pairs pruned at trace time) and without (every pair)."""
  B, L, K, G, H = 2, 14, 2, 3, 8
  S = 23 if case.get("cached") else L
  q, k, v = _qkv(B, L, S, K, G, H)
  offset = S - L if case.get("cached") else 0  # queries are the last L of S cache slots
  qi = jnp.broadcast_to(jnp.arange(L) + offset, (B, L))
  ki = jnp.broadcast_to(jnp.arange(S), (B, S))
  qs = ks = None
  if case["segments"]:
    ks = _packed_segments(B, S)
    qs = ks[:, offset:]
  window = case["window"]
  masking = dict(q_index_BxL=qi, k_index_BxS=ki, q_segment_BxL=qs, k_segment_BxS=ks,
                 scale=H ** -0.5, softcap=case["softcap"])

  def run(fn, **extra):
    def call(q, k, v):
      w = jnp.asarray(4, jnp.int32) if window == "traced" else window
      return fn(q, k, v, window=w, **masking, **extra)
    return jax.jit(call)

  ref = run(lambda *a, **kw: reference_attention(*a, **kw)[0])
  blk = run(attention_blockwise.blockwise_attention, block_q=4, block_k=4,
            causal_offset=offset if case["offset_known"] else None)
  (ref_out, ref_grads), (blk_out, blk_grads) = _both(ref, blk, q, k, v)
  np.testing.assert_allclose(blk_out, ref_out, **TOL)
  for name, a, b in zip("qkv", blk_grads, ref_grads):
    np.testing.assert_allclose(a, b, **TOL, err_msg=f"d{name}")


def test_blockwise_sinks_match_reference_values_and_gradients():
  """gpt-oss's sink logits (one per query head) against a KV cache of 23 slots: 14 queries in
  blocks of 4, window 3, packed segments with padding rows; output and the gradients of q, k, v
  and the sinks."""
  B, L, S, K, G, H = 2, 14, 23, 2, 3, 8
  q, k, v = _qkv(B, L, S, K, G, H)
  sinks = 2.0 * jax.random.normal(jax.random.key(5), (K, G))
  seg = _packed_segments(B, S)
  masking = dict(q_index_BxL=jnp.broadcast_to(jnp.arange(L) + S - L, (B, L)),
                 k_index_BxS=jnp.broadcast_to(jnp.arange(S), (B, S)), q_segment_BxL=seg[:, S - L:],
                 k_segment_BxS=seg, window=3, scale=H ** -0.5)
  w = jax.random.normal(jax.random.key(9), (B, L, K, G, H))
  ref = lambda *a: reference_attention(*a[:3], **masking, sinks_KxG=a[3])[0]
  blk = lambda *a: attention_blockwise.blockwise_attention(
      *a[:3], **masking, sinks_KxG=a[3], block_q=4, block_k=4, causal_offset=S - L)
  both = [jax.jit(jax.value_and_grad(lambda *a, fn=fn: (jnp.sum(fn(*a) * w), fn(*a)),
                                     argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
          for fn in (ref, blk)]
  (_, ref_out), ref_grads = both[0]
  (_, blk_out), blk_grads = both[1]
  np.testing.assert_allclose(blk_out, ref_out, **TOL)
  assert float(jnp.max(jnp.abs(ref_grads[3]))) > 1e-2  # the sinks matter here
  for name, a, b in zip(["q", "k", "v", "sinks"], blk_grads, ref_grads):
    np.testing.assert_allclose(a, b, **TOL, err_msg=f"d{name}")


def test_pair_schedule_skips_what_no_query_sees():
  # 4 x 4 blocks of 8, causal: the 10 pairs on or below the diagonal.
  i, j = attention_blockwise.pair_schedule(4, 4, 8, 8, 0, None)
  assert sorted(zip(i.tolist(), j.tolist())) == [(a, b) for a in range(4) for b in range(a + 1)]
  # A window of 8: a query block sees its own key block and the one before.
  i, j = attention_blockwise.pair_schedule(4, 4, 8, 8, 0, 8)
  assert sorted(zip(i.tolist(), j.tolist())) == [(0, 0), (1, 0), (1, 1), (2, 1), (2, 2),
                                                 (3, 2), (3, 3)]
  # Queries at cache slots 16..23 (one block) see key blocks 0..2 of 4; unknown offset: all.
  assert attention_blockwise.pair_schedule(1, 4, 8, 8, 16, None)[1].tolist() == [0, 1, 2]
  assert len(attention_blockwise.pair_schedule(4, 4, 8, 8, None, 8)[0]) == 16


ARCHS = {
    # Llama 3.1 RoPE scaling, GQA, tied embeddings.
    "llama": get_preset("tiny", rope_scaling_factor=4.0, rope_original_max_len=64,
                        tie_embeddings=True),
    # Gemma 2: attention logit soft-cap, alternating sliding window (8), query pre-attn scalar.
    "gemma2": get_preset("tiny_gemma"),
    # Qwen 3: q/k RMSNorm (applied to the projections, before RoPE: outside attention).
    "qwen3": get_preset("tiny", qk_norm=True),
    # Mistral: a sliding window (5) on every layer.
    "mistral": get_preset("tiny", sliding_window=5, sliding_window_pattern=0),
}


def _loss_and_grads(model, tokens, segments, positions):
  graphdef, state = nnx.split(model)

  def loss(state):
    out = nnx.merge(graphdef, state)(tokens, positions_BxL=positions, segment_ids_BxL=segments)
    logp = jax.nn.log_softmax(out.logits_BxLxV)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[..., None], axis=-1)), out.logits_BxLxV

  (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  return logits, grads


@pytest.mark.parametrize("arch,scan", [("llama", False), ("gemma2", True), ("qwen3", False),
                                       ("mistral", True)])
def test_blockwise_model_matches_reference_logits_and_param_gradients(arch, scan, monkeypatch):
  """Packed documents (positions restart, trailing padding), blocks of 4 over 14 tokens."""
  monkeypatch.setattr(attention_blockwise, "BLOCK_Q", 4)
  monkeypatch.setattr(attention_blockwise, "BLOCK_K", 4)
  base = with_layer_layout(random_model(ARCHS[arch], seed=4), scan)
  tokens = jnp.asarray([[5, 17, 200, 3, 9, 44, 12, 8, 8, 1, 2, 250, 0, 0],
                        [7, 7, 1, 90, 4, 4, 33, 2, 100, 6, 5, 18, 19, 20]], jnp.int32)
  segments = jnp.asarray([[1] * 9 + [2] * 3 + [0] * 2, [1] * 14], jnp.int32)
  positions = jnp.asarray([list(range(9)) + list(range(3)) + [0, 0], list(range(14))], jnp.int32)
  ref_logits, ref_grads = _loss_and_grads(with_config(base, attention_impl="reference"), tokens,
                                          segments, positions)
  blk_logits, blk_grads = _loss_and_grads(with_config(base, attention_impl="blockwise"), tokens,
                                          segments, positions)
  np.testing.assert_allclose(blk_logits, ref_logits, **TOL)
  flat_ref = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(ref_grads))
  flat_blk = jax.tree_util.tree_leaves(nnx.to_pure_dict(blk_grads))
  assert len(flat_ref) == len(flat_blk) > 10
  for (path, r), b in zip(flat_ref, flat_blk):
    np.testing.assert_allclose(b, r, **TOL, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_cached_generation_with_blockwise_prefill_matches_reference(arch):
  """The sampler's prefill runs blockwise under 'blockwise', its decode steps the reference;
  the tokens equal those of a model that runs the reference everywhere."""
  prompts = np.array([[7, 3, 9, 200, 11, 5, 8, 1, 2, 3], [42, 17, 0, 0, 0, 0, 0, 0, 0, 0]],
                     np.int32)
  lengths = np.array([10, 2], np.int32)
  base = with_layer_layout(random_model(ARCHS[arch], seed=6), True)
  got = generate(with_config(base, attention_impl="blockwise"), prompts, lengths,
                 max_new_tokens=6)
  want = generate(with_config(base, attention_impl="reference"), prompts, lengths,
                  max_new_tokens=6)
  np.testing.assert_array_equal(np.asarray(got.tokens_BxT), np.asarray(want.tokens_BxT))
  np.testing.assert_allclose(got.logprobs_BxT, want.logprobs_BxT, **TOL)


def test_blockwise_temporaries_are_a_fraction_of_reference_under_a_layer_scan():
  """Compiled temporaries of a gradient through two scanned layers at L = S = 2048: the
  reference path holds fp32 (L, S) scores and probabilities per head; blockwise holds one
  (128, 128) pair and (L, H)-sized accumulators, and the layer scan keeps no per-pair masks or
  scores (measured: 8.8 MB against 67 MB of scores)."""
  B, L, K, G, H = 1, 2048, 2, 2, 16
  q, k, v = _qkv(B, L, L, K, G, H)
  idx = jnp.broadcast_to(jnp.arange(L), (B, L))
  kw = dict(q_index_BxL=idx, k_index_BxS=idx, scale=0.25)
  ref = lambda q, k, v: reference_attention(q, k, v, **kw)[0]
  blk = lambda q, k, v: attention_blockwise.blockwise_attention(
      q, k, v, block_q=128, block_k=128, causal_offset=0, **kw)

  def layers(attn):
    def loss(w, q, k, v):
      def body(q, w_layer):
        return attn(q * w_layer, k, v), None
      return jax.lax.scan(body, q, w)[0].sum()
    return loss

  w = jnp.ones((2, 1, 1, 1, 1, H))
  temp = lambda f: (jax.jit(jax.grad(layers(f), argnums=(0, 1, 2, 3))).lower(w, q, k, v)
                    .compile().memory_analysis().temp_size_in_bytes)
  scores_bytes = B * K * G * L * L * 4
  assert temp(ref) >= scores_bytes
  assert temp(blk) < scores_bytes / 4


# Splash (TPU kernel) against the reference: on CPU in Pallas interpret mode at 256 tokens (one
# block); on the chip (scripts/chip_tests.sh) the Mosaic kernel at 2048 tokens in tiles the
# model exposes (model.splash_blocks, model.splash_fused_bwd): the default (1024, 1024, 512) with
# the fused backward, (512, 1024, 512) fused and (512, 512, 512) with the two-kernel backward; so
# query blocks meet one or two key blocks, a document boundary inside a block and a window across
# blocks.
SPLASH_CASES = {
    "causal-f32-512x512x512": dict(dtype="float32", window=None, softcap=None,
                                   blocks=(512, 512, 512), fused_bwd=False, head_dim=64),
    "window-softcap-f32-1024x1024x512-fused": dict(dtype="float32", window="local", softcap=30.0,
                                                   blocks=(1024, 1024, 512), fused_bwd=True,
                                                   head_dim=128),
    "causal-bf16-1024x1024x512-fused": dict(dtype="bfloat16", window=None, softcap=None,
                                            blocks=(1024, 1024, 512), fused_bwd=True,
                                            head_dim=128),
    "traced-window-bf16-512x1024x512-fused": dict(dtype="bfloat16", window="traced",
                                                  softcap=None, blocks=(512, 1024, 512),
                                                  fused_bwd=True, head_dim=64),
}


@pytest.mark.parametrize("case", list(SPLASH_CASES))
def test_splash_kernel_matches_reference(case):
  """Splash attention (splash_attention, as a model with attention_impl='splash' calls it) against
  the reference: causal or a sliding window (static, or traced as scanned layers carry it:
  a switch over the model's windows), packed segments with padding, GQA (2 kv heads of 2 query
  heads), soft-cap; output and q, k, v gradients. float32 against the float32 reference;
  bfloat16 against the float32 reference of the same rounded inputs (chip.assert_bf16;
  tolerances: tests/support/chip.py)."""
  c = SPLASH_CASES[case]
  B, L, K, G, H = chip.pick(cpu=(1, 256, 2, 2, c["head_dim"]), tpu=(2, 2048, 2, 2, c["head_dim"]))
  window = {None: None, "local": chip.pick(40, 600), "traced": chip.pick(40, 600)}[c["window"]]
  dtype = jnp.dtype(c["dtype"])
  q, k, v = (x.astype(dtype) for x in _qkv(B, L, L, K, G, H, seed=3))
  idx = jnp.broadcast_to(jnp.arange(L), (B, L))
  seg = _packed_segments(B, L)
  common = dict(q_segment_BxL=seg, k_segment_BxS=seg, scale=H ** -0.5, softcap=c["softcap"])
  ref = lambda q, k, v: reference_attention(q, k, v, q_index_BxL=idx, k_index_BxS=idx,
                                            window=window, **common)[0]
  # A traced window is a jit argument: the call switches over the model's windows.
  traced = (jnp.asarray(window, jnp.int32),) if c["window"] == "traced" else ()
  spl = lambda q, k, v, *w: splash_attention(
      q, k, v, window=w[0] if w else window, windows=(window, GLOBAL_WINDOW) if w else (window,),
      interpret=chip.interpret(), blocks=c["blocks"], fused_bwd=c["fused_bwd"], **common)
  with chip.precision(dtype):
    spl_out, spl_grads = _out_and_grads(spl, q, k, v, *traced)
  ref_out, ref_grads = _out_and_grads(ref, *(x.astype(jnp.float32) for x in (q, k, v)))
  for name, got, want in zip(["out", "dq", "dk", "dv"], [spl_out, *spl_grads],
                             [ref_out, *ref_grads]):
    chip.assert_close(np.asarray(got.astype(jnp.float32)), want, dtype=dtype, atol=2e-5,
                      rtol=1e-5, err_msg=name)


def test_splash_under_sharding_rules_with_a_traced_window():
  """Under GSPMD rules (fsdp_tp on a 4 x 2 mesh) splash runs inside a shard_map over batch and
  kv heads; a traced window (scanned layers) selects among the model's static windows."""
  from distillax import partitioning as pt

  mesh = pt.create_mesh({"data": 4, "model": 2})
  rules = pt.rules_from_config({"strategy": "fsdp_tp"})
  B, L, K, G, H = 4, 256, 2, 2, 64
  q, k, v = _qkv(B, L, L, K, G, H, seed=5)
  seg = _packed_segments(B, L)
  idx = jnp.broadcast_to(jnp.arange(L), (B, L))
  common = dict(q_segment_BxL=seg, k_segment_BxS=seg, scale=H ** -0.5, softcap=30.0)

  @jax.jit
  def spl(q, k, v, window):
    with pt.use_rules(mesh, rules):
      return splash_attention(q, k, v, window=window, windows=(40, GLOBAL_WINDOW),
                              interpret=True, **common)

  for window in (40, GLOBAL_WINDOW):
    want = reference_attention(q, k, v, q_index_BxL=idx, k_index_BxS=idx, window=window,
                               **common)[0]
    with jax.set_mesh(mesh):
      got = spl(q, k, v, jnp.asarray(window, jnp.int32))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"window {window}")


@pytest.mark.parametrize("window,segments", [(None, False), (7, True), ("traced", True)])
def test_cudnn_call_plumbing_matches_reference_through_xla(window, segments):
  """What cudnn_attention hands jax.nn.dot_product_attention (GQA head layout, scale, causal
  flag, the left window, the segment mask, the switch over a traced window), run by XLA's own
  implementation of that API on CPU. The cuDNN kernel itself is UNVERIFIED (no GPU here)."""
  B, L, K, G, H = 2, 40, 2, 3, 16
  q, k, v = _qkv(B, L, L, K, G, H, seed=7)
  idx = jnp.broadcast_to(jnp.arange(L), (B, L))
  seg = _packed_segments(B, L) if segments else None
  traced = window == "traced"
  windows = (7, GLOBAL_WINDOW) if traced else (window,)
  for w in ((7, GLOBAL_WINDOW) if traced else (window,)):
    want = reference_attention(q, k, v, q_index_BxL=idx, k_index_BxS=idx, q_segment_BxL=seg,
                               k_segment_BxS=seg, window=w, scale=0.3)[0]
    call = lambda w: cudnn_attention(q, k, v, q_segment_BxL=seg, k_segment_BxS=seg, window=w,
                                     windows=windows, scale=0.3, implementation="xla")
    got = jax.jit(call)(jnp.asarray(w, jnp.int32)) if traced else call(w)
    np.testing.assert_allclose(got, want, **TOL, err_msg=f"window {w}")


# ---- what auto picks -----------------------------------------------------------------------

TRAIN = AttentionNeeds(query_len=2048, key_len=2048, segments=True, dtype="bfloat16",
                       head_dim=64)


@pytest.mark.parametrize("platform,needs,want", [
    ("cpu", TRAIN, "blockwise"),
    ("gpu", TRAIN, "cudnn"),
    ("tpu", TRAIN, "splash"),
    # Gemma 2's soft-cap: splash has one, cuDNN does not.
    ("gpu", AttentionNeeds(**{**TRAIN.__dict__, "softcap": True, "window": True}), "blockwise"),
    ("tpu", AttentionNeeds(**{**TRAIN.__dict__, "softcap": True, "window": True}), "splash"),
    # cuDNN flash attention is half precision only; head_dim 256 is past its backward's limit.
    ("gpu", AttentionNeeds(**{**TRAIN.__dict__, "dtype": "float32"}), "blockwise"),
    ("gpu", AttentionNeeds(**{**TRAIN.__dict__, "head_dim": 256}), "blockwise"),
    # Splash works in 128-token blocks.
    ("tpu", AttentionNeeds(**{**TRAIN.__dict__, "query_len": 100, "key_len": 100}), "blockwise"),
    # Attention transfer reads the probabilities: the reference path on every platform.
    ("gpu", AttentionNeeds(**{**TRAIN.__dict__, "probs": True}), "reference"),
    ("cpu", AttentionNeeds(**{**TRAIN.__dict__, "probs": True}), "reference"),
    # KV cache: decode steps (one query) use the reference, a prefill runs blockwise.
    ("tpu", AttentionNeeds(**{**TRAIN.__dict__, "cached": True, "query_len": 1}), "reference"),
    ("gpu", AttentionNeeds(**{**TRAIN.__dict__, "cached": True, "query_len": 64}), "blockwise"),
    # gpt-oss's attention sinks: neither fused kernel has them.
    ("gpu", AttentionNeeds(**{**TRAIN.__dict__, "sinks": True}), "blockwise"),
    ("tpu", AttentionNeeds(**{**TRAIN.__dict__, "sinks": True}), "blockwise"),
])
def test_auto_picks_by_platform_and_needs(platform, needs, want):
  assert choose("auto", platform, needs)[0] == want


def test_explicit_choices_and_their_errors():
  assert choose("reference", "gpu", TRAIN)[0] == "reference"
  assert choose("blockwise", "tpu", TRAIN)[0] == "blockwise"
  assert choose("cudnn", "gpu", TRAIN)[0] == "cudnn"
  assert choose("splash", "tpu", TRAIN)[0] == "splash"
  with pytest.raises(ConfigError, match=r"attention_impl='cudnn' needs JAX platform 'gpu'.*'cpu'"):
    choose("cudnn", "cpu", TRAIN)
  with pytest.raises(ConfigError, match="soft-cap"):
    choose("cudnn", "gpu", AttentionNeeds(**{**TRAIN.__dict__, "softcap": True}))
  with pytest.raises(ConfigError, match="splash attention has no attention sinks"):
    choose("splash", "tpu", AttentionNeeds(**{**TRAIN.__dict__, "sinks": True}))
  with pytest.raises(ConfigError, match="attention_impl='flash'; choose one of auto"):
    choose("flash", "gpu", TRAIN)
  with pytest.raises(ConfigError, match="model.attention_impl='flash'"):
    get_preset("tiny", attention_impl="flash")


def test_auto_logs_its_choice_once(caplog, monkeypatch):
  monkeypatch.setattr(attention_impl, "_logged", set())
  needs = AttentionNeeds(query_len=16, key_len=16)
  with caplog.at_level("INFO", logger=attention_impl.__name__):
    for _ in range(3):
      assert attention_impl.resolve("auto", needs) == "blockwise"  # tests run on CPU
  lines = [r.getMessage() for r in caplog.records if r.name == attention_impl.__name__]
  assert lines == ["attention: model.attention_impl='auto' runs blockwise (platform 'cpu' has "
                   "no fused attention kernel here)"]
  assert GLOBAL_WINDOW > 2**20  # the global layers' window never cuts a sequence
