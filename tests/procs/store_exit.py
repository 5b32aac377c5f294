"""Two ranks' last calls on the job's store at a clean exit (``Job.leave``). Rank 0 hosts the store, as torchrun's
rank 0 does when its workers do not share the agent's, and its process ends the moment it is done; rank 1 makes one
more call after the exit barrier, late (a node's daemon writing the job's last versions), then leaves. Without the
hand-over (``--no-leave``) rank 1 makes that call once rank 0's process is gone.

    python tests/procs/store_exit.py OUT RANK [--no-leave]

Rank 0 writes its store's port to OUT/port and prints whether rank 1's late call reached the store.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ffstate.startup import collector_paused, exit_now  # noqa: E402

with collector_paused():  # imports without Python's collector: a process start's CPU (ffstate/startup.py)
    import torch.distributed as dist

    from ffstate.config import Config
    from ffstate.job import Job


def main() -> None:
    out, rank, leave = Path(sys.argv[1]), int(sys.argv[2]), "--no-leave" not in sys.argv
    deadline = time.monotonic() + 30
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
        (out / "pid0").write_text(str(os.getpid()))
        (out / "port.tmp").write_text(str(store.port))
        (out / "port.tmp").rename(out / "port")
    else:
        while not (out / "port").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        store = dist.TCPStore("127.0.0.1", int((out / "port").read_text()), 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    job = Job(Config(job_id=out.name, token="t"))
    reached = job.barrier("exit")
    if rank == 1:  # late: half a second, or (without the hand-over) until rank 0's process is gone, as under load
        # it can be
        time.sleep(0.5)
        while not leave and Path(f"/proc/{(out / 'pid0').read_text()}").exists() and time.monotonic() < deadline + 60:
            time.sleep(0.05)
        job.store.add(job.key("late"), 1)  # a call that waits for the store's answer
    if leave:
        job.leave(reached - 1, 60.0)
    if rank == 0:
        print(f"rank 1's late call reached the store: {job.store.check([job.key('late')])}", flush=True)
    exit_now(0)  # at once: the store goes with rank 0's process


if __name__ == "__main__":
    main()
