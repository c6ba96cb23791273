"""The command line's argument types and the settings' limits: what `gpucr` checks before anything runs, each bad
value refused in one line."""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, NoReturn

from .. import sizes
from ..agent_tables import SETTINGS

from ..errors import GpucrError
from ..server import route
from ..service_http.listen import Loopback, parse_loopback
from ..timeouts import timeout_problem

# The agent's limits for the settings `gpucr run` passes on, from its table (native/agent/settings.def)
GROUP_MAX_BYTES = SETTINGS["GPUCR_GROUP"].hi
STAGING_KINDS = tuple(w for w in SETTINGS["GPUCR_STAGING"].accepted.split("|") if w != "file:DIR")


# Settings of the controller, read from its own environment: checked before anything runs.
CONTROLLER_FLAGS = ("GPUCR_SIMULATE", route.NO_SERVER_ENV)
NO_SERVER_HELP = ("act in-process, not through the gpucr server even when one runs (the same as "
                  f"{route.NO_SERVER_ENV}=1)")
CONTROLLER_SIMULATE_HELP = ("act through simcuda, the simulated driver (test double), on processes started with "
                            "'gpucr run --simulate' (the same as GPUCR_SIMULATE=1)")


JSON_HELP = "print the result as JSON (docs/api.md); an error, too, is printed as a JSON object"


def add_controller_flags(p: argparse.ArgumentParser, json: bool = True) -> None:
    """--json (where asked), --simulate and --no-server: the flags of every command that reaches a process's agent."""
    if json:
        p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument("--simulate", action="store_true", help=CONTROLLER_SIMULATE_HELP)
    p.add_argument("--no-server", action="store_true", help=NO_SERVER_HELP)


class Parser(argparse.ArgumentParser):
    """argparse with gpucr's one-line errors, `gpucr: error: ...` (its default prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"gpucr: error: {message}; see '{self.prog} --help'\n")


def loopback(v: str) -> Loopback:
    """--http: a loopback HOST:PORT (listen.parse_loopback)."""
    try:
        return parse_loopback(v)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def staging_kind(v: str) -> str:
    """--staging: auto, hugetlbfs, shm or file:DIR with DIR an existing directory (made absolute)."""
    if v in STAGING_KINDS:
        return v
    if v.startswith("file:") and len(v) > 5:
        d = os.path.abspath(v[5:])
        if not os.path.isdir(d):
            raise argparse.ArgumentTypeError(f"'{v}': {d} is not a directory")
        return f"file:{d}"
    raise argparse.ArgumentTypeError(f"'{v}' is not one of {', '.join(STAGING_KINDS)} or file:DIR")


# Settings and options of the in-process copy engine, deleted (issue 25): gpucr's data plane copies outside the
# application, which pins nothing and runs no thread of gpucr's but its channel. Said once, then ignored.
RETIRED_ENV = ("GPUCR_BOUNCE_MIB", "GPUCR_BOUNCE_THREADS", "GPUCR_PIN_THREADS", "GPUCR_STAGING_AHEAD",
               "GPUCR_UNPIN_FOR_DRIVER")
RETIRED_WHY = ("gpucr's data plane copies outside the application now (the server's, or the CLI's own), so the "
               "application pins nothing: it has no effect and is ignored")


class Retired(argparse.Action):
    """An option of the deleted in-process copy engine: accepted (scripts keep working), said, ignored."""

    def __init__(self, option_strings: list[str], dest: str, nargs: int | str | None = 0, **kwargs: Any) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=nargs, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"gpucr: {option_string}: {RETIRED_WHY}", file=sys.stderr)


def say_retired_env(env: dict[str, str]) -> None:
    for name in RETIRED_ENV:
        if name in env:
            print(f"gpucr: {name}: {RETIRED_WHY}", file=sys.stderr)


def host_budget(v: str) -> str:
    """--host-budget: the agent's GPUCR_HOST_BUDGET form (gpucr.sizes)."""
    why = sizes.budget_problem(v)
    if why:
        raise argparse.ArgumentTypeError(why)
    return v


def prepare_staging(v: str) -> str:
    """--prepare-staging: auto, 0 (none) or a size as --host-budget takes it."""
    why = sizes.prepare_problem(v)
    if why:
        raise argparse.ArgumentTypeError(why)
    return v


def group_name(v: str) -> str:
    """--group: what the agent keeps whole (it refuses a longer name rather than cut it)."""
    n = len(v.encode())
    if not v or n > GROUP_MAX_BYTES:
        raise argparse.ArgumentTypeError(f"a group name is 1 to {GROUP_MAX_BYTES} bytes, not {n}")
    return v


def image_dir(v: str) -> str:
    """--image DIR: a path, never empty (an empty one was taken as no image: the data went to host memory)."""
    if not v.strip():
        raise argparse.ArgumentTypeError("the image directory is empty: name a directory, or leave out --image")
    return v


def positive_seconds(v: str) -> float:
    try:
        t = float(v)
    except ValueError:
        t = math.nan
    why = timeout_problem(t, f"'{v}'")
    if why:
        raise argparse.ArgumentTypeError(why)
    return t


def check_controller_env(env: dict[str, str]) -> None:
    """The controller's own settings, as strictly as the agent's: 0 or 1, or unset."""
    for name in CONTROLLER_FLAGS:
        if env.get(name, "") not in ("", "0", "1"):
            raise GpucrError(f"{name}={env[name]} is not valid: use 0 or 1 (or leave it unset)")
