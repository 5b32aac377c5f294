"""The bandwidth-aware scheduler: paces the replicator's chunks into the training's idle network windows.

docs/design.md section 4, step 3. The replicator asks ``before_chunk`` before each chunk it sends; the
scheduler lets it go when

- the training has no collective on the wire now (its workers mark each DDP gradient bucket's
  all-reduce, or FSDP2's all-gathers and reduce-scatters, start and end, in their slot headers:
  ``shm.CommMarks``), and none is predicted before the chunk would be through (the last step's
  collectives, at the same offsets from the step's commit, are taken as the next step's; where
  nothing marks the collectives, a few profiled steps give their offsets: ``profiling.py``), counting
  from when the chunks released before it are through, and
- a token bucket allows it: replication may use ``share`` of the link's estimated bandwidth,
  trickling, never in bursts (queued bytes would delay the next collective); the whole link, still
  in the windows, while a newer version waits behind the one being sent (the share does not keep up).

The link estimate per holder is ``link_bytes_per_s`` when given (the NIC's rate: the reliable
setting); else it starts from the first push (sent unpaced: the probe) and follows a running
average of real pushes, each timed less the time the scheduler held it. Chunks are cut to take a
few milliseconds on the slowest link, so that they fit between collectives. When a holder falls
``deadline`` versions behind, the scheduler stops waiting for windows and pacing (replication must
stay within the lag, docs/design.md I4), and counts and logs it.

The pacing must not cost a step on a node loss: what a holder lacks is due there before the workers'
next commit (the newest commit plus the median step). It goes in the windows while that leaves time,
at the rate pushes have had under pacing, and past them, unpaced, once it would miss the commit
(``rushes``): without it every holder sat at the deadline and ``make demo``'s node loss cost 3-4 steps
where naive sending cost 0-1. ``Naive`` sends as soon as a version is captured, for comparison.

Both count what they did to the training (``Timeline``): each collective the workers marked, those
that started while a chunk was, by the link's rate, still on the wire (a **collision**), and the
seconds replication shared the link with collectives (the **overlap**: a collision with a 32 KiB
chunk costs a collective 3 ms at 100 Mbit/s, one with a 1 MiB chunk 80).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ffstate.codec.chunks import DEFAULT_CHUNK_BYTES
from ffstate.scheduling.windows import merge_intervals, predicted_busy_until, project  # noqa: F401 (project: re-exported)

# The training's collectives, as the workers mark them: (in flight now, recent (start, end) times, commit times).
Busy = Callable[[], "tuple[int, list[tuple[float, float]], list[float]]"]
# The training's collectives predicted from profiled timelines (``project``): (start, end) wall-clock times.
Predicted = Callable[[], "list[tuple[float, float]]"]

log = logging.getLogger("ffstate.scheduler")

EWMA = 0.3  # weight of the newest push in the running link estimate
CHUNK_SECONDS = 0.003  # a paced chunk takes about this long on the slowest link: it fits between collectives
MIN_CHUNK = 32 << 10  # below this the per-chunk costs (a gRPC message, a segment's encoding) start to show
# A measured estimate includes the per-chunk costs, so chunks cut to it lower it further (32 KiB chunks halve a
# loopback push's rate, 50 against 100 MB/s): where the link's rate is not given, chunks stay this large.
MEASURED_MIN_CHUNK = 256 << 10
# The token bucket holds about one chunk: a chunk released goes into the socket's and the NIC queue's buffers
# at once, and a collective that starts then waits behind everything queued there, so replication must
# trickle at its rate, never release a backlog in one burst (with a 50 ms bucket the scheduler cost an FSDP2
# job across 100 Mbit/s what naive sending did: 1.22x against 1.24x a step).
BURST_SECONDS = 0.005
# Seconds kept clear before a predicted collective (the prediction is a step old). Measured in the FSDP2 bench
# across 100 Mbit/s: shifting the prediction by the step's drift so far and a guard learned from how early
# collectives came (up to 20 ms) met fewer collectives with a chunk but cost more step time (1.038 and 1.045
# against 1.019 and 1.016 with this fixed guard, naive 1.10-1.12), as fewer windows were left to send in.
GUARD = 0.002
POLL = 0.002  # seconds between looks at the training's marks while it is on the wire
CATCH_UP = 2  # versions behind (taken, not yet at a holder) from which replication takes the whole link in windows
# What a holder lacks is due this long before the next commit, its bytes at DUE_MARGIN times their time at the
# link's rate (the node's other ranks share the link and the CPU; make demo's node loss: 2x cost 1-2 steps, 4x 1).
DUE_GUARD = 0.01
DUE_MARGIN = 4.0


@dataclass
class LinkState:
    """What the scheduler knows of one holder's link."""

    estimate: float = 0.0  # bytes per second the link moved (0: not measured yet)
    tokens: float = 0.0
    refilled: float = field(default_factory=time.monotonic)
    waited: float = 0.0  # seconds chunks to this holder were held for windows and the rate cap
    overrides: int = 0  # chunks sent past the windows because replication neared its lag bound
    catch_ups: int = 0  # chunks sent at the whole link's rate (in windows) because a newer version waited
    rushes: int = 0  # chunks sent past the windows, or what the holder lacks would miss the next commit
    paced: float = 1.0  # running share of a push's time not held by the scheduler (1: never held)
    sent_bytes: int = 0
    collisions: int = 0  # the training's collectives that started while a chunk to this holder was on the wire
    overlap: float = 0.0  # seconds chunks to this holder were on the wire during the training's collectives
    wire_until: float = 0.0  # wall time the chunks released to this holder are through the link, by its rate


