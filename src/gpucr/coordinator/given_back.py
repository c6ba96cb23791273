"""Memory given back before its checkpoint was committed (a two-way switch frees each of A's allocations as soon as
its copy lands in staging), made again and filled from staging, with a copy: the one roll-back that is not the
agent's own (its fds kept everything else on the GPU). Run by the switch that failed, or by whoever restores the
process after its controller died (`gpucr restore`, the swap service's resume)."""
from __future__ import annotations

import os

from .. import memory as server_memory
from ..plane import DataPlane
from .members import ADOPT_BATCH, _Member


def refill_given(m: _Member, mover: DataPlane, timeout: float) -> int:
    """Each allocation of m in state `given` made anew by the plane, filled from its place in m's staging, and
    adopted by its agent (which then takes the rest back from its own fds: abort). Returns the bytes put back; 0
    when nothing was given back. GpucrError when it cannot (the process stays handed over, gate closed, its data
    in staging: restorable again)."""
    memory = server_memory.gather(m.agent, timeout)
    try:
        given = {e.index for e in memory if e.state == "given"}
        if not given:
            return 0
        layout, seg_fds = m.agent.call_with_fds("layout", timeout=60.0)
        try:
            part = {**layout, "allocations": [a for a in layout["allocations"] if int(a["index"]) in given]}
            _st, fds = mover.fill(m.pid, part, seg_fds, memory, check=False)
            try:
                for k in range(0, len(fds), ADOPT_BATCH):
                    batch = fds[k:k + ADOPT_BATCH]
                    m.agent.call_sending_fds("adopt", [fd for _, fd in batch], timeout=60.0, **{"from": batch[0][0]})
            finally:
                for _i, fd in fds:
                    os.close(fd)
        finally:
            for fd in seg_fds:
                os.close(fd)
        return sum(e.bytes for e in memory if e.index in given)
    finally:
        server_memory.close_all(memory)
