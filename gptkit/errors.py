"""The one exception type that means "the user asked for something wrong"."""


class GptkitError(Exception):
    """A problem with the user's input; the CLI prints its message on one line and exits 2."""


class ConfigError(GptkitError, ValueError):
    """An invalid configuration value; the message names the field."""


class InputError(GptkitError, ValueError):
    """Input the model or a command cannot take (token ids out of range, a too-long sequence, ...)."""


class WriteError(GptkitError):
    """A write the storage refused (a full disk, a read-only or unwritable place, an I/O error, a file too large);
    the message names the path and what was kept."""


class StepAbandoned(GptkitError):
    """A training step that cannot finish: user code it ran failed (a reward function), or a SIGINT or SIGTERM came
    while it waited on that code (interrupted). The trainer saves the run as of the step before and stops."""

    def __init__(self, message: str, interrupted: bool = False) -> None:
        super().__init__(message)
        self.interrupted = interrupted
