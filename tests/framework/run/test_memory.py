"""The memory check before a compiled step first runs (framework/run/memory.py), on figures
worked by hand: what must still fit once the models are in memory is the temporaries and the
outputs that reuse no argument's buffer, times the devices that share the memory."""

import jax

from distillax.framework.run import memory

GiB = 2.0 ** 30
# Issue 48's Llama 3.1 8B teacher on a 23 GB host: 13 GiB of arguments, 26.8 GiB of temporaries;
# the new state's outputs alias the donated one.
EIGHT_B = {"argument_size_in_bytes": 13 * GiB, "temp_size_in_bytes": 26.8 * GiB,
           "output_size_in_bytes": 13 * GiB, "alias_size_in_bytes": 13 * GiB}


def test_a_step_whose_temporaries_exceed_the_free_memory_is_named_with_its_figures():
  line = memory.shortfall(EIGHT_B, free=10 * GiB, devices=1)
  assert line.startswith("the compiled step needs 26.80 GiB of temporaries per device beside "
                         "its 13.00 GiB of arguments: 26.80 GiB more than the models already "
                         "take, but 10.00 GiB is free; lower train.batch_size"), line
  assert memory.shortfall(EIGHT_B, free=26.8 * GiB, devices=1) is None  # exactly fits


def test_devices_sharing_the_host_add_up_and_unaliased_outputs_count():
  stats = {"argument_size_in_bytes": 2 * GiB, "temp_size_in_bytes": 0.75 * GiB,
           "output_size_in_bytes": 0.5 * GiB, "alias_size_in_bytes": 0.25 * GiB}
  # (0.75 + 0.5 - 0.25) GiB per device x 8 devices = 8 GiB.
  assert memory.shortfall(stats, free=8 * GiB, devices=8) is None
  line = memory.shortfall(stats, free=7.5 * GiB, devices=8)
  assert ("768.00 MiB of temporaries and 256.00 MiB of new outputs per device beside its "
          "2.00 GiB of arguments; 8 devices share this host's memory: 8.00 GiB more than the "
          "models already take, but 7.50 GiB is free") in line, line


def test_the_host_reports_its_free_memory_shared_by_the_simulated_devices():
  free, shared = memory.free_bytes(jax.local_devices()[0])
  with open("/proc/meminfo") as f:
    total = next(float(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
  assert 0 < free <= total
  assert shared == jax.local_device_count() == 8
