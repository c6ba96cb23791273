"""`gpucr bench`: gpucr against the driver's own checkpoint, side by side, on the same workloads.

methods  what is compared (driver, driver-fresh, gpucr-full, gpucr-data, the pinned-copy ceiling)
run      the command: runs every method on every workload, writes the JSON and the chart
report   renders a results JSON as a Markdown table and a PNG chart
"""
