"""Issue 53's sampler on devices of its own, on 8 simulated CPU devices: with
on_policy.sampler_devices=4 the trainer's 2 x 2 mesh is laid over devices 0-3 and the sampler's
over 4-7. The steps draw the samples, and give the losses, gradients and updates, that the
same trainer mesh gives when it samples inside its own step; a micro-batched step too. Its
misfits are refused in one line before anything is built."""

import jax
import numpy as np
import pytest

from distillax import main as cli
from distillax import partitioning as pt
from distillax.configs import on_policy as op_config
from distillax.errors import ConfigError
from distillax.trainers import recipe_for
from tests.trainers.on_policy.test_recipe import CONFIG, _assert_alike, _small

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
LR = 1e-2


def _config(**on_policy):
  config = _small(op_config.get_config("tiny"), divergence="sampled_kl", **on_policy)
  config.partitioning.strategy, config.mesh.model = "fsdp_tp", 2
  # The first step moves the weights enough that the second step's samples tell them apart
  # from the first's (no warmup step at learning rate 0).
  config.optimizer.warmup_steps, config.optimizer.learning_rate = 0, LR
  return config


def _assert_same_steps(rows, params, want_rows, want_params):
  """test_recipe's comparison (the same samples, losses and gradients to float rounding), with
  parameters to a hundredth of the learning rate: Adam moves each weight by up to about LR a
  step whatever its gradient's size, so a gradient near 0 that rounds otherwise on another
  layout (the sampler's decode sums in another order than the trainer mesh's) moves its weight
  by another share of LR (0.2% of LR seen here, on 1 weight of 8,192)."""
  _assert_alike(rows, params, want_rows, want_params, params_atol=1e-2 * LR)


def _run(recipe, batches):
  """(per-step metrics, final params, the ids of the devices holding them, the engine) of
  len(batches) steps from a fresh state."""
  engine = recipe.build_engines().main
  student, extras = recipe.build(abstract=False)
  state = engine.init_state(student, extras, int(recipe.config.seed))
  rows = []
  for batch in batches:
    state, metrics = engine.runner(state, engine.runner.place_batch(batch))
    rows.append({k: np.asarray(v) for k, v in jax.device_get(metrics).items()})
  params = engine.runner.fetch_state(state).params
  devices = {d.id for x in jax.tree.leaves(params) for d in x.devices()}
  return rows, jax.device_get(params), devices, engine


@pytest.fixture(scope="module")
def shared():
  """The reference: the same config on devices 0-3, sampling inside its step."""
  config = _config()
  mesh = pt.create_mesh(config.mesh, devices=jax.devices()[:4])
  recipe = recipe_for(config, mesh=mesh)
  it = recipe.train_iterator()
  batches = [next(it) for _ in range(2)]
  return batches, _run(recipe, batches)


@pytest.mark.parametrize("micro_batch", [0, 4])
def test_a_sampler_on_its_own_devices_samples_and_trains_like_the_shared_step(shared,
                                                                              micro_batch):
  batches, (want_rows, want_params, _, _) = shared
  recipe = recipe_for(_config(sampler_devices=4, micro_batch=micro_batch))
  assert recipe.accum_steps == (2 if micro_batch else 1)
  rows, params, devices, _ = _run(recipe, batches)
  _assert_same_steps(rows, params, want_rows, want_params)
  sampler = {d.id for d in recipe.sampler_devices.sampler_mesh.devices.flat}
  assert {d.id for d in recipe.mesh.devices.flat} == devices == {0, 1, 2, 3}
  assert sampler == {4, 5, 6, 7}


def test_the_step_is_handed_its_samples_and_decodes_none(shared):
  """The trainer's compiled step takes the sampler's arrays as inputs and does the FLOPs of
  the shared step less its decode."""
  _, (_, _, _, shared_engine) = shared
  recipe = recipe_for(_config(sampler_devices=4))
  assert {k for k in recipe.batch_shapes() if k.startswith("rollout/")}
  own = recipe.build_engines().main.runner.stats["flops"]
  assert 0 < own < shared_engine.runner.stats["flops"]


@pytest.mark.parametrize("overrides,words", [
    ({"on_policy.sampler_devices": 8}, "must leave the trainer at least one of the 8 devices"),
    ({"on_policy.sampler_devices": 6, "mesh.model": 1},
     "train.batch_size=8 prompts cannot be split evenly over the sampler's 6 devices"),
    ({"on_policy.sampler_devices": 4, "backend": "pmap"}, "needs backend=jit"),
    ({"on_policy.sampler_devices": 4, "on_policy.lmbda": 0.0}, "never samples"),
    ({"on_policy.sampler_devices": 4, "mesh.data": 4},
     "mesh 4x2 (data x model) needs 8 devices but 4 are available"),
    ({"on_policy.sampler_devices": 4, "mesh.data": 4}, "keeps 4 of the 8 devices for the sampler"),
])
def test_misfits_are_refused_in_one_line(overrides, words):
  config = _config()
  for key, value in overrides.items():
    section, name = key.split(".") if "." in key else (None, key)
    (config[section] if section else config)[name] = value
  with pytest.raises(ConfigError) as e:
    recipe_for(config)
  assert words in str(e.value) and "\n" not in str(e.value)


def test_cli_refuses_a_sampler_without_devices_left_and_writes_nothing(tmp_path, capsys):
  workdir = tmp_path / "run"
  code = cli.main(["distillax", "train", "--config", f"{CONFIG}:tiny", "--workdir",
                   str(workdir), "--config.on_policy.sampler_devices=8"])
  assert code == 2 and not workdir.exists()
  assert "on_policy.sampler_devices=8" in capsys.readouterr().err


def test_plan_line_sizes_the_sampler_on_its_own_devices():
  """8 completions of 6 + 4 tokens over the sampler's 4 devices: 2 rows a device x 10
  positions of KV cache (128 bytes a position, as in test_recipe.py: 2,560 bytes), and a whole
  copy of the student's weights on each, its trained 400 bytes and frozen 100 (of 1,000 frozen
  bytes, 900 the teacher's) cast from fp32 to bf16: 250 bytes."""
  from distillax.distill.on_policy.objective import OnPolicySettings
  from distillax.models.config import TransformerConfig
  from distillax.trainers.on_policy.recipe import sampler_devices_plan_line
  cfg = TransformerConfig(vocab_size=32, embed_dim=16, num_layers=2, num_heads=2,
                          num_kv_heads=2, head_dim=8, mlp_dim=32, max_seq_len=16,
                          dtype="bfloat16")
  report = {"params_total_bytes": 400, "frozen_total_bytes": 1000,
            "frozen_models": {"teacher": (900, 225)}}
  line = sampler_devices_plan_line(cfg, 8, 2, 6, OnPolicySettings(max_new_tokens=4,
                                                                  cast_weights=True), report, 4)
  assert line == ("on-policy batches: sampling 8 completions of 6 + 4 tokens at once on the "
                  f"sampler's 4 devices (per device: the student's weights {250 / 2**30:.3g} "
                  f"GiB + KV cache {2560 / 2**30:.3g} GiB), update micro-batch 4 completions x "
                  "2 per step on the trainer's (in the compiled step's peak)")