class Timeline:
    """What the pacing did to the training, from the workers' marks: the collectives seen, those that met a
    chunk on the wire, and the seconds chunks were on the wire during collectives.

    A chunk is taken to be on the wire from its release (or the end of the chunk before it to the same
    holder) for ``nbytes / estimate`` seconds. Marks are read when a chunk is released and when the
    figures are asked for; the workers' ring holds the last 48 collectives, so a long idle spell
    between versions can let some go uncounted (never a collision: no chunk was on the wire).
    """

    def __init__(self, busy: Busy | None):
        self.busy = busy
        self.collectives = 0
        self.collisions = 0
        self.overlap = 0.0
        self._seen = 0.0  # start of the newest collective counted
        self._chunks: collections.deque[tuple[float, float, LinkState]] = collections.deque(maxlen=512)
        self._lock = threading.Lock()

    def chunk(self, link: LinkState, nbytes: int, now: float) -> None:
        """A chunk of ``nbytes`` to ``link``'s holder was released at wall time ``now``."""
        if not link.estimate:
            return
        with self._lock:
            start = max(now, link.wire_until)
            link.wire_until = start + nbytes / link.estimate
            self._chunks.append((start, link.wire_until, link))

    def observe(self, marks: "tuple[int, list[tuple[float, float]], list[float]] | None" = None) -> None:
        """Counts the collectives marked since the last look (``marks``: a ``busy()`` just read, or None to read)."""
        if marks is None:
            if self.busy is None:
                return
            marks = self.busy()
        with self._lock:
            chunks = self._chunks
            for s, e in merge_intervals(marks[1]):
                if s <= self._seen:
                    continue
                self._seen = s
                self.collectives += 1
                # Collectives come in the order they started: a chunk off the wire before this one started meets
                # none of the later ones either (without this, each look scanned all 512 chunks kept: 17% of a
                # daemon's CPU, profiled).
                while chunks and chunks[0][1] <= s:
                    chunks.popleft()
                hit = next((link for a, b, link in chunks if a <= s < b), None)
                if hit is not None:
                    self.collisions += 1
                    hit.collisions += 1
                for a, b, link in chunks:
                    shared = min(b, e) - max(a, s)
                    if shared > 0:
                        self.overlap += shared
                        link.overlap += shared


class Naive:
    """Sends as soon as a snapshot is captured (the comparison the scheduler is measured against).

    It paces nothing, but keeps the same figures: a link estimate per holder (its pushes are not
    paced, so their rate is the link's) and, given the workers' marks (``busy``), the collisions and
    the overlap (``Timeline``).
    """

    name = "naive"

    def __init__(self, busy: Busy | None = None, link_bytes_per_s: float = 0.0,
                 wall: Callable[[], float] = time.time):
        self.link_bytes_per_s, self.wall = link_bytes_per_s, wall
        self.timeline = Timeline(busy)
        self._links: dict[str, LinkState] = {}
        self._lock = threading.Lock()

    def chunk_bytes(self) -> int:
        return DEFAULT_CHUNK_BYTES

    def _link(self, holder: str) -> LinkState:
        with self._lock:
            if holder not in self._links:
                self._links[holder] = LinkState(estimate=self.link_bytes_per_s)
            return self._links[holder]

    def before_chunk(self, holder: str, nbytes: int, behind: int = 0, remaining: int = 0) -> float:
        link = self._link(holder)
        self.timeline.observe()
        self.timeline.chunk(link, nbytes, self.wall())
        with self._lock:
            link.sent_bytes += nbytes
        return 0.0

    def after_push(self, holder: str, nbytes: int, seconds: float, held: float = 0.0) -> None:
        link = self._link(holder)
        if not self.link_bytes_per_s:
            measured = nbytes / max(seconds, 1e-3)
            link.estimate = measured if not link.estimate else (1 - EWMA) * link.estimate + EWMA * measured

    def links(self) -> dict[str, LinkState]:
        self.timeline.observe()
        with self._lock:
            return dict(self._links)


