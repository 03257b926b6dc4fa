"""The command line's tables agree with each other: every command has a job and every flag a
command reads is described; `--help` says which export format is legacy."""

from distillax.cli.dispatch import JOBS
from distillax.cli.flags import COMMAND_FLAGS, COMMANDS, FLAGS, PATH_FLAGS
from distillax.main import main


def test_every_command_has_a_job_and_every_flag_it_reads_is_described():
  assert sorted(JOBS) == sorted(COMMANDS) == sorted(COMMAND_FLAGS)
  read = {f for flags in COMMAND_FLAGS.values() for f in flags} | {"verbose"}
  assert sorted(read) == sorted(FLAGS)
  assert set(PATH_FLAGS) <= set(FLAGS)


def test_help_marks_the_quantized_format_legacy(capsys):
  assert main(["distillax", "export", "--help"]) == 0
  out = capsys.readouterr().out
  format_line = next(line for line in out.splitlines() if line.strip().startswith("--format"))
  assert "hf" in format_line and "gguf" in format_line and "quantized (legacy" in format_line
  assert main(["distillax", "--help"]) == 0
  export_line = next(line for line in capsys.readouterr().out.splitlines()
                     if line.strip().startswith("export "))
  assert "legacy quantized format" in export_line
