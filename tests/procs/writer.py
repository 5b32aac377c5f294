"""A local worker for the daemon tests: attaches to a daemon and commits AdamW training states.

    python tests/procs/writer.py ADDRESS JOB RANK WORLD STEPS [--from N | --resume-at N] [--die-mid-write V]
                                 [--dump F]

Commits the states of ``helpers.train_states`` (deterministic) for versions N+1..STEPS, notifying
the daemon after each, and prints "committed V" lines. ``--resume-at N`` attaches as a worker restored to
v* = N does (the daemon discards the slots' versions past N). ``--die-mid-write V`` SIGKILLs this process
half-way through writing version V (the slot's sequence number odd, half its bytes new).
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ffstate.startup import collector_paused  # noqa: E402

with collector_paused():  # imports without Python's collector: a process start's CPU (ffstate/startup.py)
    from ffstate import codec, layout, shm
    from ffstate.client import Client
    from ffstate.commit import SlotWriter
    from helpers import train_states


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("job")
    p.add_argument("rank", type=int)
    p.add_argument("world", type=int)
    p.add_argument("steps", type=int)
    p.add_argument("--from", dest="start", type=int, default=0)
    p.add_argument("--resume-at", type=int, default=0, help="attach as a worker restored to this version, and go on")
    p.add_argument("--die-mid-write", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-replicated", action="store_true", help="after each commit, wait until every holder has it")
    p.add_argument("--wait-taken", action="store_true",
                   help="before overwriting a slot, wait until the daemon has read it (the block policy)")
    p.add_argument("--dump", help="torch.save the states here first (the test's expected values)")
    a = p.parse_args()
    states = list(train_states(a.steps, seed=a.seed))
    if a.dump:
        import torch

        torch.save(states, a.dump)
    manifest = layout.describe(states[0])
    client = Client(a.address, os.environ["FFSTATE_TOKEN"])
    if a.resume_at:
        a.start = a.resume_at
    resp = client.attach(a.job, a.rank, a.world, manifest, discard_after=a.resume_at or None)
    slots = shm.Slots(list(resp.slot_paths), manifest)
    writer = SlotWriter(slots)
    print(f"attached {resp.committed_version}", flush=True)
    for version in range(a.start + 1, a.steps + 1):
        if version == a.die_mid_write:
            real = codec.pack_into

            def torn(state, out, m=None, **kw):
                real(state, out, m, **kw)  # the whole state is written but the header is not: die now,
                out[: out.numel() // 2].zero_()  # with half the bytes clobbered for good measure
                os.kill(os.getpid(), signal.SIGKILL)

            codec.pack_into = torn
        writer.commit(states[version - 1], version, wait=5.0 if a.wait_taken else 0.0)
        client.notify_commit(a.job, a.rank, a.world, version)
        print(f"committed {version}", flush=True)
        deadline = time.monotonic() + 60
        while a.wait_replicated and time.monotonic() < deadline:
            mine = [s for s in client.inventory(a.job).shards if s.local and s.shard.rank == a.rank]
            if mine and mine[0].replicated_version >= version:
                break
            time.sleep(0.02)


if __name__ == "__main__":
    main()
