"""A request's --timeout, the range it may take (its one home; the CLI checks it as it parses without importing the
coordinator, so a request sent to the gpucr server does not pay for the coordinator's imports)."""
import math

TIMEOUT_RANGE_S = (0.001, 2_000_000.0)   # the agent counts a step's deadline in milliseconds, in a C int


def timeout_problem(timeout: float, said: str = "") -> str:
    """Why `timeout` (seconds; `said`: as the user wrote it) cannot be a request's, or '': checked before anything
    is touched, where the agent used to refuse 0.0001 or 1e9 only once the process was gated."""
    lo, hi = TIMEOUT_RANGE_S
    if math.isfinite(timeout) and lo <= timeout <= hi:
        return ""
    return f"the timeout must be a number of seconds from {lo:g} to {hi:,.0f}, not {said or repr(timeout)}"
