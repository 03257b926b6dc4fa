"""Metric logging (one step late, windowed), writers read back independently, throughput."""

import glob
import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from distillax.errors import UserError
from distillax.framework.run import metrics
from distillax.framework.run import writers
from distillax.framework.throughput import Throughput
from distillax.partitioning.mesh import create_mesh
from tests.framework import event_reader


class MemoryWriter:
  def __init__(self):
    self.rows, self.flushed, self.closed = [], 0, False

  def write_scalars(self, step, scalars):
    self.rows.append((step, dict(scalars)))

  def flush(self):
    self.flushed += 1

  def close(self):
    self.closed = True


class FakeClock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _step_fn():
  """A jitted 'train step' over a batch sharded on 8 devices; metrics come out replicated."""
  mesh = create_mesh({"data": 8, "model": 1})
  batch_sharding = NamedSharding(mesh, PartitionSpec("data"))

  @jax.jit
  def step(x_B, lr):
    return {"loss": jnp.mean(x_B ** 2), "grad_norm": jnp.max(jnp.abs(x_B)), "learning_rate": lr}

  def run(x_B, lr):
    return step(jax.device_put(x_B, batch_sharding), jnp.float32(lr))
  return run


def test_rows_are_fetched_one_step_late_and_match_numpy():
  rng = np.random.default_rng(0)
  batches = [rng.standard_normal(16).astype(np.float32) for _ in range(4)]
  step = _step_fn()
  writer = MemoryWriter()
  logger = metrics.MetricLogger(writer)
  for i, x in enumerate(batches, start=1):
    written = logger.record(i, step(x, 0.1 * i))
    # Step i's values reach the host only when step i+1 arrives.
    assert [s for s, _ in writer.rows] == list(range(1, i))
    if i > 1:
      assert written == writer.rows[-1][1]
  logger.flush()
  assert [s for s, _ in writer.rows] == [1, 2, 3, 4]
  for (row_step, row), x in zip(writer.rows, batches):
    assert row["loss"] == pytest.approx(np.mean(x.astype(np.float64) ** 2), rel=1e-6)
    assert row["grad_norm"] == pytest.approx(np.max(np.abs(x)), rel=1e-6)
    assert row["learning_rate"] == pytest.approx(0.1 * row_step, rel=1e-6)
  assert logger.latest == writer.rows[-1][1]


def test_window_means_and_last_values_and_partial_close():
  rng = np.random.default_rng(1)
  batches = [rng.standard_normal(8).astype(np.float32) for _ in range(7)]
  step = _step_fn()
  writer = MemoryWriter()
  logger = metrics.MetricLogger(writer, log_every=3)
  for i, x in enumerate(batches, start=1):
    logger.record(i, step(x, 0.01 * i))
  logger.close()
  assert writer.closed
  assert [s for s, _ in writer.rows] == [3, 6, 7]
  windows = [batches[0:3], batches[3:6], batches[6:7]]
  for (row_step, row), window in zip(writer.rows, windows):
    losses = [np.mean(x.astype(np.float64) ** 2) for x in window]
    norms = [np.max(np.abs(x)) for x in window]
    assert row["loss"] == pytest.approx(np.mean(losses), rel=1e-6)
    assert row["grad_norm"] == pytest.approx(np.mean(norms), rel=1e-6)
    assert row["learning_rate"] == pytest.approx(0.01 * row_step, rel=1e-6)  # last, not mean


def _logged(batches, step, log_every, stop_after=None):
  """Rows of a logger fed `batches`; with `stop_after`, the first logger stops there (no partial
  row) and a second one continues from its window, carried as JSON text like a checkpoint's."""
  writer = MemoryWriter()
  logger = metrics.MetricLogger(writer, log_every=log_every)
  for i, x in enumerate(batches, start=1):
    logger.record(i, step(x, 0.01 * i))
    if i == stop_after:
      logger.flush()
      carried = json.dumps(logger.window_state(), allow_nan=False)
      logger.close(log_partial=False)
      logger = metrics.MetricLogger(writer, log_every=log_every)
      logger.restore_window(json.loads(carried))
  logger.close()
  return writer.rows


