"""Checkpoint and restore of one or many processes: gpucr's data plane (gpucr.plane: the server's mover, or the
CLI's own) moves the data, the driver the control state, each agent quiesces, hands over and adopts. Many
processes go through each phase together, like a two-phase commit:

checkpoint: prepare all -> quiesce all (several) -> hand over all -> the plane copies each, beside the driver's
            lock and checkpoint of all -> handed_done all -> commit all (only now do the agents let go of the
            memory: until then an abort maps it again from their fds, with no copy)
restore:    the plane fills each, beside the driver's restore and unlock of all -> adopt each -> data in all
            (finish, relink) -> resume all

A checkpoint is all or nothing: if any process fails at any phase, every process is rolled back to
running with its data intact, and the error names the process and the phase. A restore brings back
every process it can; one that fails stays checkpointed and restorable, and the error names it.

The package's modules, top to bottom: checkpointing, restoring, spill (a checkpoint's data from host memory to
an image), relink, image_steps, through_plane, steps, members."""
from __future__ import annotations

from ..levels import LEVELS   # noqa: F401 (coordinator.LEVELS, as before)
from .checkpointing import checkpoint_many
from .members import PhaseError
from .restoring import restore_many
from .spill import write_image_of_checkpointed
from .switching import NotTwoWay, switch


__all__ = ["LEVELS", "NotTwoWay", "PhaseError", "checkpoint_many", "restore_many", "switch", "write_image_of_checkpointed"]
