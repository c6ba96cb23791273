"""`gpucr bench`: gpucr against the driver's own checkpoint, side by side, on the same workloads.

methods  what is compared (driver, driver-fresh, driver-nop2p, gpucr-full, gpucr-data, the pinned-copy ceiling
         of one link and of every GPU's link at once), on which workloads (single-GPU LLM servers, raw
         buffers, and multi-GPU jobs: tp2-MODEL, pp2-MODEL, 2gpu-MODEL)
run      the command: runs every method on every workload, writes the JSON and the chart
report   renders a results JSON as a Markdown table and a PNG chart
"""
