"""The replicator: sends each local rank's committed snapshots to the remote holders.

Per local rank, one thread watches the rank's shared-memory slots. It reads every committed
version in order, straight from the slot (no copy), as a delta against the previous one, checks
that the worker did not rewrite the slot meanwhile, and marks the slot *taken*: under the block
policy the worker waits for that mark before it overwrites a slot, so every version reaches the
chain of deltas and every holder gets every version in order. That keeps the holders' versions
aligned across ranks, so that after a node is lost some version is common to all ranks (docs/design.md
I3); under the skip policy the worker does not wait and versions may be skipped. The daemon's own
copy of the newest version (the base of the next delta) follows by one copy of the slot. A
holder that answers that it lacks a base gets a full version at its next turn, after a backoff; one that
is unreachable gets nothing encoded for it until a look at its connection, every tenth of a second at most,
finds it answering, then its full version at once. The pacer (``ffstate.scheduling.scheduler``)
decides when each chunk goes (docs/design.md section 4, step 3) and learns the link from each push.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Container, Protocol

from ffstate import codec
from ffstate.client import Client
from ffstate.codec import Packed, host
from ffstate.daemon.shard import FullVersion, Holder, LocalShard, full_version
from ffstate.errors import CodecError, FFStateError, ReplicaError, ReplicaUnavailable
from ffstate.scheduling.scheduler import Naive

# One holder's batch: the versions it lacks, in order (empty: its step back first), or None (a look at it first).
HolderBatch = tuple[Holder, "list[tuple[int, Packed | FullVersion]] | None"]

log = logging.getLogger("ffstate.daemon.replicator")
SUMMARY_EVERY = 60.0  # seconds between the log's summaries of a shard's pushes (each delta is logged at DEBUG)
PROBE_EVERY = 0.1  # the longest wait between two looks at an unreachable holder's connection (each costs nothing)
DOWN_LOG_EVERY = 30.0  # seconds between the warnings that a holder is still unreachable


def _look_again(holder: Holder) -> bool:
    """Backs ``holder`` off until its next look (``PROBE_EVERY`` at most); whether its time down has just crossed a
    multiple of ``DOWN_LOG_EVERY`` (a warning is due)."""
    before = holder.next_try - holder.down_since
    holder.backoff(PROBE_EVERY)
    return int((holder.next_try - holder.down_since) / DOWN_LOG_EVERY) > int(before / DOWN_LOG_EVERY)


class Pacer(Protocol):
    """Decides when the next chunk may go out (``ffstate.scheduling.scheduler``), and learns from each push."""

    name: str

    def before_chunk(self, holder: str, nbytes: int, behind: int = 0, remaining: int = 0) -> float: ...  # seconds held

    def chunk_bytes(self) -> int: ...  # the segment size to encode the next version with

    def after_push(self, holder: str, nbytes: int, seconds: float, held: float = 0.0) -> None: ...

    def links(self) -> dict: ...  # holder -> scheduler.LinkState

    # and a ``timeline`` (``scheduler.Timeline``) where it sees the training's collectives


class Replicator:
    """Runs one sender thread per local rank."""

    def __init__(self, make_client: Callable[[str], Client], peers: list[str], pacer: Pacer | None = None,
                 poll_interval: float = 0.05, keep: int = 8, taken: Callable[..., None] | None = None,
                 budget: Any = None):
        self.make_client = make_client
        self.budget = budget  # reserve(nbytes, what) / release(nbytes): counts a full version's copy and encoding
        # taken(shard, version, manifest, data, checksum, unchanged): each version as it is taken from the slot,
        # while the slot cannot change (the persistent tier's copy)
        self.taken = taken
        self.keep = keep
        self.peers = list(peers)
        self.pacer = pacer or Naive()
        self.poll_interval = poll_interval
        # Per local rank one batch in flight to each holder: a holder's slow push (a full version re-seeding it, a
        # link that stalls) does not hold back the others' deltas.
        self._batches = ThreadPoolExecutor(32, thread_name_prefix="ffstate-batch")

    def start(self, shard: LocalShard) -> None:
        shard.thread = threading.Thread(target=self._run, args=(shard,), name=f"ffstate-repl-{shard.key.rank}",
                                        daemon=True)
        shard.thread.start()

    def holders(self, addresses: list[str] | None = None) -> list[Holder]:
        return [Holder(p, self.make_client(p)) for p in (self.peers if addresses is None else addresses)]

    def reset(self, shard: LocalShard, addresses: list[str] | None = None, discard_after: int | None = None) -> None:
        """A worker re-attached: what the holders have is no longer known.

        Without a restore (``discard_after`` None or 0) replication starts over: full versions next. After a
        restore to v* = ``discard_after`` (the steps past it are redone, maybe differently) it resumes at v*: the
        slots' newer versions are un-committed, the daemon's copy steps back to v* through the deltas it keeps,
        and each holder is asked to step its replica back to v* (dropping the dead run's newer versions) before
        the next delta; a copy that cannot go back gets a full version. The holders keep their deltas, and the
        node its reach back, so a failure right after a restart costs what one in a steady run does. All under
        the round lock: between the reset and the worker's own view of its slots, the replicator would
        otherwise take the discarded versions as new.
        """
        with shard.lock:
            if discard_after is not None:
                shard.slots.discard_newer(discard_after)
            kept = bool(discard_after) and shard.step_back_to(discard_after)
            with shard.report_lock:
                old = {h.address: h for h in shard.holders}
                shard.holders = self.holders(addresses)
                for h in shard.holders:
                    had = old[h.address].acked if h.address in old else 0
                    if kept and 0 < had <= discard_after:
                        h.acked = had  # a version of the history the job resumed from: deltas go on from it
                    elif discard_after:
                        h.resume = discard_after
                if not kept:
                    shard.base, shard.base_version, shard.chain = None, 0, []
                shard.slots.set_replicated(0)
        for h in old.values():
            h.client.close()
        if discard_after:
            log.info("%s: resuming replication at version %d (%s)", shard.key, discard_after,
                     "the daemon's copy stepped back to it" if kept else "the daemon's copy could not go back to "
                     "it: full versions next")

    def stop(self, shard: LocalShard, wait: float = 5.0) -> None:
        shard.stop.set()
        shard.wake.set()
        if shard.thread is not None:
            shard.thread.join(wait)
        if self.budget is not None and shard.seeding_counted:
            self.budget.release(shard.seeding_counted)
            shard.seeding_counted = 0
        for h in shard.holders:
            h.client.close()

    def shutdown(self) -> None:
        self._batches.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ the loop

    def _run(self, shard: LocalShard) -> None:
        """Takes committed versions as soon as they appear; pushes run beside it, one batch at a time to each
        holder (by address: a holder of a reset's list waits for the push to the same address in flight)."""
        pushing: dict[str, Future] = {}
        while not shard.stop.is_set():
            shard.wake.wait(self.poll_interval)
            shard.wake.clear()
            try:
                with shard.lock:
                    for version, k in shard.slots.committed(ascending=True):
                        if version > shard.base_version and not self._take(shard, version, k):
                            break
                    for address, f in list(pushing.items()):
                        if f.done():
                            del pushing[address]
                            if not f.cancelled() and f.exception() is not None:  # a bug in a batch: said, with where
                                log.error("replication of %s to %s failed", shard.key, address, exc_info=f.exception())
                    for job in self._batch(shard, busy=pushing):
                        pushing[job[0].address] = self._batches.submit(self._send, shard, job)
            except Exception:  # a bug here must not silently stop replication of this rank
                log.exception("replication round of %s failed; retrying", shard.key)
                time.sleep(0.5)

    def _batch(self, shard: LocalShard, busy: Container[str] = ()) -> list[HolderBatch]:
        """What each due holder (not ``busy``: a push to it in flight) needs next: the deltas it lacks, or a full
        version, or (None) a look at its connection first. Under shard.lock."""
        now = time.monotonic()
        shard.trim_chain(self.keep, self.budget)
        due = [h for h in shard.holders
               if h.address not in busy and h.acked < shard.base_version and h.next_try <= now]
        if not due or shard.base is None:
            return []
        batch, full = [], None
        for h in due:
            if h.resume:  # first its step back (then deltas, or a full version)
                batch.append((h, []))
                continue
            if h.probe:  # unreachable at its last try: a look at its connection, nothing encoded
                batch.append((h, None))
                continue
            start = next((i for i, c in enumerate(shard.chain) if c[1] == h.acked), None)
            h.full_in_flight = 0  # its full version landed (its deltas start from it) or failed: decided here
            if start is None:
                full = full or full_version(shard, self.budget, self.pacer.chunk_bytes())
                h.full_in_flight = shard.base_version
                batch.append((h, [(shard.base_version, full.use() if isinstance(full, FullVersion) else full)]))
            else:
                batch.append((h, [(c[0], c[2]) for c in shard.chain[start:]]))
        return batch

    def _send(self, shard: LocalShard, job: HolderBatch) -> None:
        """One holder's batch: its step back, a look at its connection, or its versions in order."""
        holder, versions = job
        try:
            if holder.resume:
                self._step_back(shard, holder)
            elif versions is None:
                self._probe(shard, holder)
            elif all(self._push(shard, v, holder, p) for v, p in versions):
                shard.last_push = time.time()
        finally:
            for _, p in versions or ():
                if isinstance(p, FullVersion):
                    p.done()
            shard.wake.set()  # look for what came meanwhile

    def _take(self, shard: LocalShard, version: int, k: int) -> bool:
        """Reads committed slot k (``version``) into the chain of deltas and frees it for the worker.

        Returns False if the worker rewrote the slot meanwhile (it did not wait: policy skip).
        """
        view = shard.slots.view(k)
        if view is None or view.version != version:
            return False
        if not shard.holders:  # nobody to send to: the slot is the only copy; checksum it for its readers
            checksum = codec.buffer_checksum(view.data)
            if not shard.slots.unchanged(view):
                return False
            self._taken(shard, version, view, checksum)
            shard.slots.record_checksum(view, checksum)
            shard.slots.mark_taken(view)
            shard.base, shard.base_version, shard.chain = None, version, []
            return True
        try:
            if shard.base is None:
                buf = host.clone(view.data)
                checksum = codec.buffer_checksum(buf)
                packed = None
            else:  # the worker does not checksum its commits (shm): the daemon does, here
                checksum = codec.buffer_checksum(view.data)
                snap = codec.Snapshot(shard.manifest.with_scalars(view.scalars), view.data, checksum)
                packed = codec.encode_snapshot(snap, shard.base, chunk_bytes=self.pacer.chunk_bytes())
            if not shard.slots.unchanged(view):
                return False
            if packed is None:
                shard.base = codec.Snapshot(shard.manifest.with_scalars(view.scalars), buf, checksum)
            else:
                # The daemon's copy becomes the slot's bytes by one copy, not by decoding the delta again
                # (which cost 15x the copy's CPU): the holders verify the delta against the checksum.
                before = shard.base.manifest.scalars
                host.copy_into(shard.base.buffer, view.data)
                if not shard.slots.unchanged(view):  # torn: the worker did not wait (policy skip)
                    log.warning("%s: version %d was rewritten while the daemon copied it; the next push is a "
                                "full version", shard.key, version)
                    shard.base, shard.base_version, shard.chain = None, 0, []
                    return False
                shard.base = codec.Snapshot(shard.manifest.with_scalars(view.scalars), shard.base.buffer, checksum)
                shard.chain.append((version, shard.base_version, packed, before))
        except CodecError as e:  # cannot happen unless memory is corrupted: start over from a full version
            log.error("%s: reading version %d failed (%s); the next push is a full version", shard.key, version, e)
            shard.base, shard.base_version, shard.chain = None, 0, []
            return False
        self._taken(shard, version, view, checksum)
        shard.slots.record_checksum(view, checksum)
        shard.slots.mark_taken(view)
        shard.base_version = version
        return True

    def _taken(self, shard: LocalShard, version: int, view: Any, checksum: int) -> None:
        if self.taken is not None:
            self.taken(shard, version, shard.manifest.with_scalars(view.scalars), view.data, checksum,
                       lambda: shard.slots.unchanged(view))

    def _step_back(self, shard: LocalShard, holder: Holder) -> None:
        """Asks ``holder`` to step its replica back to ``holder.resume``, where the job resumed: deltas go on from
        there; a holder that cannot (it holds nothing, or not that far back) gets a full version."""
        k, version = shard.key, holder.resume
        try:
            holder.client.step_back(k.job_id, k.rank, k.world_size, version)
        except ReplicaUnavailable as e:  # a step back is one small call: tried again as often as a look
            first = not holder.down_since
            holder.down, holder.down_since = True, holder.down_since or time.monotonic()
            shard.report()
            if _look_again(holder) or first:
                log.warning("step back of %s at %s to version %d failed (%s); trying every %.2fs", k, holder.address,
                            version, e, PROBE_EVERY)
            return
        except ReplicaError as e:
            holder.resume, holder.acked, holder.down, holder.down_since = 0, 0, False, 0.0
            log.info("holder %s cannot step %s back to version %d (%s): a full version next", holder.address, k,
                     version, e.code)
            return
        holder.resume, holder.acked, holder.failures, holder.down, holder.down_since = 0, version, 0, False, 0.0
        shard.report()
        log.info("holder %s stepped %s back to version %d, where the job resumed: deltas go on from it",
                 holder.address, k, version)

    def _probe(self, shard: LocalShard, holder: Holder) -> None:
        """A look at an unreachable holder's connection: answering, it gets what it lacks at the next round (a full
        version, usually: its daemon restarted empty); not yet, another look after a backoff."""
        if holder.client.reachable():
            holder.probe, holder.answered, holder.next_try = False, True, 0.0
            log.info("holder %s answers again after %.1fs: %s goes to it next", holder.address,
                     time.monotonic() - holder.down_since, shard.key)
            return
        if _look_again(holder):
            log.warning("holder %s still unreachable after %.0fs: %s has no copy there; looking every %.2fs",
                        holder.address, time.monotonic() - holder.down_since, shard.key, PROBE_EVERY)

    def _push(self, shard: LocalShard, version: int, holder: Holder, packed: Packed | FullVersion) -> bool:
        k = shard.key
        if isinstance(packed, FullVersion):
            try:
                packed = packed.packed()
            except Exception:  # cannot happen short of memory: said, and tried again after the backoff of a failure
                holder.backoff(1.0)
                holder.full_in_flight = 0
                log.exception("%s: encoding version %d in full for %s failed; trying again in %.1fs", k, version,
                              holder.address, holder.next_try - time.monotonic())
                return False
        base_version = holder.acked if packed.kind == "delta" else 0
        held, sent = [0.0], [0]

        def pace(n: int) -> None:
            # behind: taken versions this holder lacks, newer ones taken meanwhile included; remaining: their
            # bytes still to go (this version's rest and the deltas taken after it), all due before the next commit
            later = sum(c[2].nbytes for c in list(shard.chain) if c[0] > version)
            held[0] += self.pacer.before_chunk(holder.address, n, shard.base_version - holder.acked,
                                               packed.nbytes - sent[0] + later)
            sent[0] += n

        start = time.monotonic()
        try:
            holder.client.push_and_commit(k.job_id, k.rank, k.world_size, version, packed, base_version,
                                          before_chunk=pace)
        except (ReplicaError, FFStateError) as e:
            holder.full_in_flight = 0  # it did not land: nothing kept for it
            holder.down = isinstance(e, ReplicaUnavailable)
            # Looks first, unless one just found it answering: then it is not its connection (a daemon that
            # accepts and fails the push), and the next push waits out the backoff, as any failed push does.
            holder.probe, holder.answered = holder.down and not holder.answered, False
            if holder.down:
                holder.down_since = holder.down_since or time.monotonic()
            else:
                holder.acked = 0  # whatever went wrong, the next push is a full version
            shard.report()
            holder.backoff(PROBE_EVERY if holder.probe else 1.0)
            log.warning("push of %s version %d to %s failed (%s); %s", k, version, holder.address, e,
                        "nothing more is sent until it answers" if holder.probe else
                        f"retry in {holder.next_try - time.monotonic():.1f}s")
            return False
        if holder.failures:
            log.info("holder %s is back: %s version %d re-seeded (%s)", holder.address, k, version, packed.kind)
        self.pacer.after_push(holder.address, packed.nbytes, time.monotonic() - start, held[0])
        holder.acked, holder.failures, holder.down, holder.down_since, holder.answered = version, 0, False, 0.0, False
        shard.report()
        shard.pushed_raw_bytes += packed.raw_nbytes
        shard.pushed_bytes += packed.nbytes
        shard.pushed_versions += 1
        # A full version (a holder seeded) is news; the deltas of a steady run are summed up once a minute.
        log.log(logging.INFO if packed.kind == "full" else logging.DEBUG, "pushed %s version %d to %s: %s, %d bytes "
                "(%.2fx)", k, version, holder.address, packed.kind, packed.nbytes, packed.ratio)
        _summary(shard)
        return True


def _summary(shard: LocalShard) -> None:
    """Once a minute, the log's summary of a shard's pushes (each delta is logged at DEBUG)."""
    at, versions, nbytes, raw = shard.said
    now = time.monotonic()
    if now - at < SUMMARY_EVERY:
        return
    shard.said = (now, shard.pushed_versions, shard.pushed_bytes, shard.pushed_raw_bytes)
    if at:
        log.info("%s: %d versions pushed in the last %.0fs, up to version %d, %.1f MB on the wire (%.2fx)",
                 shard.key, shard.pushed_versions - versions, now - at, shard.base_version,
                 (shard.pushed_bytes - nbytes) / 1e6, (shard.pushed_raw_bytes - raw) / max(1, shard.pushed_bytes - nbytes))
