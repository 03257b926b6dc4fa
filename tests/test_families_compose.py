"""The model families of 2026 (Gemma 3, Gemma 4, Qwen3.5, SmolLM3) compose with the rest of
distillax: every partitioning preset places them, the most sharded preset trains them to the
numbers of the shard_map backend's replicated step, they train under q4_0 QAT, LoRA and QLoRA,
and the KV-cached sampler of on-policy distillation decodes them. pmap and vmap are not run
here: the backends run one pure step whatever the model, and tests/framework/test_backends.py
holds all four to jit's numbers (pmap runs through shard_map in this JAX).

Compiling is what these tests cost. Models sit side by side in one module (`Families`), each
one's loss a metric of its own and its parameters compared leaf by leaf; but XLA compiles such a
step superlinearly in the models it holds (the four families under fsdp_tp_sp on 4 x 2, traced
and compiled on a loaded machine: 27.5 s together, Gemma 3 and Gemma 4 together 10.7 s, alone
1.9 s and 3.9 s), so the sharded runs train each family in a step program of its own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from distillax import partitioning as pt
from distillax.distill.on_policy.objective import (PROMPT_LENGTHS, PROMPT_TOKENS, ROW_IDS,
                                         OnPolicySettings, sample_rollout, scoring_batch)
from distillax.framework.step import ObjectiveOutput
from distillax.models.attention import impl as attention_impl
from distillax.models.config import FULL, LINEAR, SLIDING
from distillax.models.init import abstract_model, model_shardings
from distillax.models.presets import get_preset
from distillax.quant import (LoRAParam, QuantSiteParam, QuantizedValue, apply_lora, merge_lora,
                             quantize_for_training, quantize_post_training)
from distillax.trainers import lm_objective
from tests.support.engines import (lm_loss, mesh_and_rules, optimizer_config, packed_batches,
                                   run_steps, tiny_engine)
from tests.support.models import NORMS_NEAR_ONE, random_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

VOCAB = 64
FAMILIES = {
    # A sliding layer (window 8, RoPE base 10k) and a global one (1M, linear x8), scanned.
    "gemma3": get_preset("tiny_gemma3", vocab_size=VOCAB, num_layers=2,
                         sliding_window_pattern=2, scan_layers=True),
    # Sliding, full (wider heads, proportional RoPE), then a sliding layer on layer 0's keys
    # and values; per-layer inputs 32 wide, so q4_0's blocks of 32 fit their matmuls.
    "gemma4": get_preset("tiny_gemma4", vocab_size=VOCAB, num_layers=3,
                         layer_types=(SLIDING, FULL, SLIDING), num_kv_shared_layers=1,
                         per_layer_input_dim=32),
    # A Gated DeltaNet layer (chunks of 8: two per row) then a gated full-attention layer.
    "qwen35": get_preset("tiny_qwen35", vocab_size=VOCAB, num_layers=2,
                         token_mixers=(LINEAR, FULL), linear_attention_chunk=8),
    # Llama with no RoPE in its second layer and tied embeddings, scanned.
    "smollm3": get_preset("tiny", vocab_size=VOCAB, num_layers=2, rope_free_layers=(1,),
                          tie_embeddings=True, scan_layers=True),
}
BATCH = packed_batches(1, batch=8, seq_len=16, vocab=VOCAB, seed=2)[0]
MESH = (4, 2)
Q4_0_RULES = {"rules": [("", None, None, None), (".*", "q4_0", "q8_0", None)]}
LORA_REGEX = r"layers/(.*/)?(attn|mlp)/.*"  # distillax/configs/lora.py's
# The families LoRA and QLoRA adapt here: Gemma 3's and SmolLM3's adapted sites are Llama's
# attention and MLP (tests/quant's LoRA and QLoRA runs); the DeltaNet, Qwen3.5's output gate
# and Gemma 4's per-layer inputs and shared-KV layers are sites of their own.
ADAPTED_FAMILIES = ("gemma4", "qwen35")


class Families(nnx.Module):
  """Models side by side under names, so one compiled step trains them all."""

  def __init__(self, models):
    self.names = tuple(models)
    for name, model in models.items():
      setattr(self, name, model)


def families_objective(student, extras, batch, rng):
  """The sum of every model's next-token loss; each one's own is the metric `loss_<name>`."""
  outs = {name: lm_objective(getattr(student, name), extras, batch, rng)
          for name in student.names}
  return ObjectiveOutput(loss_sum=sum(o.loss_sum for o in outs.values()),
                         tokens=outs[student.names[0]].tokens,
                         sums={f"loss_{name}": o.loss_sum for name, o in outs.items()})


def _copy(module):
  """The same values in fresh arrays (steps donate their state)."""
  graphdef, state = nnx.split(module)
  return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


def _optimizer(gradient_step: bool):
  """The tests' optimizer with no warmup (the first step already moves every parameter).
  `gradient_step`: Adam's eps at 1 and no weight decay, so that the first step is
  lr * g / (|g| + 1), about lr * g, and two runs compare on their gradients (at eps 1e-8 it
  is lr * sign(g), and summation-order noise in a near-zero gradient moves it by up to lr)."""
  opt = optimizer_config()
  opt.warmup_steps = 0
  if gradient_step:
    opt.learning_rate, opt.eps, opt.weight_decay = 1.0, 1.0, 0.0
  return opt


def _train(families, backend, strategy, mesh_shape, steps=1, trainable=nnx.Param,
           gradient_step=False):
  """({name: losses per step}, final trainable params on the host) of `steps` steps on BATCH
  (the same batch each step, so that a few steps visibly lower every loss)."""
  mesh, rules = mesh_and_rules(strategy, *mesh_shape, devices=jax.devices()[:np.prod(mesh_shape)])
  opt = _optimizer(gradient_step)
  model = _copy(families)
  engine = tiny_engine(model, BATCH, mesh, rules, backend, steps=4, opt=opt,
                       objective=families_objective, trainable=trainable)
  state = engine.init_state(model, {}, seed=0)
  losses = {name: [] for name in families.names}
  for _ in range(steps):
    state, metrics = engine.runner(state, engine.runner.place_batch(BATCH))
    for name in families.names:
      losses[name].append(float(metrics[f"loss_{name}"]))
  return losses, jax.device_get(engine.runner.fetch_state(state).params)


def _train_each(models, *args, **kwargs):
  """_train of every model in a step program of its own (a Families of one), at a fraction of
  the compile (the module doc). Each model is then clipped by its own global gradient norm, not
  the side-by-side models' joint one: compare such runs only with runs of _train_each."""
  losses, params = {}, {}
  for name, model in models.items():
    one_losses, one_params = _train(Families({name: model}), *args, **kwargs)
    losses.update(one_losses)
    params[name] = one_params[name]
  return losses, params


