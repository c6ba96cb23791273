"""The swap service (issue 27): several applications share a GPU whose memory they together exceed; the
gpucr server parks the ones not needed (their data in host memory) and brings each back when it needs the card.

policy.py   whom to park for room: pure, no I/O
apps.py     what the server knows of each app under `gpucr run --swap`, updated on events
service.py  the server's part: registering apps, parking, watching for demand, resuming, idle parking
"""
