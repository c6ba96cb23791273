"""The one exception gpucr raises: its message is a single line that says what is wrong and what to do."""


class GpucrError(Exception):
    """A refusal or failure, safe to show to a user as is."""

    def __init__(self, message: str, *, code: int = 1) -> None:
        super().__init__(message)
        self.code = code