@pytest.fixture(scope="module")
def models():
  return {name: random_model(cfg, seed=0, init=NORMS_NEAR_ONE) for name, cfg in FAMILIES.items()}


def _specs(abstract, strategy):
  mesh, rules = mesh_and_rules(strategy, *MESH)
  shardings = model_shardings(abstract, mesh, rules)
  return jax.tree.map(lambda s: tuple(s.spec) + (None,) * 4, shardings,
                      is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))


def test_every_preset_places_every_family_by_its_logical_axes():
  """No compile: each preset resolves every family's parameters on a 4 x 2 mesh; on dense
  models the expert presets and the sequence-parallel ones lay parameters out as fsdp / tp /
  fsdp_tp do (so the numbers test below compiles only the most sharded), and the
  family-specific weights take the axes their logical names say."""
  same_params_as = {"fsdp_ep": "fsdp", "ep_tp": "tp", "tp_sp": "tp", "fsdp_tp_sp": "fsdp_tp"}
  assert set(same_params_as) | {"dp", "fsdp", "tp", "fsdp_tp"} == set(pt.BUILTIN_PRESETS)
  for name, config in FAMILIES.items():
    abstract = abstract_model(config)
    specs = {strategy: _specs(abstract, strategy) for strategy in pt.BUILTIN_PRESETS}
    for strategy, twin in same_params_as.items():
      assert specs[strategy] == specs[twin], (name, strategy)
    assert all(s == (None,) * len(s) for s in jax.tree.leaves(
        specs["dp"], is_leaf=lambda x: isinstance(x, tuple)))
    layers = specs["fsdp_tp"]["layers"]
    if name == "qwen35":  # the Gated DeltaNet layer: its value / key heads go over model
      net = layers[0]["attn"]
      assert net["q"][:3] == net["k"][:3] == ("data", "model", None), net["q"]
      assert net["v"][:3] == net["z"][:3] == ("data", "model", None)
      assert net["a"][:2] == net["b"][:2] == ("data", "model")
      assert net["A_log"][:1] == net["dt_bias"][:1] == ("model",)
      assert net["o"][:3] == ("model", None, "data")
      assert net["conv"][:2] == (None, None)  # over q, k and v features side by side
    if name == "gemma4":  # per-layer inputs: the second table by vocabulary, gates by width
      table = specs["fsdp_tp"]["per_layer_inputs"]
      assert table["embedding"][:2] == ("model", None)
      assert table["projection"][:2] == ("data", None)
      assert layers[0]["per_layer"]["gate"][:2] == ("data", None)
      assert layers[0]["per_layer"]["projection"][:2] == (None, "data")
      assert "k" not in layers[2]["attn"]  # the sharing layer has no keys of its own
    if name in ("gemma3", "smollm3"):  # scanned: the stacked layer axis stays whole
      assert layers["attn"]["q"][:4] == (None, "data", "model", None)


