"""gpucr: transparent GPU checkpoint/restore for CUDA processes.

    import gpucr
    gpucr.checkpoint(pid)          # GPU memory saved and given back, the process parked
    gpucr.restore(pid)             # every byte back at the same address, the process carries on
    gpucr.restore(pid, gpu_map={"GPU-old...": "GPU-new..."})   # onto another GPU (level full)
    gpucr.status(pid)

Each returns a typed result (gpucr.results, documented in docs/api.md); `--json` prints the same.
"""
from .version import __version__

from .server.route import checkpoint, checkpoint_many, ps, restore, restore_many, status   # through `gpucr serve` when it runs
from .errors import GpucrError
from .paths import agent_lib as lib_path
from .paths import run_env
from .results import (SCHEMA_VERSION, CheckpointResult, ProcessCheckpoint, ProcessRestore, ProcessStatus, RecoverResult,
                      RestoreResult, StatusResult, from_json, to_json)

__all__ = ["checkpoint", "checkpoint_many", "restore", "restore_many", "status", "ps", "GpucrError", "lib_path",
           "run_env", "SCHEMA_VERSION", "CheckpointResult", "RestoreResult", "StatusResult", "RecoverResult",
           "ProcessCheckpoint", "ProcessRestore", "ProcessStatus", "from_json", "to_json"]
