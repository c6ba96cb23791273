"""gpucr: transparent GPU checkpoint/restore for CUDA processes.

    import gpucr
    gpucr.checkpoint(pid)          # GPU memory saved and given back, the process parked
    gpucr.restore(pid)             # every byte back at the same address, the process carries on
    gpucr.status(pid)
"""
from .coordinator import checkpoint, ps, restore, status
from .errors import GpucrError
from .paths import agent_lib as lib_path
from .paths import run_env

__all__ = ["checkpoint", "restore", "status", "ps", "GpucrError", "lib_path", "run_env"]
__version__ = "0.1.0"
