"""One process at a time holds a workdir's lock (framework/run/workdir_lock.py), tested with real
processes holding it: a live holder refuses the second with its pid and host; a holder killed
as a crash would is taken over, and so is a dead holder whose forked child still has the file."""

import json
import os
import socket

import pytest

from distillax.errors import UserError
from distillax.framework.run.workdir_lock import LOCK_FILE, WorkdirLock
from tests.support.lock_holder import holding


def _not_writable(workdir, e):
  return UserError(f"{workdir} not writable: {e}")


def _record(workdir):
  with open(os.path.join(workdir, LOCK_FILE)) as f:
    return json.load(f)


def test_a_held_lock_refuses_a_second_process_naming_the_holder(tmp_path):
  with holding(tmp_path) as holder:
    before = (tmp_path / LOCK_FILE).read_bytes()
    with pytest.raises(UserError) as refused:
      WorkdirLock(str(tmp_path)).acquire(_not_writable)
    assert f"pid {holder.pid} on host {socket.gethostname()}" in str(refused.value)
    assert "\n" not in str(refused.value) and "--workdir" in str(refused.value)
    assert (tmp_path / LOCK_FILE).read_bytes() == before
    assert _record(tmp_path) == {"pid": holder.pid, "host": socket.gethostname()}
  lock = WorkdirLock(str(tmp_path))  # released: the next one takes it
  lock.acquire(_not_writable)
  assert _record(tmp_path)["pid"] == os.getpid()
  lock.release()
  assert os.listdir(tmp_path) == []


def test_a_crashed_holders_lock_is_taken_over(tmp_path):
  with holding(tmp_path) as holder:
    holder.kill()
    assert _record(tmp_path)["pid"] == holder.pid  # left behind by the crash
    lock = WorkdirLock(str(tmp_path))
    lock.acquire(_not_writable)
    assert _record(tmp_path) == {"pid": os.getpid(), "host": socket.gethostname()}
    lock.release()


def test_a_dead_holders_forked_child_does_not_keep_the_workdir(tmp_path):
  """The holder died; its child (a data worker, say) still has the locked file open, so flock
  alone refuses: the record's pid, gone on this host, makes it stale."""
  with holding(tmp_path, fork_child=True) as holder:
    os.kill(holder.child, 0)  # the child is alive and holds the old file
    lock = WorkdirLock(str(tmp_path))
    lock.acquire(_not_writable)
    assert _record(tmp_path)["pid"] == os.getpid()
    with pytest.raises(UserError, match=f"pid {os.getpid()} "):  # and it is held by us now
      WorkdirLock(str(tmp_path)).acquire(_not_writable)
    lock.release()


def test_a_lock_on_a_new_workdir_leaves_nothing_when_released_so(tmp_path):
  workdir = tmp_path / "runs" / "new"
  lock = WorkdirLock(str(workdir))
  lock.acquire(_not_writable)
  assert os.listdir(workdir) == [LOCK_FILE]
  lock.release(remove_made=True)
  assert os.listdir(tmp_path) == []