@pytest.mark.parametrize("stop_after", [1, 4, 5, 6])
def test_a_window_carried_across_a_stop_gives_the_uninterrupted_rows(stop_after):
  # Values whose float32 sum depends on the order and rounding of every addition.
  rng = np.random.default_rng(2)
  batches = [(rng.standard_normal(8) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
             for _ in range(8)]
  step = _step_fn()
  uninterrupted = _logged(batches, step, 3)
  assert [s for s, _ in uninterrupted] == [3, 6, 8]
  assert _logged(batches, step, 3, stop_after=stop_after) == uninterrupted  # exact floats
  # The carried row is the mean over the whole window, not only the steps after the stop.
  losses = [np.mean(x.astype(np.float64) ** 2) for x in batches[3:6]]
  assert uninterrupted[1][1]["loss"] == pytest.approx(np.mean(losses), rel=1e-6)


def test_a_carried_window_is_strict_json_also_when_not_finite():
  step = _step_fn()
  logger = metrics.MetricLogger(MemoryWriter(), log_every=3)
  logger.record(1, step(np.full(8, np.inf, np.float32), 0.1))
  carried = json.loads(json.dumps(logger.window_state(), allow_nan=False))
  other = metrics.MetricLogger(MemoryWriter(), log_every=3)
  other.restore_window(carried)
  row = other.close()
  assert np.isinf(row["loss"]) and row["learning_rate"] == pytest.approx(0.1)


def test_an_empty_or_other_log_every_window_is_not_carried():
  step = _step_fn()
  logger = metrics.MetricLogger(MemoryWriter(), log_every=2)
  logger.record(1, step(np.ones(8, np.float32), 0.1))
  logger.record(2, step(np.ones(8, np.float32), 0.1))
  assert logger.window_state() is None  # the window closed at step 2
  logger.record(3, step(np.ones(8, np.float32), 0.1))
  carried = logger.window_state()
  assert carried["num_steps"] == 1 and carried["last_step"] == 3
  writer = MemoryWriter()
  other = metrics.MetricLogger(writer, log_every=5)  # another window length: start afresh
  other.restore_window(carried)
  other.close()
  assert writer.rows == []


def test_throughput_is_timed_between_fetches():
  clock = FakeClock()
  writer = MemoryWriter()
  tp = Throughput(tokens_per_step=512, model_flops_per_step=4e9, num_devices=8,
                  peak_flops_per_device=1e9)
  logger = metrics.MetricLogger(writer, log_every=2, throughput=tp, clock=clock)
  loss = {"loss": jnp.float32(1.0)}
  for i in range(1, 7):
    clock.now = 10.0 + 0.5 * i     # steps 2, 4, 6 are fetched at records 3, 5 and at flush
    logger.record(i, loss)
  clock.now = 14.0
  logger.flush()
  first, second, third = (row for _, row in writer.rows)
  assert "step_time_s" not in first  # the first window holds compilation: not timed
  # step 2 fetched at t=11.5, step 4 at t=12.5: 2 steps in 1 s.
  assert second["step_time_s"] == pytest.approx(0.5)
  assert second["tokens_per_s"] == pytest.approx(1024.0)
  assert second["tflops_per_device"] == pytest.approx(4e9 / 0.5 / 8 / 1e12)
  assert second["mfu"] == pytest.approx(4e9 / 0.5 / 8 / 1e9)
  assert third["step_time_s"] == pytest.approx((14.0 - 12.5) / 2)


def test_a_paused_eval_between_log_steps_is_kept_out_of_step_time():
  clock = FakeClock()
  writer = MemoryWriter()
  logger = metrics.MetricLogger(writer, throughput=Throughput(10, 1e9, 1), clock=clock)
  for i in (1, 2):
    clock.now = float(i)
    logger.record(i, {"loss": jnp.float32(i)})
  clock.now = 3.0
  logger.pause()                      # eval after step 2; step 2 fetched inside the pause
  logger.flush()
  clock.now = 100.0                   # a long eval
  logger.write(2, {"eval_loss": 0.5})
  logger.resume()
  clock.now = 101.0
  logger.record(3, {"loss": jnp.float32(3.0)})
  clock.now = 102.0
  logger.flush()
  assert [(s, sorted(r)) for s, r in writer.rows][:3] == [
      (1, ["loss"]), (2, ["loss", "step_time_s", "tflops_per_device", "tokens_per_s"]),
      (2, ["eval_loss"])]
  assert writer.rows[1][1]["step_time_s"] == pytest.approx(1.0)  # 2 -> 3
  assert writer.rows[3][0] == 3
  assert writer.rows[3][1]["step_time_s"] == pytest.approx(2.0)  # 100 -> 102, not 3 -> 102


def test_an_eval_inside_a_logging_window_is_not_step_time():
  """lm.py:tiny logs every 2 steps and evaluates and checkpoints at step 3: the row of step 4
  used to count that work (0.75 s a step against 0.008 at step 6)."""
  clock = FakeClock()
  writer = MemoryWriter()
  logger = metrics.MetricLogger(writer, log_every=2, throughput=Throughput(10, 1e9, 1),
                                clock=clock)
  for i in (1, 2, 3):                 # each step takes 1 s; step 2 fetched at record(3), t=3
    clock.now = float(i)
    logger.record(i, {"loss": jnp.float32(i)})
  clock.now = 4.0                     # step 3 done: eval and checkpoint at step 3 (its window
  logger.pause()                      # still open) from t=4 to t=50
  clock.now = 50.0
  logger.write(3, {"eval_loss": 0.5})
  logger.resume()
  clock.now = 51.0                    # step 4 ran from 50 to 51; fetched at record(5)
  logger.record(4, {"loss": jnp.float32(4.0)})
  logger.record(5, {"loss": jnp.float32(5.0)})
  rows = {(s, "eval_loss" in r): r for s, r in writer.rows}
  # Steps 3 and 4 ran 1 s each: (51 - 3 - 46) / 2, not (51 - 3) / 2 = 24.
  assert rows[(4, False)]["step_time_s"] == pytest.approx(1.0)


def test_a_rollback_moves_the_abandoned_rows_aside_and_the_next_row_is_not_timed(tmp_path):
  clock = FakeClock()
  writer = writers.create_writers(str(tmp_path), is_primary=True, console=False)
  logger = metrics.MetricLogger(writer, throughput=Throughput(10, 1e9, 1), clock=clock)
  for i in range(1, 6):
    clock.now = float(i)
    logger.record(i, {"loss": jnp.float32(i)})
  logger.flush()
  logger.write(5, {"eval_loss": 9.0})
  logger.rolled_back(5, 3, {"rollbacks": 1, "learning_rate_scale": 0.5})
  for i in (4, 5, 6):
    clock.now = 100.0 + i
    logger.record(i, {"loss": jnp.float32(10 * i)})
  logger.close()
  rows = writers.read_jsonl(str(tmp_path / "metrics.jsonl"))
  # One history (issue 48): steps 1-3, the rollback's own row, then 4-6 again.
  assert [(r["step"], r.get("loss"), r.get("rolled_back")) for r in rows] == [
      (1, 1.0, None), (2, 2.0, None), (3, 3.0, None), (5, None, None), (4, 40.0, None),
      (5, 50.0, None), (6, 60.0, None)]
  assert {k: rows[3][k] for k in ("rolled_back_to", "rollbacks", "learning_rate_scale")} == {
      "rolled_back_to": 3, "rollbacks": 1, "learning_rate_scale": 0.5}
  # The abandoned rows (steps 4 and 5, and step 5's eval) are kept aside, marked.
  aside = writers.read_jsonl(str(tmp_path / "metrics.rolled_back.jsonl"))
  assert [(r["step"], r.get("loss"), r.get("eval_loss"), r["rolled_back"]) for r in aside] == [
      (4, 4.0, None, True), (5, 5.0, None, True), (5, None, 9.0, True)]
  # Step 4 again: its interval holds the abandoned steps, so it gets no step time; 5 and 6 do.
  assert "step_time_s" not in rows[4]
  assert rows[5]["step_time_s"] == pytest.approx(1.0)
  # A later resume at step 4 drops the rows after it but keeps the rollback's history.
  writers.create_writers(str(tmp_path), is_primary=True, console=False, resume_step=4).close()
  kept = writers.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert kept == rows[:5]


def test_metric_validation():
  logger = metrics.MetricLogger(MemoryWriter(), log_every=2)
  with pytest.raises(ValueError, match="scalars"):
    logger.record(1, {"loss": jnp.ones(3)})
  logger.record(1, {"loss": jnp.float32(1)})
  with pytest.raises(ValueError, match="names changed"):
    logger.record(2, {"loss": jnp.float32(1), "other": jnp.float32(2)})


def test_files_on_disk_read_back_independently(tmp_path):
  lines = []
  out = writers.create_writers(str(tmp_path), is_primary=True, printer=lines.append)
  logger = metrics.MetricLogger(out)
  values = [(1, 3.25, 1e-4), (2, 2.5, 2e-4), (3, 1.875, 3e-4)]
  for step, loss, lr in values:
    logger.record(step, {"loss": jnp.float32(loss), "learning_rate": jnp.float32(lr)})
  logger.close()

  with open(tmp_path / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [1, 2, 3]
  for row, (_, loss, lr) in zip(rows, values):
    assert row["loss"] == pytest.approx(loss) and row["learning_rate"] == pytest.approx(lr, rel=1e-6)

  scalars = event_reader.read_scalars(str(tmp_path / "tensorboard"))
  assert [s for s, _ in scalars["loss"]] == [1, 2, 3]
  np.testing.assert_allclose([v for _, v in scalars["loss"]], [v[1] for v in values], rtol=1e-6)
  np.testing.assert_allclose([v for _, v in scalars["learning_rate"]], [v[2] for v in values],
                             rtol=1e-6)

  assert len(lines) == 3 and lines[0].startswith("step 1 | ") and "loss 3.25" in lines[0]
  assert "learning_rate 1.000e-04" in lines[0]


def test_non_primary_process_writes_nothing(tmp_path):
  out = writers.create_writers(str(tmp_path), is_primary=False)
  out.write_scalars(1, {"loss": 1.0})
  out.close()
  assert os.listdir(tmp_path) == []


def test_resume_drops_rows_after_the_checkpoint_in_both_files(tmp_path):
  first = writers.create_writers(str(tmp_path), is_primary=True, console=False)
  for step in range(1, 6):
    first.write_scalars(step, {"loss": float(step)})
  first.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "lo')  # torn by a kill mid-write

  resumed = writers.create_writers(str(tmp_path), is_primary=True, console=False, resume_step=3)
  for step in (4, 5):
    resumed.write_scalars(step, {"loss": 10.0 * step})
  resumed.close()

  rows = writers.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0),
                                                    (5, 50.0)]
  tb = event_reader.read_scalars(str(tmp_path / "tensorboard"))
  assert tb["loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
  assert len(glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))) == 2


