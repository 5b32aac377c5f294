"""Pushes a full version, commits it, then streams the next version's delta slowly, to be SIGKILLed mid-stream.

    python tests/procs/pusher.py ADDRESS JOB

Prints "committed 1", then "streaming" once the first chunks of version 2 are on the wire.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ffstate.startup import collector_paused  # noqa: E402

with collector_paused():  # imports without Python's collector: a process start's CPU (ffstate/startup.py)
    from ffstate import codec
    from ffstate.client import Client
    from helpers import train_states


def main() -> None:
    address, job = sys.argv[1], sys.argv[2]
    s1, s2 = list(train_states(2))
    client = Client(address, os.environ["FFSTATE_TOKEN"], small_push_bytes=0)  # streamed, however small
    client.push_and_commit(job, 0, 1, 1, codec.encode(s1, chunk_bytes=64 << 10))
    print("committed 1", flush=True)
    sent = 0

    def slow(nbytes: int) -> None:
        nonlocal sent
        sent += 1
        if sent == 3:
            print("streaming", flush=True)
        if sent >= 3:
            time.sleep(1.0)

    client.push(job, 0, 1, 2, codec.encode(s2, s1, chunk_bytes=64 << 10), base_version=1, before_chunk=slow)
    print("pushed 2 (should have been killed)", flush=True)


if __name__ == "__main__":
    main()
