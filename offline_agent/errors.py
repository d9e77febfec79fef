"""The one exception type that reaches the user as a one-line message instead of a traceback."""


class UserError(Exception):
    """Bad input from the user (a file, a flag, a config value): the message says what, where, and what to do."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none): how a library's multi-line
    error is quoted inside a UserError's one line."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
