"""Errors shared across layers."""


class UserError(Exception):
    """An error caused by the user's input; its message is one sentence (CLI: exit code 2)."""
