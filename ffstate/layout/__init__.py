"""A nested training state <-> a manifest (plain, JSON-able data) plus one flat byte buffer.

The buffer holds every tensor's bytes, grouped by dtype so that each group is a run of equal-sized
elements (the codec splits a group into byte planes). Offsets are 64-byte aligned and the padding
is zero. The manifest carries the structure (dicts, lists, tuples, keys), every Python scalar
(floats by their bit pattern, so -0.0 and NaN payloads survive), and each tensor's name, dtype,
shape and offset. It is never pickle: it is safe to build from untrusted bytes (docs/design.md I6).

The *layout* of a manifest is everything except the scalar values and devices; two states with the
same layout (same ``layout_id``) can be delta-encoded against each other.

The package: ``manifest`` (the plain-data description and its validation), ``tree`` (walking a state),
``buffers`` (bytes in and out of the flat buffer), ``gc`` (the collector paused over large walks), ``dtypes`` (the
wire names as torch's dtypes), ``host`` (host buffers without torch). ``manifest`` is all the daemon needs: the
names from torch's side are imported when first used.
"""

from typing import TYPE_CHECKING

from ffstate import lazy
from ffstate.layout.gc import gc_paused
from ffstate.layout.manifest import (ALIGN, DTYPE_SIZES, MAX_NDIM, MAX_TENSORS, Group, Manifest, TensorSpec,
                                     build_manifest, diff_layouts, per_layout)

if TYPE_CHECKING:
    from ffstate.layout.buffers import (alloc_buffer, array_bytes, copy_bits, empty_buffer, empty_leaves, finish_leaves,
                                        iter_placed, leaf_bytes, materialize, tensor_view)
    from ffstate.layout.dtypes import DTYPE_NAMES, DTYPES
    from ffstate.layout.tree import (_match_known, analyze, analyze_known, decode_scalar, describe, encode_scalar,
                                     flatten, is_parameter, unflatten)

# The names that need torch, imported on first use: the daemon reads manifests without it (a second a process).
_TORCH_SIDE = {
    "ffstate.layout.buffers": ("alloc_buffer", "array_bytes", "copy_bits", "empty_buffer", "empty_leaves",
                               "finish_leaves", "iter_placed", "leaf_bytes", "materialize", "tensor_view"),
    "ffstate.layout.dtypes": ("DTYPE_NAMES", "DTYPES"),
    "ffstate.layout.tree": ("_match_known", "analyze", "analyze_known", "decode_scalar", "describe", "encode_scalar",
                            "flatten", "is_parameter", "unflatten"),
}
__getattr__, __dir__ = lazy.attach(globals(), {name: module for module, names in _TORCH_SIDE.items() for name in names})


__all__ = ["ALIGN", "DTYPES", "DTYPE_NAMES", "DTYPE_SIZES", "Group", "MAX_NDIM", "MAX_TENSORS", "Manifest",
           "TensorSpec", "_match_known", "alloc_buffer", "analyze", "analyze_known", "array_bytes", "build_manifest",
           "copy_bits", "decode_scalar", "describe", "diff_layouts", "empty_buffer", "empty_leaves", "encode_scalar",
           "finish_leaves", "flatten", "gc_paused", "is_parameter", "iter_placed", "leaf_bytes", "materialize",
           "per_layout", "tensor_view", "unflatten"]
