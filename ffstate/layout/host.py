"""Host byte buffers without torch: the daemon's, and the NumPy arrays under the training side's tensors."""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

HUGE_BYTES = 8 << 20  # buffers from this size up are mapped on their own, in huge pages where the kernel allows


def empty_array(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 buffer for a decoded version, faulted in by 2 MiB pages where the kernel's transparent
    huge pages allow it (``madvise``, their default setting): its first writes, which the decoder makes while the
    rest of the version is on the wire, fault 512 times less often (a 40 MB buffer written once: about 9 ms of page
    faults, 3 with huge pages, on this project's machine). Smaller ones, or where mapping fails, come from NumPy's
    allocator."""
    if nbytes >= HUGE_BYTES:
        try:
            m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE here: small pages
                m.madvise(mmap.MADV_HUGEPAGE)
            return np.frombuffer(m, dtype=np.uint8)  # unmapped when the last view goes
        except (OSError, ValueError):
            pass
    return np.empty(nbytes, dtype=np.uint8)
