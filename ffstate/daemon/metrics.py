"""The daemon's Prometheus metrics (``ffstate serve --metrics-port``), read from its live state at each scrape.

One collector, no second bookkeeping: every figure comes from the objects that do the work (the
local shards' replication counters, the slots' razor counters, the scheduler's link states, the
store's replicas). ``ffstate status`` shows the same figures from ``Inventory``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

if TYPE_CHECKING:
    from ffstate.daemon.server import Daemon

log = logging.getLogger("ffstate.daemon.metrics")


class DaemonCollector(Collector):
    def __init__(self, daemon: "Daemon"):
        self.daemon = daemon

    def collect(self) -> Iterator:
        d = self.daemon
        node = d.cfg.node_id
        shard = ["node", "job", "rank"]
        sent = CounterMetricFamily("ffstate_replicated_bytes", "Bytes a local rank sent to its holders (wire)", labels=shard)
        versions = CounterMetricFamily("ffstate_replicated_versions", "Versions sent, once per holder", labels=shard)
        lag = GaugeMetricFamily("ffstate_lag_versions", "Newest committed version minus what every holder has",
                                labels=shard)
        ratio = GaugeMetricFamily("ffstate_compression_ratio", "Raw bytes over wire bytes of the versions sent",
                                  labels=shard)
        queue = GaugeMetricFamily("ffstate_queue_versions", "Versions read from the slots, not yet on every holder",
                                  labels=shard)
        state = GaugeMetricFamily("ffstate_state_bytes", "A local rank's whole packed state (no razor)", labels=shard)
        replicated = GaugeMetricFamily("ffstate_replicated_state_bytes",
                                       "What a local rank replicates of it (razor: its own entries and its part)",
                                       labels=shard)
        verified = CounterMetricFamily("ffstate_razor_verifications", "Razor checksum comparisons by the group",
                                       labels=shard)
        mismatched = CounterMetricFamily("ffstate_razor_mismatches", "Entries found to differ across the group",
                                         labels=shard)
        restores = CounterMetricFamily("ffstate_restores", "Restores of a local rank its workers recorded in its slots",
                                       labels=shard)
        restore_seconds = GaugeMetricFamily("ffstate_restore_seconds",
                                            "The newest restore's fetch and load of the state", labels=shard)
        restore_version = GaugeMetricFamily("ffstate_restore_version", "The step the newest restore went back to (v*)",
                                            labels=shard)
        restore_lost = GaugeMetricFamily("ffstate_restore_steps_lost", "The newest restore's steps lost", labels=shard)
        for key, s in list(d.local.items()):
            labels = [node, key.job_id, str(key.rank)]
            count, v_star, lost, seconds, _ = s.slots.restore_record()
            if count:
                restores.add_metric(labels, count)
                restore_seconds.add_metric(labels, seconds)
                restore_version.add_metric(labels, v_star)
                restore_lost.add_metric(labels, lost)
            sent.add_metric(labels, s.pushed_bytes)
            versions.add_metric(labels, s.pushed_versions)
            done = s.slots.committed()
            lag.add_metric(labels, max(0, (done[0][0] if done else 0) - s.replicated_version))
            queue.add_metric(labels, max(0, s.base_version - s.replicated_version))
            if s.pushed_bytes:
                ratio.add_metric(labels, s.pushed_raw_bytes / s.pushed_bytes)
            if s.razor is not None:
                state.add_metric(labels, s.razor.state_bytes)
                replicated.add_metric(labels, s.razor.shard_bytes)
                v, m = s.slots.razor_counters()
                verified.add_metric(labels, v)
                mismatched.add_metric(labels, m)
        yield from (sent, versions, lag, ratio, queue, state, replicated, verified, mismatched, restores,
                    restore_seconds, restore_version, restore_lost)

        pacer = d.replicator.pacer
        estimate = GaugeMetricFamily("ffstate_link_estimate_bytes_per_second", "Estimated bandwidth to a holder",
                                     labels=["node", "holder"])
        share = GaugeMetricFamily("ffstate_link_share", "Share of the link replication may use", labels=["node"])
        waited = CounterMetricFamily("ffstate_scheduler_wait_seconds", "Time chunks were held for windows and the rate",
                                     labels=["node", "holder"])
        overrides = CounterMetricFamily("ffstate_scheduler_deadline_overrides",
                                        "Chunks sent past the training's windows to stay within the lag",
                                        labels=["node", "holder"])
        catch_ups = CounterMetricFamily("ffstate_scheduler_catch_ups",
                                        "Chunks sent at the link's whole rate, in the training's windows, while a "
                                        "newer version waited", labels=["node", "holder"])
        collisions = CounterMetricFamily("ffstate_scheduler_collisions",
                                         "The training's collectives that started while a chunk to the holder was on "
                                         "the wire", labels=["node", "holder"])
        overlap = CounterMetricFamily("ffstate_scheduler_overlap_seconds",
                                      "Seconds chunks to the holder were on the wire during the training's collectives",
                                      labels=["node", "holder"])
        for holder, link in pacer.links().items():
            estimate.add_metric([node, holder], link.estimate)
            waited.add_metric([node, holder], link.waited)
            overrides.add_metric([node, holder], link.overrides)
            catch_ups.add_metric([node, holder], link.catch_ups)
            collisions.add_metric([node, holder], link.collisions)
            overlap.add_metric([node, holder], link.overlap)
        share.add_metric([node], getattr(pacer, "share", 1.0))
        yield from (estimate, share, waited, overrides, catch_ups, collisions, overlap)
        timeline = getattr(pacer, "timeline", None)
        if timeline is not None:
            seen = CounterMetricFamily("ffstate_scheduler_collectives", "The training's collectives the scheduler saw "
                                       "marked by this node's workers", labels=["node"])
            seen.add_metric([node], timeline.collectives)
            yield seen

        held = GaugeMetricFamily("ffstate_replica_bytes", "Memory of the replicas this daemon holds", labels=shard)
        version = GaugeMetricFamily("ffstate_replica_version", "Newest version of a held replica", labels=shard)
        for r in d.store.inventory(""):
            k = r["key"]
            held.add_metric([node, k.job_id, str(k.rank)], r["bytes"])
            version.add_metric([node, k.job_id, str(k.rank)], r["version"])
        budget = GaugeMetricFamily("ffstate_memory_bytes", "Memory used and budget", labels=["node", "kind"])
        budget.add_metric([node, "used"], d.store.used)
        budget.add_metric([node, "budget"], d.store.budget)
        yield from (held, version, budget)


def serve_metrics(daemon: "Daemon", host: str, port: int) -> Any:
    """Starts the HTTP endpoint (``/metrics``) on its own registry; returns its server (``shutdown()`` stops it)."""
    registry = CollectorRegistry()
    registry.register(DaemonCollector(daemon))
    server, _ = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server
