"""/metrics: the swap view (the server's `swap_view`) in Prometheus's text format, made at each scrape from what the
server holds, so a scrape asks no agent anything. Names follow Prometheus's conventions: the `gpucr_` prefix, units
in the names (bytes, seconds), `_total` for counters (docs/api.md lists them). Apps are labelled by name and GPU (their
GPUs' UUIDs, comma-separated, "" before they use CUDA), never by pid; an app that ended has no series any more, since
each scrape is made from the apps registered now."""
from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ..swap.apps import STATES
from ..swap.stats import DIRECTIONS, REFUSALS, SWITCH_BUCKETS_S

CONTENT_TYPE = CONTENT_TYPE_LATEST
APP = ["app", "gpu"]


def _gpu_label(app: dict[str, Any]) -> str:
    return ",".join(app["gpus"])


def app_families(apps: list[dict[str, Any]]) -> Iterator[Metric]:
    state = GaugeMetricFamily("gpucr_app_state", "1 for the swap app's state now, 0 for the others", labels=APP + ["state"])
    prio = GaugeMetricFamily("gpucr_app_priority", "the swap app's priority (lower is parked first)", labels=APP)
    gpu = GaugeMetricFamily("gpucr_app_gpu_memory_bytes", "GPU memory the app holds now, on this GPU", labels=APP)
    peak = GaugeMetricFamily("gpucr_app_gpu_memory_peak_bytes", "the most GPU memory the app held, on this GPU", labels=APP)
    host = GaugeMetricFamily("gpucr_app_host_memory_bytes", "the app's data parked in host memory", labels=APP)
    disk = GaugeMetricFamily("gpucr_app_disk_bytes", "the app's data parked on disk, as an image", labels=APP)
    idle = GaugeMetricFamily("gpucr_app_idle_seconds", "time since the app last submitted work to the GPU", labels=APP)
    switches = CounterMetricFamily("gpucr_app_switches", "parks and resumes of the app", labels=APP + ["direction"])
    seconds = HistogramMetricFamily("gpucr_app_switch_seconds", "each park's and resume's time",
                                    labels=APP + ["direction"])
    moved = CounterMetricFamily("gpucr_app_moved_bytes", "bytes its parks and resumes moved", labels=APP + ["direction"])
    skipped = CounterMetricFamily("gpucr_app_skipped_bytes", "of the bytes moved, zero chunks not copied over the link",
                                  labels=APP + ["direction"])
    rate = GaugeMetricFamily("gpucr_app_last_switch_bytes_per_second", "the last park's or resume's bytes moved "
                             "over its time", labels=APP + ["direction"])
    refusals = CounterMetricFamily("gpucr_app_refusals", "parks and room requests that did not happen, by reason",
                                   labels=APP + ["reason"])
    for a in apps:
        labels = [a["name"], _gpu_label(a)]
        for s in STATES:
            state.add_metric(labels + [s], 1.0 if a["state"] == s else 0.0)
        prio.add_metric(labels, a["priority"])
        for uuid, n in a["held_bytes"].items():
            gpu.add_metric([a["name"], uuid], n)
        for uuid, n in a["peak_bytes"].items():
            peak.add_metric([a["name"], uuid], n)
        host.add_metric(labels, a["parked_host_bytes"])
        disk.add_metric(labels, a["parked_disk_bytes"])
        idle.add_metric(labels, a["idle_s"])
        for d in DIRECTIONS:
            switches.add_metric(labels + [d], a["switches"][d])
            bounds = [(repr(b), a["switch_seconds_buckets"][d][i]) for i, b in enumerate(SWITCH_BUCKETS_S)]
            seconds.add_metric(labels + [d], bounds + [("+Inf", a["switches"][d])], a["switch_seconds_sum"][d])
            moved.add_metric(labels + [d], a["bytes_moved"][d])
            skipped.add_metric(labels + [d], a["bytes_skipped"][d])
            if a["last_bytes_per_second"].get(d) is not None:
                rate.add_metric(labels + [d], a["last_bytes_per_second"][d])
        for why in REFUSALS:
            refusals.add_metric(labels + [why], a["refusals"][why])
    yield from (state, prio, gpu, peak, host, disk, idle, switches, seconds, moved, skipped, rate, refusals)


def gpu_families(gpus: list[dict[str, Any]]) -> Iterator[Metric]:
    total = GaugeMetricFamily("gpucr_gpu_memory_total_bytes", "the GPU's memory", labels=["gpu", "name"])
    used = GaugeMetricFamily("gpucr_gpu_memory_used_bytes", "the GPU's used memory, by whom: the swap apps, the gpucr "
                             "server itself, and others (processes not under the swap service, other users')",
                             labels=["gpu", "by"])
    for g in gpus:
        if g["total_bytes"] is not None:
            total.add_metric([g["uuid"], g["name"]], g["total_bytes"])
        for by in ("apps", "server", "others"):
            if g[f"{by}_bytes"] is not None:
                used.add_metric([g["uuid"], by], g[f"{by}_bytes"])
    yield from (total, used)


def server_families(state: dict[str, Any]) -> Iterator[Metric]:
    host, server = state["host"], state["server"]
    yield GaugeMetricFamily("gpucr_host_pinned_bytes", "host memory the server holds pinned (staging)",
                            value=host["pinned_bytes"])
    yield GaugeMetricFamily("gpucr_host_parked_bytes", "host memory the parked swap apps' data holds",
                            value=sum(a["parked_host_bytes"] for a in state["apps"]))
    if host.get("host_budget_bytes") is not None:
        yield GaugeMetricFamily("gpucr_host_budget_bytes", "the host budget for parked apps (gpucr serve --host-budget)",
                                value=host["host_budget_bytes"])
    yield CounterMetricFamily("gpucr_server_requests", "requests the server served", value=server["requests"])
    yield GaugeMetricFamily("gpucr_server_start_time_seconds", "when the server started, seconds since the epoch",
                            value=round(state["at"] - server["up_s"], 1))


class _Scrape:
    """A collector for one scrape, of one view."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        yield from app_families(self.state["apps"])
        yield from gpu_families(self.state["gpus"])
        yield from server_families(self.state)


def render(state: dict[str, Any]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Scrape(state))
    return generate_latest(registry)
