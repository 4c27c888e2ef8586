"""The bundle: one rank's payloads framed for one allgather, and its reader.

A bundle carries the payloads of one rank's gradients for one step; the
:mod:`deepreduce.exchange` allgathers the bundles of all ranks, whatever their
lengths, and splits them again here. Layouts (``docs/format.md`` has the details)::

    version 1: magic "DRB" | 1 | payload count m | m payload lengths | the payloads
    version 3: magic "DRB" | 3 | m | m payload lengths | tensor count T
               | T payload numbers | ranks, then dimensions, of the tensors that share
               a payload | CRC32 of all of this | the payloads

(every count, length, number and dimension a varint; version 2 is version 3
without the CRC32, read but no longer written). In version 1 payload ``i`` is
tensor ``i``. Version 3, written when tensors share a payload, says which
payload holds each tensor; a payload holding several is their concatenation,
flattened, in tensor order. Each payload is a complete deepreduce container
(with its own CRC32), so a version-1 bundle needs no checksum of its own; the
framing is checked strictly and every inconsistency raises
:class:`~deepreduce.DecodeError`.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib

import numpy as np

from deepreduce.bits import read_varint, varint_decode_prefix, varint_encode, write_varint
from deepreduce.errors import DecodeError
from deepreduce.sparse import SparseTensor
from deepreduce.sums import localize_sorted

BUNDLE_MAGIC = b"DRB"
#: Bundle layouts this module reads; it writes version 1 unless tensors share a payload
#: (then 3). Version 2, version 3 without the checksum of its table, was written only on
#: 2026-11-26: its payloads' checksums do not cover which tensor is where.
BUNDLE_VERSIONS = (1, 2, 3)
_MAX_VARINT_BYTES = 10
#: Up to this many varints a bundle's field is read one by one.
_FEW_VARINTS = 48
_CRC = struct.Struct("<I")
#: Most dimensions a tensor sharing a payload may have (numpy's limit).
_MAX_DIMS = 64


def pack_bundle(payloads, slots=None, shapes=()) -> bytes:
    """Frame ``payloads`` (bytes-like) into one bundle.

    Parameters
    ----------
    payloads : list of bytes-like
        Each a complete payload.
    slots : list of int, optional
        For each tensor of the bundle, in order, the number of the payload
        that holds it (version 3); None (version 1): payload ``i`` is tensor ``i``.
    shapes : list of tuple
        With ``slots``, the shape of each tensor (in order) whose payload
        holds other tensors too: such a payload is the concatenation of its
        tensors, flattened, in tensor order.

    Examples
    --------
    >>> from deepreduce.bundle import pack_bundle, split_bundles
    >>> data = pack_bundle([b"abc", b""]) + pack_bundle([b"xy", b"z"], [0, 1, 0], [(2,), (3, 1)])
    >>> [([bytes(p) for p in b.payloads], b.slots, b.shapes)
    ...  for b in split_bundles(data, ranks=2)]
    [([b'abc', b''], [0, 1], {}), ([b'xy', b'z'], [0, 1, 0], {0: (2,), 2: (3, 1)})]
    """
    lengths = np.array([len(p) for p in payloads], dtype=np.uint64)
    head = [BUNDLE_MAGIC, bytes((1 if slots is None else 3,)), write_varint(len(payloads)),
            varint_encode(lengths)]
    if slots is not None:
        head.append(_table(len(payloads), slots, shapes))
        head.append(_CRC.pack(zlib.crc32(b"".join(head))))
    return b"".join([*head, *payloads])


#: Tables of version-3 bundles already written, by their payload count, slots and
#: shapes: a training step writes the same ones every time.
_TABLES: dict = {}
_MAX_TABLES = 256


def _table(payloads: int, slots, shapes) -> bytes:
    """The bytes of a version-3 bundle's table between its payload lengths and its CRC."""
    key = (payloads, tuple(int(s) for s in np.asarray(slots).reshape(-1)),
           tuple(tuple(int(d) for d in shape) for shape in shapes))
    table = _TABLES.get(key)
    if table is None:
        slots = np.asarray(key[1], dtype=np.int64)
        if slots.size and (slots.min() < 0 or slots.max() >= payloads) or \
                np.unique(slots).size != payloads:
            raise ValueError(f"slots {slots.tolist()} must name each of the "
                             f"{payloads} payloads")
        sharing = int(np.count_nonzero(np.bincount(slots, minlength=payloads)[slots] > 1))
        shapes = key[2]
        if len(shapes) != sharing:
            raise ValueError(f"{len(shapes)} shapes for the {sharing} tensors that share a "
                             "payload")
        table = b"".join([write_varint(slots.size), varint_encode(slots),
                          varint_encode(np.array([len(s) for s in shapes], dtype=np.uint64)),
                          varint_encode(np.array([d for s in shapes for d in s],
                                                 dtype=np.uint64))])
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        _TABLES[key] = table
    return table


