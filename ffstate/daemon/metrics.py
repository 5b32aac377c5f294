"""The daemon's Prometheus metrics (``ffstate serve --metrics-port``), read from the node's report at each scrape.

One collector, no second bookkeeping: every figure comes from ``Node.report()``, the same walk of the
node's live state that ``Inventory`` (and so ``ffstate status``) answers with.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from ffstate.reports import NodeReport

log = logging.getLogger("ffstate.daemon.metrics")


class ReportCollector(Collector):
    """Metrics of the report ``report()`` gives at each scrape."""

    def __init__(self, report: Callable[[], NodeReport]):
        self.report = report

    def collect(self) -> Iterator:
        rep = self.report()
        node = rep.node_id
        shard = ["node", "job", "rank"]
        sent = CounterMetricFamily("ffstate_replicated_bytes", "Bytes a local rank sent to its holders (wire)", labels=shard)
        versions = CounterMetricFamily("ffstate_replicated_versions", "Versions sent, once per holder", labels=shard)
        lag = GaugeMetricFamily("ffstate_lag_versions",
                                "Newest committed version minus what every holder that answers has",
                                labels=shard)
        ratio = GaugeMetricFamily("ffstate_compression_ratio", "Raw bytes over wire bytes of the versions sent",
                                  labels=shard)
        down = GaugeMetricFamily("ffstate_holders_down", "A local rank's holders that lack its newest version and "
                                 "did not answer their last push (not in the lag while another answers)", labels=shard)
        seeding = GaugeMetricFamily("ffstate_holders_seeding", "A local rank's holders that answer but hold no copy to "
                                    "build on (a full version next, or refusing; counted in the lag)", labels=shard)
        queue = GaugeMetricFamily("ffstate_queue_versions",
                                  "Versions read from the slots, not yet on every holder that answers", labels=shard)
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
        resized = GaugeMetricFamily("ffstate_restore_from_world_size",
                                    "The world size the newest restore's copies were made at (a resize; 0: none)",
                                    labels=shard)
        held = GaugeMetricFamily("ffstate_replica_bytes", "Memory of the replicas this daemon holds", labels=shard)
        version = GaugeMetricFamily("ffstate_replica_version", "Newest version of a held replica", labels=shard)
        staged = GaugeMetricFamily("ffstate_staged_bytes", "Memory of a pushed version not yet committed", labels=shard)
        hangs = CounterMetricFamily("ffstate_hangs", "Hangs the watchdog declared on a local rank", labels=shard)
        step = GaugeMetricFamily("ffstate_step_seconds", "A local rank's median step, commit to commit", labels=shard)
        compute = GaugeMetricFamily("ffstate_compute_seconds",
                                    "A local rank's median step less its wait in the collectives", labels=shard)
        since = GaugeMetricFamily("ffstate_seconds_since_commit",
                                  "Since a local rank's newest commit, attach or end of a pause (0 while paused)",
                                  labels=shard)
        deadline = GaugeMetricFamily("ffstate_hang_deadline_seconds", "A local rank is declared hung past this",
                                     labels=shard)
        commit = GaugeMetricFamily("ffstate_commit_seconds", "How long a local rank's newest commit held its training "
                                   "loop", labels=shard)
        straggler = GaugeMetricFamily("ffstate_straggler_ratio",
                                      "A local rank's compute a step over the median of its node's other ranks",
                                      labels=shard)
        for s in rep.shards:
            labels = [node, s.shard.job_id, str(s.shard.rank)]
            if s.local and s.watch is not None:
                hangs.add_metric(labels, s.watch.hangs)
                step.add_metric(labels, s.watch.step_seconds)
                compute.add_metric(labels, s.watch.compute_seconds)
                since.add_metric(labels, s.watch.since_seconds)
                deadline.add_metric(labels, s.watch.deadline_seconds)
                straggler.add_metric(labels, s.watch.straggler_ratio)
                commit.add_metric(labels, s.watch.commit_seconds)
            if not s.local:
                held.add_metric(labels, s.bytes)
                version.add_metric(labels, s.version)
                staged.add_metric(labels, s.staged_bytes)
                continue
            if s.restore is not None:
                restores.add_metric(labels, s.restore.restores)
                restore_seconds.add_metric(labels, s.restore.seconds)
                restore_version.add_metric(labels, s.restore.version)
                restore_lost.add_metric(labels, s.restore.steps_lost)
                resized.add_metric(labels, s.restore.from_world_size)
            sent.add_metric(labels, s.pushed_bytes)
            versions.add_metric(labels, s.pushed_versions)
            lag.add_metric(labels, max(0, s.version - s.replicated_version))
            queue.add_metric(labels, s.queue_versions)
            down.add_metric(labels, s.holders_down)
            seeding.add_metric(labels, s.holders_seeding)
            if s.pushed_bytes:
                ratio.add_metric(labels, s.pushed_raw_bytes / s.pushed_bytes)
            if s.razor is not None:
                state.add_metric(labels, s.razor.state_bytes)
                replicated.add_metric(labels, s.razor.shard_bytes)
                verified.add_metric(labels, s.razor.verifications)
                mismatched.add_metric(labels, s.razor.mismatches)
        yield from (hangs, step, compute, since, deadline, straggler, commit)
        yield from (sent, versions, lag, down, seeding, ratio, queue, state, replicated, verified, mismatched, restores,
                    restore_seconds, restore_version, restore_lost, resized)

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
        rushes = CounterMetricFamily("ffstate_scheduler_rushes",
                                     "Chunks sent past the training's windows, or what the holder lacked would have "
                                     "missed the workers' next commit", labels=["node", "holder"])
        collisions = CounterMetricFamily("ffstate_scheduler_collisions",
                                         "The training's collectives that started while a chunk to the holder was on "
                                         "the wire", labels=["node", "holder"])
        overlap = CounterMetricFamily("ffstate_scheduler_overlap_seconds",
                                      "Seconds chunks to the holder were on the wire during the training's collectives",
                                      labels=["node", "holder"])
        for link in rep.links:
            estimate.add_metric([node, link.holder], link.estimate_bytes_per_second)
            waited.add_metric([node, link.holder], link.waited_seconds)
            overrides.add_metric([node, link.holder], link.deadline_overrides)
            catch_ups.add_metric([node, link.holder], link.catch_ups)
            rushes.add_metric([node, link.holder], link.rushes)
            collisions.add_metric([node, link.holder], link.collisions)
            overlap.add_metric([node, link.holder], link.overlap_seconds)
        share.add_metric([node], rep.link_share)
        yield from (estimate, share, waited, overrides, catch_ups, rushes, collisions, overlap)
        seen = CounterMetricFamily("ffstate_scheduler_collectives", "The training's collectives the scheduler saw "
                                   "marked by this node's workers", labels=["node"])
        seen.add_metric([node], rep.collectives)
        yield seen

        refused = CounterMetricFamily("ffstate_refusals", "Requests refused, by the gRPC status answered",
                                      labels=["node", "status"])
        for status, n in sorted(rep.refusals.items()):
            refused.add_metric([node, status], n)
        yield refused
        if rep.persist is not None:
            flushes = CounterMetricFamily("ffstate_persist_flushes", "Ranks' versions the persistent tier took, by "
                                          "outcome (flushed, skipped: a flush still ran, failed: the filesystem refused)",
                                          labels=["node", "outcome"])
            for outcome in ("flushed", "skipped", "failed"):
                flushes.add_metric([node, outcome], getattr(rep.persist, outcome))
            written = CounterMetricFamily("ffstate_persist_bytes", "Bytes of state flushed", labels=["node"])
            written.add_metric([node], rep.persist.bytes)
            seconds = GaugeMetricFamily("ffstate_persist_seconds", "The newest flush of one rank's version",
                                        labels=["node"])
            seconds.add_metric([node], rep.persist.seconds)
            complete = GaugeMetricFamily("ffstate_persist_complete_version", "The newest version this daemon made "
                                         "complete in the persistent tier", labels=["node"])
            complete.add_metric([node], rep.persist.newest_complete)
            pending = GaugeMetricFamily("ffstate_persist_pending", "Ranks' versions copied and not yet written "
                                        "(queued, or being written)", labels=["node"])
            pending.add_metric([node], rep.persist.pending)
            yield from (flushes, written, seconds, complete, pending)
        budget = GaugeMetricFamily("ffstate_memory_bytes", "Memory used and budget", labels=["node", "kind"])
        budget.add_metric([node, "used"], rep.bytes_used)
        budget.add_metric([node, "budget"], rep.bytes_budget)
        yield from (held, version, staged, budget)


def serve_metrics(report: Callable[[], NodeReport], host: str, port: int) -> Any:
    """Starts the HTTP endpoint (``/metrics``) on its own registry; returns its server (``shutdown()`` stops it)."""
    registry = CollectorRegistry()
    registry.register(ReportCollector(report))
    server, _ = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server
