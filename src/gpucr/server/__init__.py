"""`gpucr serve`: a per-user server that acts as the controller, so a checkpoint or restore asked by the
CLI or the Python API does not pay for a fresh interpreter, imports and cuInit each time.

memory.py  the GPU memory a process hands over as fds (docs/server.md)
mover.py   the data plane: copies between that memory and the process's staging, on the server's contexts
links.py   which idle NVLink neighbours of a process's GPU may lend their host link to those copies
lanes.py   the copies through those neighbours: a lane each, paced by a thread, given up when one gets busy
wire.py    where its socket lives, how a request and its answer travel, who may connect
daemon.py  the server itself: accepts, checks the peer, runs the coordinator for it
client.py  finding, starting, stopping and asking a server
route.py   the API the CLI and `import gpucr` use: through the server when one runs, else in-process
"""