class Bundle:
    """One rank's bundle, as :func:`split_bundles` reads it.

    Attributes
    ----------
    data : memoryview
        The bundle's bytes.
    payloads : list of memoryview
        Its payloads.
    slots : list of int
        For each tensor, in order, the number of the payload holding it.
    shapes : dict
        The shapes of the tensors (by position) that share a payload with
        others; that payload holds their concatenation, flattened, in tensor order.
    """

    __slots__ = ("data", "payloads", "slots", "shapes", "_what", "_shared")

    def __init__(self, data, payloads, slots, shapes, what="bundle"):
        self.data, self.payloads, self.slots, self.shapes = data, payloads, slots, shapes
        self._what, self._shared = what, None

    def tensors(self, decoded, whole=(), parts=None) -> list:
        """Each tensor of the bundle, given its payloads ``decoded``; None for those in the
        payloads ``whole``, which the caller takes whole. ``parts``: by payload, shared
        payloads :meth:`split` already.

        Raises
        ------
        DecodeError
            When a shared payload does not hold exactly its tensors' elements.
        """
        tensors = [decoded[slot] for slot in self.slots]
        for slot, positions in self.shared().items():
            if slot in whole:
                split = [None] * len(positions)
            elif parts is not None and slot in parts:
                split = parts[slot]
            else:
                split = self.split(slot, decoded[slot])
            for t, part in zip(positions, split):
                tensors[t] = part
        return tensors

    def split(self, slot: int, decoded: SparseTensor, overwrite: bool = False) -> list:
        """The tensors of the shared payload ``slot``, given what it ``decoded`` to
        (``overwrite``: in its memory, see :func:`split_shared`)."""
        positions = self.shared()[slot]
        return split_shared(decoded, [self.shapes[t] for t in positions],
                            f"{self._what}, payload {slot}", overwrite)

    def shared(self) -> dict:
        """The payloads that hold several tensors: their positions, in order, by payload."""
        if self._shared is None:
            members = {}
            for position in self.shapes:  # (in tensor order)
                members.setdefault(self.slots[position], []).append(position)
            self._shared = members
        return self._shared


def split_shared(whole: SparseTensor, shapes, what: str = "shared payload",
                 overwrite: bool = False) -> list:
    """The tensors of ``shapes`` whose flattened concatenation ``whole`` holds;
    ``overwrite``: in ``whole``'s memory where it is writable, which is then theirs."""
    ends = list(itertools.accumulate(math.prod(shape) for shape in shapes))
    check_holds(whole, ends[-1] if ends else 0, what)
    local = whole.indices
    if overwrite and local.flags.writeable:
        # (a new array of a large payload's indices, paged in, costs more)
        cuts = localize_sorted(local, ends)
    else:
        cuts = [0, *np.searchsorted(local, ends[:-1]).tolist(), whole.nnz]
        # each entry's tensor start taken off in one pass; the parts are slices of it
        local = local - np.repeat([0, *ends[:-1]], np.diff(cuts))
    trusted = SparseTensor._trusted
    return [trusted(whole.values[low:high], local[low:high], shape)
            for shape, low, high in zip(shapes, cuts, cuts[1:])]


def check_holds(whole: SparseTensor, size: int, what: str) -> None:
    if whole.shape != (size,):
        raise DecodeError(f"{what}: shape {whole.shape} does not hold its tensors' "
                          f"{size} elements")


def split_bundles(data, ranks: int) -> list[Bundle]:
    """Read the concatenation of ``ranks`` bundles, of any version.

    Raises
    ------
    DecodeError
        When the data is not exactly ``ranks`` well-formed bundles.
    """
    view = memoryview(data).cast("B")
    bundles, pos = [], 0
    for rank in range(ranks):
        what, start = f"bundle of rank {rank}", pos
        header_end = pos + len(BUNDLE_MAGIC) + 1
        if bytes(view[pos:pos + len(BUNDLE_MAGIC)]) != BUNDLE_MAGIC or header_end > len(view):
            raise DecodeError(f"{what}: expected magic {BUNDLE_MAGIC!r} at byte {pos} of the "
                              f"{len(view)} gathered bytes, found {bytes(view[pos:pos + 3])!r}")
        version = view[header_end - 1]
        if version not in BUNDLE_VERSIONS:
            raise DecodeError(f"{what}: unsupported bundle version {version}")
        count, pos = read_varint(view, header_end, what)
        lengths, pos = _read_varints(view, pos, count, f"{what} payload lengths")
        if version >= 2:
            slots, shapes, pos = _read_table(view, pos, count, what)
        else:
            slots, shapes = list(range(count)), {}
        if version == 3:
            # the payloads' own checksums do not cover which tensor is where
            if pos + _CRC.size > len(view):
                raise DecodeError(f"{what}: truncated before the checksum of its table")
            if _CRC.unpack_from(view, pos)[0] != zlib.crc32(view[start:pos]):
                raise DecodeError(f"{what}: CRC32 mismatch in its table")
            pos += _CRC.size
        remaining = len(view) - pos
        if sum(lengths) > remaining:  # (Python's integers: an exact sum)
            raise DecodeError(f"{what}: payload lengths add up to more than the {remaining} "
                              "bytes that follow")
        payloads = []
        for length in lengths:
            payloads.append(view[pos:pos + length])
            pos += length
        bundles.append(Bundle(view[start:pos], payloads, slots, shapes, what))
    if pos != len(view):
        raise DecodeError(f"{len(view) - pos} bytes after the {ranks} bundles")
    return bundles