class Scheduler:
    """Paces chunks into idle windows under a share of each link (see the module docstring).

    Args:
        busy: returns the training's collectives as (in flight now, recent (start, end) intervals and
            commit times, both in ``time.time()`` seconds); ``shm.CommMarks`` readers provide it.
        share: fraction of the link's estimated bandwidth replication may use.
        link_bytes_per_s: the link's bandwidth when known (0: measured from the pushes).
        deadline: versions behind at which windows are ignored (the lag bound is near).
        predicted: the collectives predicted from the workers' profiled timelines, where no marks are.
        held: whether a worker's commit is held until replication catches up (its lag policy): the other ranks
            then wait for it in their collectives, and a chunk that waited for those would wait for itself.
        clock, wall, sleep: monotonic seconds, wall-clock seconds (the marks' clock) and sleeping;
            replaceable for tests.
    """

    name = "windows"

    def __init__(self, busy: Busy, share: float = 0.5,
                 link_bytes_per_s: float = 0.0, deadline: int = 3, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 predicted: Predicted | None = None, held: Callable[[], bool] | None = None):
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.busy, self.share, self.link_bytes_per_s, self.deadline = busy, share, link_bytes_per_s, max(1, deadline)
        self.predicted, self.held = predicted, held
        self.clock, self.wall, self.sleep = clock, wall, sleep
        self.timeline = Timeline(busy)
        self._links: dict[str, LinkState] = {}
        self._lock = threading.Lock()

    def links(self) -> dict[str, LinkState]:
        self.timeline.observe()
        with self._lock:
            return dict(self._links)

    def chunk_bytes(self) -> int:
        """The segment size the replicator encodes with: a chunk should take about ``CHUNK_SECONDS`` on the
        slowest known link, so that it fits in the gaps between the training's collectives and one that
        starts is not held up long behind it; ``DEFAULT_CHUNK_BYTES`` (1 MiB) until a link is measured
        and on fast links. A power of two, at least ``MIN_CHUNK`` (``MEASURED_MIN_CHUNK`` where the
        link's rate is measured, not given)."""
        with self._lock:
            slowest = min((link.estimate for link in self._links.values() if link.estimate),
                          default=self.link_bytes_per_s)
        if not slowest:
            return DEFAULT_CHUNK_BYTES
        want = max(MIN_CHUNK if self.link_bytes_per_s else MEASURED_MIN_CHUNK, int(slowest * CHUNK_SECONDS))
        return min(DEFAULT_CHUNK_BYTES, 1 << (want.bit_length() - 1))

    def _link(self, holder: str) -> LinkState:
        with self._lock:
            if holder not in self._links:
                self._links[holder] = LinkState(estimate=self.link_bytes_per_s, refilled=self.clock())
            return self._links[holder]

    # ------------------------------------------------------------ the pacing

    def before_chunk(self, holder: str, nbytes: int, behind: int = 0, remaining: int = 0) -> float:
        """Returns once the chunk may go; returns the seconds it was held.

        ``behind``: versions taken that this holder lacks (1: the one being sent is the newest);
        ``remaining``: bytes of the version being sent still to go, this chunk's included (0: unknown).
        """
        link = self._link(holder)
        if not link.estimate:  # the probe: the first push goes unpaced and is timed
            return 0.0
        start = self.clock()
        # Behind (a version pushed while a newer one waits): the share does not keep up; the whole link, in windows.
        rate = link.estimate * (self.share if behind < CATCH_UP else 1.0)
        windows = capped = behind < self.deadline
        if windows and remaining:  # what the holder lacks is due there before the next commit
            left = self._time_to_next_commit()
            # at the rate pushes to this holder have had under pacing, holds for windows and the cap included
            need = remaining * DUE_MARGIN / (link.estimate * max(link.paced, 0.05))
            if left is not None and need >= left:  # it would miss it: past the windows, unpaced
                windows = capped = False
                _count(link, "rushes", 1000, logging.INFO, "replication to %s: %d versions behind, %d bytes would "
                       "miss the next commit in the windows: sent past them", holder, behind, remaining)
            elif left is not None:  # faster than the share where the time left needs it
                rate = min(link.estimate, max(rate, remaining * DUE_MARGIN / left))
        if windows and self.held is not None and self.held():  # a commit waits for it: nothing to yield to
            windows = capped = False
            _count(link, "rushes", 1000, logging.INFO, "replication to %s: a worker's commit waits for it (lag "
                   "policy block): sent past the windows", holder)
        if CATCH_UP <= behind < self.deadline:
            _count(link, "catch_ups", 1000, logging.INFO, "replication to %s is %d versions behind: catching up at "
                   "the link's whole rate in the training's windows", holder, behind)
        if behind >= self.deadline:
            # At the default max_lag 1 (deadline 1) every chunk is one: a holder lacks at least the version being
            # sent. INFO, as the catch-ups; a lag bound that holds the training's commits says so itself (``lag.py``).
            _count(link, "overrides", 100, logging.INFO, "replication to %s is %d version(s) behind: sending past "
                   "the training's windows", holder, behind)
        if capped:
            self._take_tokens(link, nbytes, rate)
        else:  # unpaced, as naive sending: a cap at the estimate would also keep the estimate from rising
            with self._lock:
                link.tokens, link.refilled = 0.0, self.clock()
        if windows:  # the window last: the rate cap's wait must not carry a chunk into a collective
            self._wait_for_window(nbytes / max(link.estimate, 1.0), link)
        else:
            self.timeline.observe()
        self.timeline.chunk(link, nbytes, self.wall())
        waited = self.clock() - start
        with self._lock:
            link.waited += waited
            link.sent_bytes += nbytes
        return waited

    def _time_to_next_commit(self) -> float | None:
        """Seconds until the workers' next commit is due (the newest commit plus the median of the last
        steps), less ``DUE_GUARD``; None before two commits are marked."""
        commits = self.busy()[2]
        if len(commits) < 2:
            return None
        recent = commits[-6:]
        steps = sorted(b - a for a, b in zip(recent, recent[1:]) if b > a)
        if not steps:
            return None
        return commits[-1] + steps[len(steps) // 2] - DUE_GUARD - self.wall()

    def _wait_for_window(self, seconds: float, link: LinkState) -> None:
        """Returns once nothing of the training is on the wire, nor predicted before a chunk of ``seconds``
        would be through (behind what ``link`` has on the wire already)."""
        give_up = self.clock() + 2.0  # a stale or wrong prediction must not stall replication
        while self.clock() < give_up:
            if self.held is not None and self.held():  # the collectives wait for a rank held for this push
                return
            marks = self.busy()
            self.timeline.observe(marks)
            inflight, intervals, commits = marks
            now = self.wall()
            through = max(now, link.wire_until) + seconds + GUARD
            until = predicted_busy_until(now, through, intervals, commits)
            if until is None and self.predicted is not None:  # no marks: the profiled timelines
                until = next((e for s, e in self.predicted() if s < through and e > now), None)
            if not inflight and until is None:
                return
            # on the wire now: until its predicted end, else a poll; predicted: until it is over
            self.sleep(min(max((until or 0.0) - now, POLL), 0.05))

    def _take_tokens(self, link: LinkState, nbytes: int, rate: float) -> None:
        burst = max(rate * BURST_SECONDS, float(nbytes))
        while True:
            with self._lock:  # ranks of one node push to the same holder from their own threads
                now = self.clock()
                link.tokens = min(burst, link.tokens + (now - link.refilled) * rate)
                link.refilled = now
                if link.tokens >= nbytes - 1e-3:  # float rounding must not leave it a hair short forever
                    link.tokens -= nbytes
                    return
                short = nbytes - link.tokens
            self.sleep(min(max(short / rate, 1e-4), 0.05))

    def after_push(self, holder: str, nbytes: int, seconds: float, held: float = 0.0) -> None:
        """A push of ``nbytes`` took ``seconds``, of which the scheduler held it ``held``.

        The estimate follows ``nbytes / (seconds - held)``. Under pacing that overstates the link (up
        to 2x at 100 Mbit/s in the FSDP2 bench: a chunk drains from the socket's buffers while the
        scheduler holds the next), and the whole time would understate it and, capped by the share,
        could never rise again after a slow first push; hence ``link_bytes_per_s`` where the rate is
        known.
        """
        link = self._link(holder)
        if not link.estimate:
            measured = nbytes / max(seconds, 1e-3)
            log.info("link to %s: %.1f MB/s from the first push (%d bytes)", holder, measured / 1e6, nbytes)
            link.estimate = measured
        elif not self.link_bytes_per_s:
            link.estimate = (1 - EWMA) * link.estimate + EWMA * nbytes / max(seconds - held, 1e-3)
        if seconds > 0:
            link.paced = (1 - EWMA) * link.paced + EWMA * max(seconds - held, 0.0) / seconds


def _count(link: LinkState, counter: str, every: int, level: int, message: str, *args) -> None:
    """Counts a chunk in ``link.<counter>``; logs the first and every ``every``-th."""
    n = getattr(link, counter) + 1
    setattr(link, counter, n)
    if n == 1 or n % every == 0:
        log.log(level, message + " (%d chunks so far)", *args, n)
