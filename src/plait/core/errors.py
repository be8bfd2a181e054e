"""Errors meant for the user: the CLI prints them as one clear message with no traceback."""


class PlaitError(Exception):
    """An error for the user: printed as one clear message, no traceback."""


class ConfigError(PlaitError):
    """A setting or input is invalid; the message names it and a valid value."""


class ArgumentError(ConfigError, TypeError):
    """A Python API argument of the wrong kind (a ConfigError, and a TypeError as Python callers expect); the
    message names the argument and what it takes."""
