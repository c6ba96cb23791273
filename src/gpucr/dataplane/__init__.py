"""The one data plane: the mover that copies a process's GPU memory into its staging and back, at the
link's speed, while the driver takes the control state. The gpucr server runs one; with no server, the
CLI process runs the same (docs/server.md). Imports nothing above driver.py, agent.py and errors.py."""