def test_jsonl_reopen_without_resume_only_removes_a_torn_line(tmp_path):
  path = str(tmp_path / "m.jsonl")
  with open(path, "w") as f:
    f.write('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
  w = writers.JsonlWriter(path)
  w.write_scalars(2, {"loss": 2.0})
  w.close()
  assert writers.read_jsonl(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]


def test_event_reader_rejects_a_corrupted_record(tmp_path):
  w = writers.TensorBoardWriter(str(tmp_path))
  w.write_scalars(1, {"loss": 1.0})
  w.close()
  (path,) = glob.glob(str(tmp_path / "events.out.tfevents.*"))
  data = bytearray(open(path, "rb").read())
  data[-6] ^= 0xFF  # inside the last record's payload
  open(path, "wb").write(bytes(data))
  with pytest.raises(UserError, match="corrupt"):
    event_reader.read_scalars(str(tmp_path))


_TWO_PROCESS_WORKER = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    pid, port, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=300)
    import jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from distillax.framework import evaluation
    from distillax.framework.run import metrics, writers
    mesh = jax.make_mesh((8, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    step = jax.jit(lambda x: {"loss": jnp.mean(x)})
    logger = metrics.MetricLogger(writers.create_writers(workdir, console=False), log_every=2)
    total = 0.0
    for i in range(1, 5):
      local = np.full((4,), 10.0 * i + pid, np.float32)  # this process's half of the batch
      x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
      out = step(x)
      assert not out["loss"].is_fully_addressable
      logger.record(i, out)
      total += metrics.to_host_scalar(jnp.sum(x))  # a global sum, read on either process
    values = evaluation.loss_and_perplexity(total, 32)
    logger.write(4, {f"eval_{k}": v for k, v in values.items()})
    logger.close()
    jax.distributed.shutdown()
""")


def test_two_processes_fetch_global_metrics_and_only_process_0_writes(tmp_path):
  script = tmp_path / "worker.py"
  script.write_text(_TWO_PROCESS_WORKER)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  workdirs = [tmp_path / f"p{i}" for i in range(2)]
  procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port), str(workdirs[i])],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for i in range(2)]
  try:
    outputs = [p.communicate(timeout=600)[0].decode() for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [0, 0], outputs
  assert not workdirs[1].exists()  # process 1 wrote nothing
  rows = writers.read_jsonl(str(workdirs[0] / "metrics.jsonl"))
  # Global batch = 4 values 10*i (process 0) and 4 values 10*i + 1 (process 1).
  step_means = [10.0 * i + 0.5 for i in range(1, 5)]
  assert rows[0] == {"step": 2, "loss": pytest.approx(np.mean(step_means[:2]))}
  assert rows[1] == {"step": 4, "loss": pytest.approx(np.mean(step_means[2:]))}
  assert rows[2]["step"] == 4 and rows[2]["eval_loss"] == pytest.approx(np.mean(step_means))
  assert rows[2]["eval_tokens"] == 32
  assert event_reader.read_scalars(str(workdirs[0] / "tensorboard"))["loss"] == [
      (2, pytest.approx(np.mean(step_means[:2]))), (4, pytest.approx(np.mean(step_means[2:])))]
