"""The job's coordination through its torch.distributed store: who this rank is, the attempt every rank
agrees on, the keys it writes under, a barrier, the published replicated versions (whose minimum over
ranks is the job's global committed version, docs/design.md section 4, step 5), the node daemons' addresses,
and the job's event log. One place, so that the trainer, recovery and the razor never build a key."""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ffstate import placement
from ffstate.client import Client
from ffstate.config import Config
from ffstate.daemon import running
from ffstate.errors import FFStateError

log = logging.getLogger("ffstate.job")


def timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class Job:
    """One rank's view of the job: ``rank``, ``world``, ``job`` (its id), ``token``, ``topology``, ``attempt``,
    ``store`` (None in a single process, where every collective step is trivial) and ``run_dir``."""

    def __init__(self, cfg: Config, device: torch.device | None = None):
        self.cfg = cfg
        self.device = device  # the GPU the training is on, if one (``capture.model_device``)
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self.store = dist.distributed_c10d._get_default_store()
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise FFStateError("WORLD_SIZE > 1 but no process group: call torch.distributed.init_process_group() "
                               "before ffstate.replicate(...)")
        else:
            self.rank, self.world, self.store = 0, 1, None
        warn_about_torchrun_restarts()
        self.job = job_id(cfg)
        self.topology = placement.topology(self.rank, self.world, cfg)
        # torchrun's restart count, or the in-process engine's restart (ffstate/inprocess/), in the job's events
        self.attempt = int(os.environ.get("FFSTATE_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        # Whether the watchdog watches a rank that left ffstate.replicate with an error, until it exits or enters again:
        # launched by torchrun's agent, run by the in-process engine (which enters again in the same process), or one
        # of several ranks. A single process without a launcher may go on with other work (a notebook, a caught error).
        self.watched_after_error = bool(os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("FFSTATE_ATTEMPT")
                                        or self.world > 1)
        self.generation = self._generation()  # this attempt's name, the same on every rank
        self.prefix = f"ffstate/{self.job}/{self.generation}"
        self.run_dir = running.run_dir(self.job)
        self.token = self._token()
        self.global_committed = 0  # min over ranks of the version all their holders have, as last seen
        self._clients: dict[str, Client] = {}

    def _generation(self) -> str:
        """A name for this attempt that every rank agrees on: rank 0's random number, broadcast.

        Not torchrun's restart count: in a multi-node job each node's agent counts its own restarts
        (a node that did not fail restarts its workers without counting), so ranks on different nodes
        would read and write different keys, or an earlier attempt's.
        """
        if self.store is None:
            return "0"
        nonce = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        if dist.get_backend() == "nccl":  # on the rank's GPU: the current device is cuda:0 where none was set
            cuda = self.device is not None and self.device.type == "cuda"
            nonce = nonce.to(self.device if cuda else torch.device("cuda", torch.cuda.current_device()))
        dist.broadcast(nonce, 0)
        return f"{int(nonce.item()):x}"

    def _token(self) -> str:
        """The job's token: the one the user set (``Config.token``, ``FFSTATE_TOKEN``, ``Config.token_file``), else
        one the ranks agree on through the store: the token some node kept from an earlier attempt (its daemons
        hold it; the lowest rank's counts), else a new one of rank 0's. Each node keeps it in its run folder."""
        if self.cfg.token:
            return self.cfg.token
        if self.cfg.token_file:
            token = Path(self.cfg.token_file).read_text().strip()
            if not token:
                raise FFStateError(f"{self.cfg.token_file} (Config.token_file) is empty")
            return token
        if self.store is None:
            return default_token()
        kept_file = self.run_dir / "token"
        kept = kept_file.read_text().strip() if kept_file.exists() else ""
        told = self.exchange("token", {"kept": kept, "new": secrets.token_hex(16) if self.rank == 0 else ""},
                             range(self.world), self.cfg.connect_timeout)
        token = next((t["kept"] for t in told if t["kept"]), told[0]["new"])
        if token != kept:
            tmp = kept_file.with_name(f"token.{self.rank}.tmp")
            fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token)
            os.replace(tmp, kept_file)  # atomic: the node's ranks write the same token
        return token

    def key(self, *parts: Any) -> str:
        """A store key of this attempt, e.g. ``key("razor", step, rank)``."""
        return "/".join([self.prefix, *map(str, parts)])

    # ------------------------------------------------------------ exchanges

    def exchange(self, name: str, value: Any, ranks: list[int] | range, timeout: float) -> list[Any]:
        """Publishes this rank's JSON ``value`` under ``name`` and returns every one of ``ranks``' values."""
        if self.store is None:
            return [value]
        self.store.set(self.key(name, self.rank), json.dumps(value))
        keys = [self.key(name, r) for r in ranks]
        self.wait(keys, timeout, f"exchange {name!r}")
        return [json.loads(v) for v in self.store.multi_get(keys)]

    def wait(self, keys: list[str], timeout: float, what: str) -> None:
        """``wait_for`` on the job's store, as this rank.

        Raises:
            DistStoreError: some keys were still missing at the timeout (the message names them).
        """
        wait_for(self.store, keys, timeout, f"rank {self.rank}: {what}")

    def barrier(self, name: str, more: float = 0.0) -> int:
        """Waits (at most ``exit_timeout`` + ``more`` seconds) until every rank reached the barrier ``name``; returns
        how many had (``world`` unless it timed out)."""
        if self.store is None:
            return 1
        key = self.key("barrier", name)
        self.store.add(key, 1)
        deadline = time.monotonic() + self.cfg.exit_timeout + more
        while (reached := int(self.store.add(key, 0))) < self.world and time.monotonic() < deadline:
            time.sleep(0.02)
        return reached

    def leave(self, others: int, timeout: float) -> None:
        """This rank's last call on the job's store, at a clean exit. The store can live in rank 0's process
        (torchrun's workers host it when they do not share its agent's: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``),
        and a rank 0 that ended first would take it away under the others' last calls (a barrier's polling ended
        in "Connection reset by peer", and torchrun restarted a job that had finished). So every other rank says it
        is done with the store, and rank 0 returns once ``others`` have (the ranks that reached the exit barrier,
        less itself), or after ``timeout`` seconds. A rank that finds the store gone says so and goes on: its job
        has ended."""
        if self.store is None:
            return
        key = self.key("left")
        if self.rank != 0:
            try:
                self.store.add(key, 1)
            except RuntimeError as e:  # torch's DistNetworkError: rank 0's process ended first
                log.warning("rank %d: the job's store was gone at its last call (%s): rank 0 left first", self.rank, e)
            return
        deadline = time.monotonic() + timeout
        while (left := int(self.store.add(key, 0))) < others:
            if time.monotonic() > deadline:
                log.warning("rank 0: leaving the job's store (which its process may host) before %d of %d other "
                            "ranks said they were done with it (waited %.0f s)", others - left, others, timeout)
                return
            time.sleep(0.01)

    def mark(self, name: str) -> None:
        """Says, under ``name``, that this rank got somewhere (``all_marked`` asks whether every rank did)."""
        if self.store is not None:
            self.store.set(self.key(name, self.rank), "1")

    def all_marked(self, name: str) -> bool:
        """Whether every rank has ``mark``ed ``name`` (one store call, no wait)."""
        return self.store is None or self.store.check([self.key(name, r) for r in range(self.world)])

    def publish_replicated(self, version: int) -> None:
        """Publishes the newest version every holder of this rank has; updates ``global_committed``, the
        minimum over the ranks that published."""
        if self.store is None:
            self.global_committed = version
            return
        self.store.set(self.key("replicated", self.rank), str(version))
        keys = [self.key("replicated", r) for r in range(self.world)]
        if self.store.check(keys):
            self.global_committed = min(int(v) for v in self.store.multi_get(keys))

    # ------------------------------------------------------------ daemons

    def client(self, address: str) -> Client:
        """One client per daemon address, closed by ``close``."""
        if address not in self._clients:
            self._clients[address] = Client(address, self.token, timeout=30.0)
        return self._clients[address]

    def publish_daemon(self, node: int, address: str) -> None:
        if self.store is not None:
            self.store.set(self.key("daemon", node), address)

    def daemon_addresses(self, nodes: list[int]) -> list[str]:
        """Where the daemons of ``nodes`` listen, as their first ranks published it (waits for them)."""
        if self.store is None:
            return [placement.daemon_address(n, self.cfg) for n in nodes]
        keys = [self.key("daemon", n) for n in nodes]
        if keys:
            self.wait(keys, self.cfg.connect_timeout * 2, "the daemons' addresses of nodes "
                      f"{nodes} (published by each node's first rank)")
        return [self.store.get(k).decode() for k in keys]

    # ------------------------------------------------------------ events

    def record(self, event: dict) -> None:
        """Appends an event (restore, ...) to the job's run folder, for the demo and for operators."""
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps({**event, "rank": self.rank, "attempt": self.attempt}) + "\n")

    def close(self) -> None:
        for c in self._clients.values():
            c.close()


