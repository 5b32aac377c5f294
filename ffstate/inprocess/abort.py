"""Stopping a process group that waits on a dead peer, so that the surviving ranks can leave the step at once.

NCCL has an abort, which NVIDIA's resiliency extension calls. gloo has none that works: in torch 2.13 neither
``ProcessGroup.abort()`` nor ``shutdown()`` nor ``destroy_process_group()`` releases a collective blocked on a peer
that died; it waits out its timeout (measured: 5.1 s with a 5 s timeout). Shutting the group's connected sockets
down does: the blocked operation fails at once ("connection closed by peer") and a new group on a fresh store prefix
starts in tens of milliseconds. The sockets are those ``init_process_group`` opened (the process's socket
descriptors before and after it); gloo's listening socket is left alone (shutting it down aborts the process).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import torch.distributed as dist
from nvidia_resiliency_ext.inprocess.abort import Abort, AbortTorchDistributed

log = logging.getLogger("ffstate.inprocess")


def open_sockets() -> set[int]:
    """The file descriptors of this process's sockets."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                out.add(int(name))
        except OSError:  # closed meanwhile
            pass
    return out


class GroupAbort(Abort):
    """The engine's abort (it runs in the engine's monitor thread while the training's thread may be inside a
    collective): NCCL groups by the extension's own abort; gloo groups by shutting down their sockets, then the
    group is destroyed."""

    def __init__(self) -> None:
        self._sockets: set[int] = set()
        self._nccl = AbortTorchDistributed()

    def opened(self, sockets: set[int]) -> None:
        """The sockets the current process group opened."""
        self._sockets = set(sockets)

    def __call__(self, state: Any) -> Any:
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            return self._nccl(state)
        start = time.perf_counter()
        shut = 0
        for fd in sorted(self._sockets):
            try:
                s = socket.socket(fileno=fd)
            except OSError:  # gone already
                continue
            try:
                if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    s.shutdown(socket.SHUT_RDWR)
                    shut += 1
            except OSError:
                pass
            finally:
                s.detach()  # the descriptor stays gloo's: it closes it when the group goes
        self._sockets = set()
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # the group is gone either way; say why it did not go cleanly
                log.warning("destroying the process group after a failure: %s", e)
        log.info("aborted the process group in %.0f ms (%d sockets shut down)", (time.perf_counter() - start) * 1e3, shut)
        return state
