"""The one error type users see: what went wrong, and what to do about it."""


class SpecDeployError(Exception):
    """A user-facing error. `hint` says how to fix it; the CLI prints both and exits 2."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text}\n  hint: {self.hint}" if self.hint else text
