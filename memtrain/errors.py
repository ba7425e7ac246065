"""User-facing error types.

Every error a user can cause (a bad recipe, missing data, an incompatible checkpoint) is raised as a
subclass of :class:`MemtrainError`. The command line prints its message on one line and exits with
code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class MemtrainError(Exception):
    """An error caused by the user's input, with a message that names the problem and the fix."""

    exit_code = 2


class DataError(MemtrainError):
    """Missing, empty or malformed training data."""


class CheckpointError(MemtrainError):
    """A checkpoint that cannot be loaded into this run."""


class LaunchError(MemtrainError):
    """An inconsistent process-group environment (launcher variables, world size, devices)."""
