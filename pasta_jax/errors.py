"""User-facing errors. Each names the problem in one line; the CLI prints it and exits nonzero."""


class PastaError(Exception):
  """Base class for errors a user can fix (bad input, missing file, wrong config)."""


class ConfigError(PastaError):
  """A configuration that cannot work (unknown architecture, shape mismatch, bad mesh)."""


class WeightsError(PastaError):
  """Missing, corrupt or mismatched weight files."""


class TagError(PastaError):
  """Malformed PASTA-LANG text or tokens; the message names the place."""
