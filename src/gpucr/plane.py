"""The one interface through which the coordinator reaches the data (../shared/ARCHITECTURE.md: the coordinator
imports nothing of the server or of gpucr.dataplane). The mover (gpucr.dataplane.mover) implements it, run by the
gpucr server ("server") or, with no server, by the requesting command itself ("cli"); each result records which
(`data_plane`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from .memory import Managed
from .switch_schedule import Room


@dataclass
class Stats:
    bytes: int = 0
    zeroed: int = 0               # of those, set to zero on the GPU (zero chunks) rather than copied (fill)
    scanned: int = 0              # bytes the zero scan read on the GPU (copy out; 0 when asked not to scan)
    scan: bool = False            # the copy out scanned its memory on the GPU: zero chunks and digests
    zero_skipped: int = 0         # of those, in chunks all zero: not copied out (staging holds zeros there)
    unchanged_skipped: int = 0    # of those, in chunks not all zero the staging holds already: not copied out
    checked: bool = False         # the fill's new memory was digested and compared with the checkpoint's (fill)
    digests_compared: int = 0     # chunks compared
    scan_s: float = 0.0           # the copy out's waits for its scan (in parts beside the copies: its copies wait here)
    check_s: float = 0.0          # the fill's check after its copies (the rest of it ran under them): its cost
    seconds: float = 0.0
    pin_s: float = 0.0            # pinning staging not pinned here before (the first cycle of a process)
    wait_s: float = 0.0           # waiting for the data plane (another copy, or pinning ahead, holding it)
    allocations: int = 0
    straight_s: float = 0.0       # with routes: until the copies over the process's own GPU's link were done
    route_s: float = 0.0          # ... and until those through the neighbours were (the slower one sets seconds)
    looks_s: float = 0.0          # ... of which asking NVML whether each neighbour is still idle
    # where a copy's seconds went on the server's own thread (what the copy engines did meanwhile is the rest):
    stage_s: float = 0.0          # mapping (and pinning, pin_s) the process's staging here
    make_s: float = 0.0           # importing (out) or making (in) each allocation, and mapping it
    queue_s: float = 0.0          # queueing its copies on the streams
    drain_s: float = 0.0          # waiting, after the last was queued, for the straight copies to finish
    export_s: float = 0.0         # exporting the new memory's fds (in), handed to the process to map
    taken_over: int = 0           # a two-way switch's fill: pieces of the app going out taken as they are, not made
    routes: dict[str, int] = field(default_factory=dict)   # bytes moved through each neighbour GPU, by UUID
    dropped: list[str] = field(default_factory=list)       # neighbours given up mid-copy (a process appeared)

    def skipped(self, n: int, zero: bool) -> None:
        """n bytes a copy out did not copy: the staging held them already, all zero or not."""
        if zero:
            self.zero_skipped += n
        else:
            self.unchanged_skipped += n


Made = tuple[Stats, list[tuple[int, int]]]   # a fill: what it cost, and (allocation index, fd) of each memory made
Inputs = tuple[dict[str, Any], list[int], list[Managed]]   # a process's layout, its staging's fds, its memory


@dataclass
class StagingAsk:
    """Staging an app's agent asks for (its status's staging_plan), with the app's settings it is made by."""
    pid: int
    ledger_dir: Path              # the app's runtime dir: the host budget's ledger is there
    entry: str                    # the app's entry in it (as its agent names it: <pid>-<pid ns>.staging)
    add: list[int]                # the new segments' sizes, in order
    replace: bool = False         # the segments held now are given back first (more than twice what is needed)
    held_memory: int = 0          # bytes of host memory its staging holds now (not file:DIR)
    staging: str = "auto"         # GPUCR_STAGING: auto | hugetlbfs | shm | file:DIR
    host_budget: str = ""         # GPUCR_HOST_BUDGET as the app was started with it ("": none)
    cgroup_root: str = ""         # GPUCR_TEST_CGROUP_ROOT: the test suite's stand-in for "/"


@dataclass
class MadeStaging:
    """The segments made for a StagingAsk, and the app's ledger entry (None: not the budget's, file staging): fds
    for the caller to hand to the agent (`hold`) and then close."""
    fds: list[int]
    entry: int | None
    kind: str
    lent: int = 0   # bytes of them lent from the server's staging pool (made and pinned ahead)
    made: int = 0   # bytes of them made now


class ImageFile(Protocol):
    """An image's data file, which the plane's pinned ring reads a fill from (gpucr.image.ImageSource) or writes a
    copy out to (gpucr.image.ImageSink), with no staging: one file holding each allocation at the offset the move's
    layout names (its one segment, index 0, is the file)."""
    size: int                                    # the file's bytes
    zeros: dict[int, list[tuple[int, int]]]      # a fill's: allocation index -> its zero chunks (offset, bytes), set

    def move(self, slot: int, at: int, n: int) -> None:
        """The chunk of n bytes at offset `at` of the file between it and host memory at `slot` (read and checked
        against its digest, or digested and written); GpucrError when it cannot."""


class DataPlane(Protocol):
    """What the coordinator asks of a data plane. Each call raises GpucrError when it fails, having undone what
    it did (no memory made is left behind, no copy is left running)."""
    plane: str   # "server" | "cli": recorded in every result as data_plane

    def copy_out(self, pid: int, layout: dict[str, Any], seg_fds: list[int], memory: list[Managed],
                 scan: bool = True, image: ImageFile | None = None) -> Stats:
        """Every allocation of `memory` (our fds of it, handed over) copied into the process's staging; `scan`: find its
        zero chunks (not copied) and take its digests on the GPU first, where the plane can (scan=False: neither, so the
        fill of this checkpoint copies every byte and has nothing to check against). With `image`, written to that image's
        file instead (seg_fds then []), its zero chunks found on the host as each is written."""

    def fill(self, pid: int, layout: dict[str, Any], seg_fds: list[int], memory: list[Managed],
             image: ImageFile | None = None, check: bool = True) -> Made:
        """New memory for each allocation of `layout`, filled from staging, or with `image` from that image's file
        (seg_fds then []); zero spans (an image's, or those found at the checkpoint) set by memset; `check`: compare
        its digests with the checkpoint's, where the plane has them."""

    def two_way(self, out_pid: int, out_inputs: Inputs, in_pid: int, in_inputs: Inputs,
                give_back: Callable[[int], None], room: Room, scan: bool = True, check: bool = True) -> tuple[Stats, Made]:
        """A two-way switch on one GPU: copy_out of one process and fill of another at once, each of the first's
        allocations given back as its copy lands (give_back(upto): its agent lets go of those numbered below upto), each
        of the second's made once `room` holds it. GpucrError when either fails (the first's allocations given back
        are then in staging; the second's made memory is let go)."""

    def make_staging(self, ask: StagingAsk) -> MadeStaging:
        """The staging `ask` names, admitted against the one host budget first (a refusal, one line, before anything
        is made), made and faulted in."""

    def forget(self, pid: int) -> None:
        """Let go of what it holds of the process's staging (mappings, pins): the process gave it back."""

    def settle(self) -> None:
        """A request is done: give back what it does not keep between requests."""
