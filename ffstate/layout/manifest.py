"""The manifest: a state's structure, its scalars and where each tensor lives in the flat buffer (dtype groups,
64-byte aligned offsets), as plain data. It is never pickle: ``Manifest.from_json`` builds one from untrusted
bytes, bounded and validated (docs/design.md I6). The *layout* is everything but the scalar values and devices;
two states of one ``layout_id`` can be delta-encoded against each other."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ffstate.errors import CodecError
from ffstate.layout.gc import gc_paused

# 64 bytes: one cache line, and a multiple of every dtype's size, so any offset can be viewed as any dtype.
ALIGN = 64

# The dtypes a snapshot can hold, by their wire name, with their element sizes in bytes (``dtypes.py`` maps the names
# to torch's dtypes: the daemon, which only checks manifests, runs without torch). Order is irrelevant; names are the
# contract.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16, "int64": 8,
    "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8,
}

# Bounds on a manifest built from untrusted bytes (I6); generous for any real model.
MAX_TENSORS = 1 << 22
MAX_NDIM = 64


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor (or numpy array) lives in the flat buffer.

    ``kind`` is ``tensor``, ``param`` (an ``nn.Parameter``) or ``ndarray`` (stored as raw bytes in
    the ``uint8`` group, with ``np_dtype`` saying how to view them).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    kind: str = "tensor"
    np_dtype: str | None = None
    device: str = "cpu"
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Group:
    """A run of the buffer holding every tensor of one dtype: ``[offset, offset + nbytes)``."""

    dtype: str
    itemsize: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """Structure, scalars and tensor placement of one state. Plain data: see ``to_json``."""

    tree: Any
    tensors: tuple[TensorSpec, ...]
    scalars: tuple[Any, ...]
    groups: tuple[Group, ...]
    nbytes: int
    layout_id: str

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "tree": self.tree,
                "tensors": [
                    [t.name, t.dtype, list(t.shape), t.offset, t.kind, t.np_dtype, t.device, t.requires_grad]
                    for t in self.tensors
                ],
                "scalars": list(self.scalars),
            },
            separators=(",", ":"),
        ).encode()

    @staticmethod
    def from_json(data: bytes | memoryview) -> "Manifest":
        """Parses and validates a manifest from untrusted bytes; raises CodecError when malformed."""
        with gc_paused():
            return Manifest._from_json(data)

    @staticmethod
    def _from_json(data: bytes | memoryview) -> "Manifest":
        try:
            obj = json.loads(bytes(data))
            if len(obj["tensors"]) > MAX_TENSORS:
                raise CodecError(f"manifest lists {len(obj['tensors'])} tensors, more than the limit {MAX_TENSORS}")
            specs = [_spec_from_json(row) for row in obj["tensors"]]
            tree, scalars = obj["tree"], tuple(obj["scalars"])
            _check_tree(tree, len(specs), len(scalars))
            manifest = build_manifest(tree, specs, scalars)
        except CodecError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as e:
            raise CodecError(f"malformed manifest: {e!r}") from e
        for got, want in zip(specs, manifest.tensors):
            if got.offset != want.offset:
                raise CodecError(f"manifest places {got.name!r} at byte {got.offset}, its layout says {want.offset}")
        return manifest

    def with_scalars(self, scalars: Sequence[Any]) -> "Manifest":
        """The same layout with other scalar values (a delta ships only the scalars)."""
        if len(scalars) != len(self.scalars):
            raise CodecError(f"expected {len(self.scalars)} scalars for layout {self.layout_id}, got {len(scalars)}")
        return Manifest(self.tree, self.tensors, tuple(scalars), self.groups, self.nbytes, self.layout_id)


def _spec_from_json(row: list) -> TensorSpec:
    name, dtype, shape, offset, kind, np_dtype, device, requires_grad = row
    if dtype not in DTYPE_SIZES:
        raise CodecError(f"tensor {name!r} has unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}")
    if kind not in ("tensor", "param", "ndarray"):
        raise CodecError(f"tensor {name!r} has unknown kind {kind!r}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CodecError(f"tensor {name!r} has an invalid shape {shape!r}")
    if kind == "ndarray":
        try:
            np.dtype(np_dtype)
        except TypeError as e:
            raise CodecError(f"array {name!r} has an invalid numpy dtype {np_dtype!r}") from e
    return TensorSpec(str(name), dtype, tuple(shape), int(offset), 0, kind, np_dtype, str(device), bool(requires_grad))


def _check_tree(node: Any, n_tensors: int, n_scalars: int) -> None:
    """Every leaf of an untrusted tree must name an existing tensor or scalar slot."""
    stack = [node]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise CodecError(f"malformed manifest tree node {str(node)[:80]!r}")
        if "T" in node or "S" in node:
            idx, limit = (node["T"], n_tensors) if "T" in node else (node["S"], n_scalars)
            if not isinstance(idx, int) or not 0 <= idx < limit:
                raise CodecError(f"manifest tree refers to slot {idx!r} of {limit}")
        elif "d" in node or "o" in node:
            stack.extend(child for _, child in node.get("d", node.get("o")))
            if "m" in node:
                stack.append(node["m"])
        elif "l" in node or "t" in node:
            stack.extend(node.get("l", node.get("t")))
        elif "z" not in node or not all(isinstance(d, int) and d >= 0 for d in node["z"]):
            raise CodecError(f"malformed manifest tree node {str(node)[:80]!r}")


def build_manifest(tree: Any, specs: Sequence[TensorSpec], scalars: Sequence[Any]) -> Manifest:
    """Places tensors into dtype groups (first-seen order) and computes the layout id."""
    by_dtype: dict[str, list[int]] = {}
    for i, s in enumerate(specs):
        by_dtype.setdefault(s.dtype, []).append(i)
    placed: list[TensorSpec | None] = [None] * len(specs)
    groups = []
    offset = 0
    for dtype, members in by_dtype.items():
        itemsize = DTYPE_SIZES[dtype]
        start = offset
        for i in members:
            s = specs[i]
            nbytes = s.numel * (np.dtype(s.np_dtype).itemsize if s.kind == "ndarray" else itemsize)
            placed[i] = TensorSpec(s.name, s.dtype, s.shape, offset, nbytes, s.kind, s.np_dtype, s.device, s.requires_grad)
            offset = _align(offset + nbytes)
        groups.append(Group(dtype, itemsize, start, offset - start))
    final = tuple(p for p in placed if p is not None)
    ident = json.dumps(
        [tree, [[s.name, s.dtype, list(s.shape), s.kind, s.np_dtype] for s in final]], separators=(",", ":")
    )
    layout_id = hashlib.sha256(ident.encode()).hexdigest()[:32]
    return Manifest(tree, final, tuple(scalars), tuple(groups), offset, layout_id)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def diff_layouts(a: Manifest, b: Manifest) -> str:
    """A one-line description of the first difference between two layouts (for error messages)."""
    if len(a.tensors) != len(b.tensors):
        names_a, names_b = {t.name for t in a.tensors}, {t.name for t in b.tensors}
        extra, missing = sorted(names_a - names_b)[:3], sorted(names_b - names_a)[:3]
        return f"{len(a.tensors)} tensors vs {len(b.tensors)} (only in the first: {extra}, only in the second: {missing})"
    for ta, tb in zip(a.tensors, b.tensors):
        if (ta.name, ta.dtype, ta.shape, ta.kind, ta.np_dtype) != (tb.name, tb.dtype, tb.shape, tb.kind, tb.np_dtype):
            return (
                f"tensor {ta.name!r} {ta.dtype}{list(ta.shape)} vs {tb.name!r} {tb.dtype}{list(tb.shape)}"
            )
    return "the nesting (keys, containers or the position of scalars) differs"


def per_layout(cache: dict[str, Any], manifest: Manifest, build: Any) -> Any:
    """``build(manifest)``, computed once per layout id (the id covers the names, dtypes, shapes and kinds)
    and kept in ``cache``: what every commit of a layout needs again. A process sees a few layouts at most."""
    got = cache.get(manifest.layout_id)
    if got is None:
        got = build(manifest)
        if len(cache) >= 16:
            cache.clear()
        cache[manifest.layout_id] = got
    return got
