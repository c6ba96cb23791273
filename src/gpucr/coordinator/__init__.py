"""Checkpoint and restore of one or many processes: the gpucr server's data plane (a mover, when the
request runs in the server) or each agent moves the data, the driver the control state. Many processes go
through each phase together, like a two-phase commit:

checkpoint: prepare all -> data out all -> driver lock all -> driver checkpoint all -> commit all
  through the server: prepare all -> quiesce all -> hand over all -> the server copies each, beside the
              driver's lock and checkpoint of all -> handed_done all -> commit all
restore:    driver restore all -> driver unlock all -> data in all -> resume all
  through the server: the server fills each, beside the driver's restore and unlock of all -> adopt each
              -> data in all (relink) -> resume all

A checkpoint is all or nothing: if any process fails at any phase, every process is rolled back to
running with its data intact, and the error names the process and the phase. A restore brings back
every process it can; one that fails stays checkpointed and restorable, and the error names it.

The package's modules, top to bottom: checkpointing, restoring, relink, image_steps, through_plane, steps, members."""
from __future__ import annotations

from ..levels import LEVELS   # noqa: F401 (coordinator.LEVELS, as before)
from .checkpointing import checkpoint, checkpoint_many
from .members import PhaseError
from .restoring import restore, restore_many


__all__ = ["LEVELS", "PhaseError", "checkpoint", "checkpoint_many", "restore", "restore_many"]
