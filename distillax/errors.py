"""Errors a user can cause. The CLI prints these in one line and exits with status 2."""


class UserError(ValueError):
  """A mistake in the user's input: config, paths, shapes, rules. The message names the fix."""


class ConfigError(UserError):
  """A config value is missing, of the wrong type, or inconsistent with the machine."""


class PartitioningError(UserError):
  """A logical axis rule cannot place an array on the mesh."""
