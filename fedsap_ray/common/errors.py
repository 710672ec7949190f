"""The exception types more than one layer raises or catches.

They live here, below every other module, so that catching an error never means importing
the layer that raises it (the CLI catches data and config errors without loading torch;
algorithms raise :class:`ConfigError` without importing the config module). Each is still
importable from the module it used to live in.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """Bad user input; the message is one line naming field, value and what is allowed."""


class DatasetUnavailable(FileNotFoundError):
    """Files are missing and downloads are off; the message names the path and how to get the data."""


class DatasetUnreadable(DatasetUnavailable):
    """A data file is there but cannot be read (truncated, damaged); the message names it and
    says to fetch it again. Bad input like a missing file: the run stops before any work."""


class ClientError(RuntimeError):
    """A client failed; the message names the round and client id."""


class CheckpointUnreadable(ValueError):
    """A checkpoint file exists but cannot be read back (truncated, damaged, another format)."""


class RunStopped(Exception):
    """Raised by a progress callback to end a run early on purpose (e.g. a Tune scheduler
    stopping a weak trial): the run is closed with status ``stopped``, not ``failed``."""
