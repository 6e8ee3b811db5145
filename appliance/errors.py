"""The one error type the command line turns into a one-line message with a fix."""
from __future__ import annotations


class ApplianceError(Exception):
    """A problem the user can fix: ``message`` says what is wrong, ``hint`` what to do about it."""

    def __init__(self, message: str, hint: str | None = None, exit_code: int = 1):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message