def job_id(cfg: Config) -> str:
    """The job's id: ``Config.job_id``, else torchrun's run id, else Slurm's job id, made safe for file and key
    names."""
    raw = cfg.job_id or os.environ.get("TORCHELASTIC_RUN_ID", "") or os.environ.get("SLURM_JOB_ID", "") or "ffstate-job"
    if raw == "none":
        raw = "ffstate-job"
    return re.sub(r"[^A-Za-z0-9._-]", "-", raw)[:128]


def default_token() -> str:
    """$FFSTATE_TOKEN, else a per-user secret (created once, mode 0600): enough on one machine."""
    token = os.environ.get("FFSTATE_TOKEN")
    if token:
        return token
    path = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "ffstate" / "token"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16))
    except FileExistsError:
        pass
    for _ in range(50):  # another rank may be writing it right now
        token = path.read_text().strip()
        if token:
            return token
        time.sleep(0.02)
    raise FFStateError(f"{path} is empty: remove it, or set FFSTATE_TOKEN")


def warn_about_torchrun_restarts() -> None:
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        log.warning("torchrun without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: after a restart, gloo's "
                    "init_process_group hangs or fails ('Gloo connectFullMesh failed', pytorch/pytorch#135712). "
                    "Launch as: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ...")


def wait_for(store: dist.Store, keys: list[str], timeout: float, what: str, longest: float = 30.0) -> None:
    """Waits until every one of ``keys`` is in ``store``, at most ``timeout`` seconds, in slices growing from 1 s
    to ``longest``: a wait inside the store's C++ holds an exception raised into this thread from another (the
    in-process engine's restart, after a failure elsewhere) until it returns, and every survivor with it (torch logs
    a warning for each slice that ends empty, so they grow where a long wait is no failure).

    Raises:
        DistStoreError: some keys were still missing at the timeout (the message, ``what`` first, names them).
    """
    deadline, piece = time.monotonic() + timeout, min(1.0, longest)
    while True:
        try:
            store.wait(keys, timedelta(max(0.001, min(piece, deadline - time.monotonic()))))
            return
        except dist.DistStoreError:
            if time.monotonic() >= deadline:
                missing = [k.rsplit("/", 1)[-1] for k in keys if not store.check([k])]
                raise dist.DistStoreError(f"{what}: {len(missing)} of {len(keys)} not in the job's store after "
                                          f"{timeout:.0f} s: {missing[:8]}") from None
            piece = min(piece * 2, longest)