def _read_varints(view, pos: int, count: int, what: str) -> tuple[list, int]:
    """``count`` varints at ``pos`` (a list of ints), refused before anything is sized
    from ``count`` when fewer bytes follow."""
    end = len(view)
    if count > end - pos:
        raise DecodeError(f"{what}: declares {count} values but only {end - pos} "
                          "bytes follow")
    # a Python loop pays per varint, numpy's passes a fixed cost per call that only a
    # long field repays
    if count <= _FEW_VARINTS:
        values = []
        for _ in range(count):
            # one or two bytes (what tables and most payload lengths take) inline: a byte
            # below 0x80, or one from 0x80 on and one from 1 to 0x7f (0 would not be
            # the shortest form); read_varint reads the rest, and says what is wrong
            byte = view[pos] if pos < end else 0x80
            if byte < 0x80:
                values.append(byte)
                pos += 1
                continue
            high = view[pos + 1] if pos + 1 < end else 0
            if 0 < high < 0x80:
                values.append((byte & 0x7F) | high << 7)
                pos += 2
            else:
                value, pos = read_varint(view, pos, what)
                values.append(value)
        return values, pos
    # varint_decode_prefix scans its whole input: give it only the bytes these can
    # occupy, not the payloads behind them
    values, used = varint_decode_prefix(view[pos:pos + _MAX_VARINT_BYTES * count], count, what)
    return values.tolist(), pos + used


#: Tables of versions 2 and 3 read before, by their payload count and bytes: a training
#: step receives the same ones every time (see :func:`_read_table`).
_READ_TABLES: dict = {}
#: The lengths of those tables, by payload count, to look them up by.
_READ_TABLE_LENGTHS: dict = {}
_MAX_READ_TABLES = 256
#: Most lengths a lookup tries (tables of other lengths are read afresh).
_MAX_LENGTHS_TRIED = 8


def _read_table(view, pos: int, payloads: int, what: str):
    """The table of versions 2 and 3: ``(slots, shapes, pos)`` (see :class:`Bundle`).

    What a table reads is a function of ``payloads`` and of the bytes it consumed
    alone, and every check it makes passes or fails on those alone: the same bytes
    read again give the same result, which is therefore kept (a bundle's payload
    lengths and checksum change from step to step, its table does not). A
    table never read before is read field by field.
    """
    for length in _READ_TABLE_LENGTHS.get(payloads, ()):
        known = _READ_TABLES.get((payloads, bytes(view[pos:pos + length])))
        if known is not None:
            slots, shapes = known
            # (copies: a caller may change what a Bundle holds)
            return list(slots), dict(shapes), pos + length
    slots, shapes, end = _parse_table(view, pos, payloads, what)
    if len(_READ_TABLES) >= _MAX_READ_TABLES:
        _READ_TABLES.clear()
        _READ_TABLE_LENGTHS.clear()
    _READ_TABLES[(payloads, bytes(view[pos:end]))] = (tuple(slots), dict(shapes))
    lengths = _READ_TABLE_LENGTHS.setdefault(payloads, [])
    if end - pos not in lengths and len(lengths) < _MAX_LENGTHS_TRIED:
        lengths.append(end - pos)
    return slots, shapes, end


def _parse_table(view, pos: int, payloads: int, what: str):
    """:func:`_read_table`, field by field."""
    tensors, pos = read_varint(view, pos, what)
    slots, pos = _read_varints(view, pos, tensors, f"{what} slots")
    if tensors and max(slots) >= payloads:
        raise DecodeError(f"{what}: a tensor is in payload {max(slots)} of {payloads}")
    references = np.bincount(np.array(slots, dtype=np.int64), minlength=payloads)
    if (references == 0).any():
        raise DecodeError(f"{what}: payload {int(np.argmin(references))} holds no tensor")
    shared = np.flatnonzero(references[slots] > 1).tolist() if tensors else []
    ranks, pos = _read_varints(view, pos, len(shared), f"{what} shared tensors' ranks")
    if shared and max(ranks) > _MAX_DIMS:
        raise DecodeError(f"{what}: a tensor of {max(ranks)} dimensions "
                          f"(at most {_MAX_DIMS})")
    dims, pos = _read_varints(view, pos, sum(ranks), f"{what} shared tensors' shapes")
    bounds = [0, *itertools.accumulate(ranks)]
    shapes = {t: tuple(dims[lo:hi]) for t, lo, hi in zip(shared, bounds, bounds[1:])}
    return slots, shapes, pos
