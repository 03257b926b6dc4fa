"""The on-policy sampler on devices of its own: a served student beside the trainer.

`on_policy.sampler_devices = K` keeps the last K devices for sampling. The trainer's mesh
(config.mesh) is laid over the others, the sampler's over these K: data parallel, a whole copy of
the student's weights on each device and the sampling batch's rows split over them (decode holds
no optimizer state, so nothing asks for FSDP there). Each step, strictly on-policy:

  1. the student's weights as the step holds them go to the sampler: one program on the
     trainer's devices gathers them whole and casts the matmul weights to the compute dtype (a
     plain student; what the sampler would cast anyway), then they are copied device to device
     onto the sampler's. Whole arrays are copied to whole arrays, because JAX assembles a slice
     that no source buffer holds on the host (jax/_src/array.py, the resharding slow path);
  2. the sampling program there draws the step's whole sampling batch with the step's key: the
     objective's `prepare`, the function the shared-device step runs inside itself;
  3. its arrays come back the same way (whole, then split over the trainer's batch layout by a
     program on the trainer's devices), and the compiled train step, built without `prepare`,
     learns from them in its micro-batches.

So a step's samples, loss, gradients and update are those of the shared-device step
(tests/trainers/on_policy/test_sampler_devices.py). The sampler waits for the update it samples
from: overlapping them would make the samples one step stale, which would be a new, named option.
One host only: between processes, JAX copies arrays across device sets only in the TFRT TPU
runtime, and only between equal layouts; refused in one line.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from distillax import partitioning as pt
from distillax.distill.on_policy.objective import LENGTH_ROWS, PROMPT_KEYS, PROMPT_TEACHER
from distillax.errors import ConfigError
from distillax.framework import backends
from distillax.framework.engine import Engine
from distillax.framework.state import STUDENT
from distillax.models.sampler import matmul_weights_in

FIELD = "on_policy.sampler_devices"


@dataclasses.dataclass(frozen=True)
class SamplerDevices:
  """The two meshes: the trainer's and the sampler's, on disjoint devices."""

  trainer_mesh: Mesh
  sampler_mesh: Mesh

  def describe(self) -> str:
    ids = lambda mesh: ", ".join(str(d.id) for d in mesh.devices.flat)
    return (f"the sampler on devices {ids(self.sampler_mesh)} (data parallel, a whole copy of "
            f"the weights on each), the trainer on {ids(self.trainer_mesh)}")


def split_devices(config, mesh: Mesh | None = None) -> SamplerDevices | None:
  """None where on_policy.sampler_devices is 0 (the trainer's devices sample); else the meshes,
  each misfit refused in one line. `mesh`: the trainer's, when the caller lays it out."""
  count = int(config.on_policy.get("sampler_devices", 0))
  if count == 0:
    return None
  devices = list(jax.devices())
  if count < 0 or count >= len(devices):
    raise ConfigError(f"{FIELD}={count} must leave the trainer at least one of the "
                      f"{len(devices)} devices; use 1 to {len(devices) - 1}, or 0 to sample on "
                      f"the trainer's devices")
  if jax.process_count() > 1:
    raise ConfigError(f"{FIELD}={count} runs on one host only ({jax.process_count()} processes "
                      f"here); set it to 0 to sample on the trainer's devices")
  if str(config.backend) != "jit":
    raise ConfigError(f"{FIELD}={count} needs backend=jit (the step with its samples given as "
                      f"arrays), not {config.backend}; set --config.backend=jit")
  if float(config.on_policy.lmbda) == 0.0:
    raise ConfigError(f"{FIELD}={count} with on_policy.lmbda=0 keeps devices for a sampler that "
                      f"never samples; set {FIELD}=0")
  if mesh is None:
    try:
      mesh = pt.create_mesh(config.mesh, devices=devices[:len(devices) - count])
    except ConfigError as e:
      raise ConfigError(f"{e} ({FIELD}={count} keeps {count} of the {len(devices)} devices "
                        f"for the sampler)") from None
  used = {d.id for d in mesh.devices.flat}
  free = [d for d in devices if d.id not in used]
  if len(free) < count:
    raise ConfigError(f"{FIELD}={count}, but the trainer's mesh leaves {len(free)} of the "
                      f"{len(devices)} devices free; lower it or the mesh")
  sampler = pt.create_mesh({"data": count, "model": 1}, devices=free[len(free) - count:])
  batch = int(config.train.batch_size)
  if batch % count:
    raise ConfigError(f"train.batch_size={batch} prompts cannot be split evenly over the "
                      f"sampler's {count} devices ({FIELD}); use a multiple of {count}")
  return SamplerDevices(mesh, sampler)


def rollout_shapes(student: nnx.Module, prompt_shapes: Mapping, prepare: Callable) -> dict:
  """The arrays the sampler hands the step, as shapes: `prepare` traced on an abstract
  `student` (nnx.eval_shape) and the step's prompts."""
  graph, state = nnx.split(student)
  return jax.eval_shape(lambda st, b: prepare(nnx.merge(graph, st), {}, b, jax.random.key(0)),
                        state, dict(prompt_shapes))


def replicated(mesh: Mesh, tree):
  return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


class SamplerRunner:
  """The runner's call and place_batch (see the module doc). Every `every` steps (0: never) the
  sampling and the update are timed apart, blocking on each, as parts.SamplingClock does for
  the shared-device step: `sampled_tokens_per_s` and `sampling_share` in the metrics."""

  def __init__(self, engine: Engine, prepare: Callable, devices: SamplerDevices,
               rollout: Mapping[str, jax.ShapeDtypeStruct], *, compute_dtype: str | None,
               every: int = 0, clock: Callable[[], float] = time.perf_counter):
    self.engine, self.inner, self.devices = engine, engine.runner, devices
    self.every, self.clock, self.calls, self.figures = int(every), clock, 0, {}
    defs, trainer, sampler = engine.layout.defs, devices.trainer_mesh, devices.sampler_mesh
    cast = (lambda t: matmul_weights_in(t, compute_dtype)) if compute_dtype else (lambda t: t)
    abstract = engine.layout.abstract
    # What the sampler needs of the state: the student's weights, the key and the step.
    sent = (abstract.params, abstract.frozen[STUDENT], abstract.rng, abstract.step)
    # 1: gathered whole (and cast) on the trainer's devices, then copied to the sampler's.
    self.gather = jax.jit(lambda params, frozen, rng, step: (*cast((params, frozen)), rng, step),
                          out_shardings=replicated(trainer, sent))
    self.to_sampler = replicated(sampler, sent)
    self.sampler_rules = pt.rules_from_config({"strategy": "dp"})

    def sample(params, frozen, rng, step, prompts):
      with pt.use_rules(sampler, self.sampler_rules):
        student = nnx.merge(defs.student, params, frozen)
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(rng), step)
        return prepare(student, {}, prompts, step_rng)
    self.sample = jax.jit(sample, out_shardings=NamedSharding(sampler, P()))
    self.place_prompts = backends.global_batch_placer(sampler, self.sampler_rules)
    # 3: the samples copied whole to the trainer's devices, then laid out as the step's batch.
    self.to_trainer = replicated(trainer, rollout)
    self.split_rows = jax.jit(lambda t: t, out_shardings={
        k: backends.batch_sharding(trainer, engine.rules, len(v.shape), v.shape)
        for k, v in rollout.items()})

  def place_batch(self, host_batch):
    return host_batch  # placed in __call__, beside the samples

  def samples(self, state, host_batch) -> dict[str, jax.Array]:
    """The step's samples, laid out for its train step on the trainer's devices."""
    state = self.engine.global_state(state)
    sent = self.gather(state.params, state.frozen[STUDENT], state.rng, state.step)
    keys = PROMPT_KEYS + ((PROMPT_TEACHER,) if PROMPT_TEACHER in host_batch else ())
    prompts = self.place_prompts({k: np.asarray(host_batch[k]) for k in keys})
    rollout = self.sample(*jax.device_put(sent, self.to_sampler), prompts)
    return self.split_rows(jax.device_put(rollout, self.to_trainer))

  def __call__(self, state, host_batch):
    measure = self.every > 0 and self.calls % self.every == 0
    self.calls += 1
    batch = self.inner.place_batch(host_batch)
    if not measure:
      new_state, metrics = self.inner.call(state, {**batch, **self.samples(state, host_batch)})
      return new_state, {**metrics, **self.figures}
    jax.block_until_ready((state, batch))
    start = self.clock()
    rollout = jax.block_until_ready(self.samples(state, host_batch))
    sampled = self.clock()
    new_state, metrics = jax.block_until_ready(self.inner.call(state, {**batch, **rollout}))
    sample_s, step_s = sampled - start, self.clock() - sampled
    tokens = float(np.sum(jax.device_get(rollout[LENGTH_ROWS])))
    self.figures = {"sampled_tokens_per_s": np.float32(tokens / max(sample_s, 1e-9)),
                    "sampling_share": np.float32(sample_s / max(sample_s + step_s, 1e-9))}
    return new_state, {**metrics, **self.figures}

  def runner(self) -> backends.StepRunner:
    return dataclasses.replace(self.inner, call=self, place_batch=self.place_batch)


__all__ = ["SamplerDevices", "SamplerRunner", "rollout_shapes", "split_devices"]
