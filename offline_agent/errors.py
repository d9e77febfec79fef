"""The one exception type that reaches the user as a one-line message instead of a traceback."""


class UserError(Exception):
    """Bad input from the user (a file, a flag, a config value): the message says what, where, and what to do."""
