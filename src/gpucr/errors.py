"""The one exception gpucr raises: its message is a single line that says what is wrong and what to do;
and the one line it says of what went less well than it could but was made good (note)."""
import sys


class GpucrError(Exception):
    """A refusal or failure, safe to show to a user as is."""

    def __init__(self, message: str, *, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def note(line: str) -> None:
    """`gpucr: note: ...` on stderr (the server's log when the server says it)."""
    print(f"gpucr: note: {line}", file=sys.stderr, flush=True)
