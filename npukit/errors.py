"""The one exception type for user mistakes: the CLI prints its message without a traceback."""


class UserError(Exception):
    """Bad input from the user (a file, option, op or line at fault), reported as a clean message."""
