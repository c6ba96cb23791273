"""The one data plane: the mover that copies a process's GPU memory into its staging and back, at the
link's speed, while the driver takes the control state. The gpucr server runs one; with no server, the
CLI process runs the same (docs/server.md). It implements gpucr.plane.DataPlane, the one interface the
coordinator reaches the data through, and imports nothing above driver.py, agent.py, memory.py and plane.py.

Who owns staging (decided in issue 25; ../shared/ARCHITECTURE.md, "Staging: one owner"): each app's
agent *holds* its staging files, so a parked app's data outlives any server; the plane *makes, fills,
pins and maps* them, and keeps the one host-memory budget (the server; with no server, the CLI's mover
under a lock file in the runtime dir). The server lends prepared, pinned segments to apps out of a per-user
pool in that budget (`gpucr serve --prepare-staging`, staging_pool.py: the first park as fast as the others);
staging kept from cycle to cycle is the same segments and the first reclaimed after the pool, a parked app's never. The making is staging_make.py's (admitted by budget.py, before
anything is made); the agent plans what it lacks, by the first-fit rule it places allocations with, and holds
what the plane hands it (`hold`).
"""
