"""tests/support/schedule.py: the order xdist's workers get the suite's files in."""

from types import SimpleNamespace

from tests.support import schedule


def test_heavy_files_come_first_then_the_rest_by_test_count_each_file_whole():
  heavy_a, heavy_b = schedule.HEAVY_FILES[1], schedule.HEAVY_FILES[0]
  ids = ["tests/x.py::a", f"{heavy_a}::t1", "tests/y.py::a", "tests/y.py::b", f"{heavy_b}::t",
         f"{heavy_a}::t2", "tests/x.py::b", "tests/y.py::c", "tests/z.py::only"]
  items = [SimpleNamespace(nodeid=i) for i in ids]
  schedule.heaviest_first(items)
  assert [i.nodeid for i in items] == [
      f"{heavy_b}::t", f"{heavy_a}::t1", f"{heavy_a}::t2",  # HEAVY_FILES' order
      "tests/y.py::a", "tests/y.py::b", "tests/y.py::c",  # 3 tests
      "tests/x.py::a", "tests/x.py::b",  # 2 tests, in their own order
      "tests/z.py::only"]
