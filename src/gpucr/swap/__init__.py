"""The swap service (issue 27): several applications share a GPU whose memory they together exceed; the
gpucr server parks the ones not needed (their data in host memory) and brings each back when it needs the card.

policy.py   whom to park for room, and when waiting for a --min-resident would do: pure, no I/O
budget.py   which parked apps go to disk so that one more park fits the host budget: pure, no I/O
placement.py  where an app allowed on any GPU comes back: pure, no I/O
disk.py     the host budget's count, the park dir, and the moves of parked apps to disk and back
apps.py     what the server knows of each app under `gpucr run --swap`, updated on events
queue.py    room requests on one GPU, one at a time, in priority order
room.py     room for one app: its turn, the policy, waiting, parking; what is needed counts the server's context
gpu_view.py the GPUs through the server's driver: memory now, a process's count, the server's context measured
limits.py   the per-app rate limit on room and resume requests
service.py  the server's part: registering apps, parking, watching for demand, resuming, idle parking
"""
