"""What a checkpoint saves (its one home; the CLI reads it without importing the coordinator, so a
request sent to the gpucr server does not pay for the coordinator's imports).

full: data and the driver's control state (GPU memory falls to the driver's floor)
data: data only, the CUDA context stays
"""
LEVELS = ("full", "data")