def _max_delta(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_backends_and_the_most_sharded_preset_train_every_family_like_replicated(models):
  """One step of the four families: the shard_map backend (parameters replicated on every
  device) and jit under fsdp_tp_sp (width over data; heads, MLP, vocabulary and the
  residual stream's length over model: every rule of the dense presets at once; fsdp and tp
  use subsets of them, and the test above shows the expert and sequence-parallel presets lay
  parameters out as those), with blockwise attention, give the same losses and updated
  parameters."""
  families = Families(models)
  runs = {"shard_map": _train_each(models, "shard_map", "dp", (8, 1), gradient_step=True)}
  with attention_impl.recorded_choices() as choices:
    runs["jit fsdp_tp_sp"] = _train_each(models, "jit", "fsdp_tp_sp", MESH, gradient_step=True)
  # CPU training runs blockwise attention: every attention layer of the four families did.
  assert len(choices) >= 6 and {impl for _, impl, _ in choices} == {"blockwise"}, choices
  ref_losses, ref_params = runs.pop("shard_map")
  for what, (losses, params) in runs.items():
    for name in families.names:
      np.testing.assert_allclose(losses[name], ref_losses[name], rtol=1e-5,
                                 err_msg=f"{what} {name}")
      assert _max_delta(params[name], ref_params[name]) < 2e-5, (what, name)
  # The step moved each family's parameters (by 0.03 to 0.1; the runs differ by < 5e-7).
  start = nnx.to_pure_dict(nnx.state(families, nnx.Param))
  for name in families.names:
    assert _max_delta(ref_params[name], start[name]) > 1e-2, name


def _trains_qat_or_adapters(path, value) -> bool:
  """The trainable filter of the quantization test: the QAT models' weights, and adapters."""
  return isinstance(value, LoRAParam) or (str(path[0]).startswith("qat_")
                                          and isinstance(value, nnx.Param))


@nnx.jit
def _all_logits(families, tokens_BxL):
  return {name: getattr(families, name)(tokens_BxL).logits_BxLxV for name in families.names}


def test_every_family_trains_under_q4_0_qat_lora_and_qlora(models):
  """Two step programs train each family three ways: q4_0 weights / q8_0 activations
  (QAT: its first loss is the loss of the same weights rounded once, PTQ), LoRA and QLoRA
  (nf4 base) adapters (ADAPTED_FAMILIES) on the shipped module_regex, on one device (the
  families' sharding is the test above's). Every loss falls over 3 steps, and the merged
  export of the trained adapters computes the adapted model's logits."""
  qat = {name: quantize_for_training(_copy(m), Q4_0_RULES) for name, m in models.items()}
  # Fake-quant sites by hand: q k v o gate up down per layer (a Gemma 4 sharing layer has no
  # k / v; its layers also gate and project their per-layer input, and the per-layer table
  # has a projection), the DeltaNet's q k v z a b o and Qwen3.5's attention output gate; the
  # output layer (lm_head or tied embeddings, module path "") stays full precision.
  sites = {name: sum(isinstance(v, QuantSiteParam) for _, v in nnx.iter_graph(m))
           for name, m in qat.items()}
  assert sites == {"gemma3": 7, "gemma4": 9 + 9 + 7 + 1, "qwen35": 10 + 8, "smollm3": 7}
  lora = {name: apply_lora(_copy(m), module_regex=LORA_REGEX, rank=4, dropout=0.0)
          for name, m in models.items() if name in ADAPTED_FAMILIES}
  qlora = {name: apply_lora(_copy(m), module_regex=LORA_REGEX, rank=4, dropout=0.0,
                            base_qtype="nf4", base_tile_size=16) for name, m in models.items()
           if name in ADAPTED_FAMILIES}
  # Two step programs: one of the eight models traced and compiled in 33.6 s here, the four
  # QAT models and the four adapted ones apart in 12.8 + 13.0 s (on one device a group split
  # further is no cheaper: QAT's halves took 17.5 s).
  groups = (Families({f"qat_{name}": m for name, m in qat.items()}),
            Families({f"{kind}_{name}": m for kind, group in (("lora", lora), ("qlora", qlora))
                      for name, m in group.items()}))
  losses, params = {}, {}
  for families in groups:
    group_losses, group_params = _train(families, "jit", "dp", (1, 1), steps=3,
                                        trainable=_trains_qat_or_adapters)
    losses.update(group_losses)
    params.update({name: group_params[name] for name in families.names})
  assert len(losses) == 8
  for name, per_step in losses.items():
    assert np.all(np.isfinite(per_step)) and per_step[-1] < per_step[0] - 0.05, (name, per_step)
  for name, model in models.items():
    ptq = float(lm_loss(quantize_post_training(model, Q4_0_RULES), BATCH))
    np.testing.assert_allclose(losses[f"qat_{name}"][0], ptq, rtol=1e-4, err_msg=name)

  adapted = groups[1]
  for name in adapted.names:  # the trained adapters into the models
    model = getattr(adapted, name)
    state = nnx.state(model, LoRAParam)
    nnx.replace_by_pure_dict(state, params[name])
    nnx.update(model, state)
    b_leaves = [b for path, b in jax.tree_util.tree_flatten_with_path(params[name])[0]
                if jax.tree_util.keystr(path).endswith("['lora_b']")]
    assert b_leaves and max(float(np.abs(b).max()) for b in b_leaves) > 1e-3  # B left zero
  merged = Families({name: merge_lora(getattr(adapted, name)) for name in adapted.names})
  tokens_BxL = jnp.asarray(BATCH["inputs_BxL"])
  want, got = _all_logits(adapted, tokens_BxL), _all_logits(merged, tokens_BxL)
  for name in adapted.names:
    assert not any(isinstance(v, (LoRAParam, QuantizedValue))
                   for _, v in nnx.iter_graph(getattr(merged, name)))
    # Logits of about 1 (the trained adapters move them by about 1 in tiny_gemma3 and
    # tiny_gemma4, measured), so a merge error shows in whole units; the last-bit difference of
    # W + s A B against the adapter's own matmul reaches up to 8e-5 in a few of them; the
    # DeltaNet's chunked delta rule (a triangular solve per chunk) turns it into ~1.4e-4 (its
    # chunked and recurrent forms also agree to 1e-4 only: tests/models/test_gated_deltanet.py).
    atol = 5e-4 if name.endswith("qwen35") else 2e-4
    np.testing.assert_allclose(got[name], want[name], atol=atol, err_msg=name)


PROMPT_LENGTHS_B = np.array([6, 3], np.int32)
GREEDY = OnPolicySettings(max_new_tokens=8, temperature=0.0, pad_id=0)


@nnx.jit
def _rollouts_and_full_forwards(families, batch):
  """Each model's greedy on-policy rollout (KV-cached decode) and its full forward over the
  prompt + completion the rollout scores."""
  out = {}
  for name in families.names:
    model = getattr(families, name)
    rollout = sample_rollout(model, batch, jax.random.key(0), GREEDY)
    scored = scoring_batch(rollout, GREEDY.pad_id)
    logits_BxLxV = model(scored["inputs_BxL"], positions_BxL=scored["positions_BxL"],
                         segment_ids_BxL=scored["segment_ids_BxL"]).logits_BxLxV
    out[name] = (rollout.generated.logprobs_BxT, rollout.generated.lengths_B,
                 scored["targets_BxL"], scored["loss_mask_BxL"], logits_BxLxV)
  return out


def test_on_policy_sampling_decodes_every_family_like_its_full_forward(models):
  """Prompts of 6 and 3 tokens (the shorter left-padded in the cache), 8 greedy tokens: past
  the sliding window (8) of the Gemmas, Gemma 4's sharing layer reading layer 0's cache, the
  DeltaNet's conv and recurrent state carried token by token. Every sampled token is the
  argmax of the full forward at its position (up to 1e-4 near-ties) and its log-probability
  is the full forward's."""
  prompts = np.random.default_rng(5).integers(1, VOCAB, (2, 6)).astype(np.int32)
  prompts[np.arange(6)[None, :] >= PROMPT_LENGTHS_B[:, None]] = 0
  batch = {PROMPT_TOKENS: jnp.asarray(prompts), PROMPT_LENGTHS: jnp.asarray(PROMPT_LENGTHS_B),
           ROW_IDS: jnp.arange(2, dtype=jnp.int32)}
  out = _rollouts_and_full_forwards(Families(models), batch)
  for name, (logprobs_BxT, lengths_B, targets, mask, logits) in out.items():
    np.testing.assert_array_equal(lengths_B, GREEDY.max_new_tokens, err_msg=name)
    keep = np.asarray(mask) > 0
    logits = np.asarray(logits, np.float64)[keep]
    chosen = np.asarray(targets)[keep]
    assert len(chosen) == 2 * GREEDY.max_new_tokens, name
    chosen_logit = logits[np.arange(len(chosen)), chosen]
    assert np.all(chosen_logit >= logits.max(-1) - 1e-4), (name, chosen_logit - logits.max(-1))
    full_logprobs = chosen_logit - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)
                                          ) - logits.max(-1)
    np.testing.assert_allclose(np.asarray(logprobs_BxT).reshape(-1), full_logprobs, atol=2e-4,
                               err_msg=name)
    assert len(set(chosen.tolist())) > 2, (name, chosen)  # not one token over and over
