"""Errors a user can cause. The CLI prints their message as one sentence, with no traceback."""


class UserError(Exception):
    """A mistake in input, config or environment that the user can fix; the message says how."""


class ConfigError(UserError):
    """An unknown config key, a value of the wrong type, or an inconsistent combination."""


class DataError(UserError):
    """Missing or malformed data on disk."""


class TrainingDiverged(UserError):
    """The loss became NaN or infinite."""


class Preempted(Exception):
    """A stop signal (SIGUSR1 before a Slurm time limit, SIGTERM) arrived: a checkpoint was saved."""

    exit_code = 3
