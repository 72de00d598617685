"""The wire codec: messages as a msgpack header plus one raw frame per tensor.

Everything pipeq sends between processes goes through :func:`encode` and comes back through
:func:`decode`. Nothing is ever pickled. The codec's users are the wire's links: the control and
stage links through :mod:`pipeq.wire.frames` (the stage's data sends call :func:`encode` with
their shared-memory slots), :mod:`pipeq.wire.group_link` (replicas, tie peers), and
:mod:`pipeq.wire.shard_link` (a tensor-parallel stage's shards share messages as these frames). A message is a list of frames::

    frame 0   msgpack array [version, kind, step, microbatch, tensors, extra]
                 tensors = [[dtype_code, [d0, d1, ...], nbytes], ...]   one entry per tensor
                 extra   = dict of small plain values (str keys) or nil
    frame 1.. the raw bytes of tensor 0, tensor 1, ... (C-contiguous, native little-endian)

On one host, a message's large tensors may travel through a shared-memory slot instead
(:mod:`pipeq.wire.shm`): their entries get a fourth element ``1`` (``[dtype_code, shape, nbytes, 1]``),
they have no frame, and ``extra["@slot"] = [slot, generation]`` names the slot, whose reader
(``take``) the receiving transport hands to :func:`decode`; their offsets in the slot follow from
the validated sizes alone, never from the header. CUDA tensors between GPUs of one host likewise:
fourth element ``2``, ``extra["@cuda"]`` (the slot and its CUDA IPC handles), ``take_device``.

Sending is zero-copy: a frame is a view over the tensor's own memory (the transport passes it to
ZeroMQ with ``copy=False``). Receiving is zero-copy too: a tensor is rebuilt over the received
frame's buffer. Every field is validated before any tensor is built; a bad message raises a
subclass of :class:`CodecError` that says what was wrong.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterator, Sequence

import msgpack
import numpy
import torch

from pipeq.errors import CodecError
from pipeq.wire.messages import Kind, Message

__all__ = ["encode", "decode", "Place", "Take", "FORMAT_VERSION", "MAX_HEADER_BYTES", "MAX_TENSORS", "MAX_NDIM",
           "MAX_TENSOR_BYTES", "SLOT_KEY", "CUDA_KEY", "CodecError", "VersionError", "HeaderError", "DtypeError",
           "ShapeError", "FrameCountError", "FrameLengthError"]

FORMAT_VERSION = 1

#: Limits that a well-formed message never reaches; anything beyond them is refused.
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 1 << 16  # a stage's whole state_dict travels in one message
MAX_NDIM = 16
MAX_TENSOR_BYTES = 1 << 40
SLOT_KEY = "@slot"  # extra's key naming a message's shared-memory slot (see the module docstring)
CUDA_KEY = "@cuda"  # extra's key naming a message's CUDA slot (same host, CUDA IPC)
_IN_SLOT, _IN_CUDA = 1, 2  # a tensor entry's fourth element: where its bytes are


class VersionError(CodecError):
    """The message was written by another wire-format version."""


class HeaderError(CodecError):
    """The header is not a well-formed msgpack header of this format."""


class DtypeError(CodecError):
    """A tensor's dtype code is not one pipeq knows."""


class ShapeError(CodecError):
    """A tensor's shape is negative, too deep or absurdly large."""


class FrameCountError(CodecError):
    """The number of frames does not match the header (or is over the limit)."""


class FrameLengthError(CodecError):
    """A frame's length does not equal shape x itemsize."""


_KINDS = frozenset(int(k) for k in Kind)
_KIND_OF = {int(k): k for k in Kind}  # (a lookup: Kind(value) costs a microsecond)

# dtype <-> wire code. Codes are part of the format: never renumber, only append.
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODE_OF = {dt: code for code, dt in enumerate(_DTYPES)}
_NUMPY = frozenset(dt for dt in _DTYPES if dt is not torch.bfloat16)  # the dtypes numpy has
#: by code, the numpy dtype of the same bytes (None: numpy has none, bfloat16)
_NP_DTYPES = tuple(torch.empty(0, dtype=dt).numpy().dtype if dt in _NUMPY else None for dt in _DTYPES)
_ITEMSIZE = tuple(torch.empty((), dtype=dt).element_size() for dt in _DTYPES)

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("pipeq's wire format is little-endian; this host is big-endian")


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view when ``t`` is a contiguous CPU tensor)."""
    if t.layout is not torch.strided:
        raise CodecError(f"only dense tensors can be sent, got layout {t.layout}")
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg().contiguous()
    # uint8 view works for every dtype (bool, bfloat16 included)
    return t.reshape(-1).view(torch.uint8)


def _frame(t: torch.Tensor, n: int) -> Any:
    """A CPU tensor's bytes (``n`` of them) as a frame: the tensor's own memory as a numpy array
    (C order) when it is contiguous, not empty, and numpy has its dtype (one call: the hot path of
    every small message), else :func:`_flat`'s bytes."""
    if n and t.dtype in _NUMPY and not t.requires_grad and t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t.numpy()
    return _flat(t).numpy()


#: ``place(buffers) -> [slot, generation]``: copies flat uint8 tensors into a shared-memory slot
Place = Callable[[list[torch.Tensor]], "tuple[int, int] | list[int]"]
#: ``take(slot_ref, sizes) -> buffers``: the tensors' bytes out of the slot a header names
Take = Callable[[Any, list[int]], Sequence[Any]]


def encode(
    kind: Kind,
    step: int = 0,
    microbatch: int = 0,
    tensors: Sequence[torch.Tensor] = (),
    extra: dict[str, Any] | None = None,
    place: Place | None = None,
    min_bytes: int = 0,
    place_device: Place | None = None,
) -> list[Any]:
    """Encode one message into frames: ``[header, tensor buffers...]``. With ``place``, the
    tensors of at least ``min_bytes`` bytes go into one shared-memory slot instead of frames;
    with ``place_device``, CUDA tensors go into a CUDA slot (else they are refused)."""
    if len(tensors) > MAX_TENSORS:
        raise CodecError(f"a message carries at most {MAX_TENSORS} tensors, got {len(tensors)}")
    metas: list[Any] = []
    frames: list[Any] = [b""]
    slotted: list[torch.Tensor] = []
    on_device: list[torch.Tensor] = []
    for t in tensors:
        code = _CODE_OF.get(t.dtype)
        if code is None:
            raise DtypeError(f"dtype {t.dtype} cannot be sent; supported: {list(_CODE_OF)}")
        if not t.is_cpu:
            if place_device is None or t.device.type != "cuda":
                raise CodecError(f"tensor on {t.device} must be moved to the CPU before encoding")
            flat = _flat(t)
            metas.append((code, tuple(t.shape), flat.numel(), _IN_CUDA))
            on_device.append(flat)
            continue
        if t.layout is not torch.strided:
            raise CodecError(f"only dense tensors can be sent, got layout {t.layout}")
        n = t.nbytes
        if place is not None and n >= min_bytes and n:
            metas.append((code, tuple(t.shape), n, _IN_SLOT))
            slotted.append(_flat(t))
        else:
            metas.append((code, tuple(t.shape), n))
            frames.append(_frame(t, n))
    if slotted or on_device:
        extra = dict(extra or {})
        if slotted:
            assert place is not None
            extra[SLOT_KEY] = list(place(slotted))
        if on_device:
            assert place_device is not None
            extra[CUDA_KEY] = list(place_device(on_device))
    frames[0] = msgpack.packb((FORMAT_VERSION, int(kind), step, microbatch, metas, extra))
    return frames


def _buffer(frame: Any) -> memoryview:
    mv = frame if isinstance(frame, memoryview) else memoryview(frame)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    return mv


def _check_int(name: str, value: Any) -> int:
    if type(value) is not int:
        raise HeaderError(f"header field {name!r} must be an integer, got {type(value).__name__}")
    return value


def _take(take: Take | None, ref: Any, sizes: list[int], what: str) -> Sequence[Any]:
    """The buffers of the tensors in one slot (none when the header names none)."""
    if not sizes and ref is None:
        return ()
    if not sizes or ref is None:
        raise HeaderError(f"{what} and the tensors in it must come together")
    if take is None:
        raise HeaderError(f"the message names {what}, which this channel does not take")
    bufs = take(ref, sizes)
    if len(bufs) != len(sizes):  # pragma: no cover - a reader's bug, not a peer's
        raise HeaderError(f"{what} gave {len(bufs)} buffers for {len(sizes)} tensors")
    return bufs


def decode(frames: Sequence[Any], take: Take | None = None, take_device: Take | None = None) -> Message:
    """Validate and decode frames into a :class:`Message`; raises a :class:`CodecError` subclass.
    ``take`` reads tensors out of the shared-memory slot a header names, ``take_device`` out of
    a CUDA slot (without them, a header naming one is refused)."""
    kind, step, microbatch, metas, extra = _header(frames)
    slot = extra.pop(SLOT_KEY, None)
    cuda = extra.pop(CUDA_KEY, None)
    checked = _entries(metas)
    taken = _slotted(checked, len(frames), slot, cuda, take, take_device)
    return Message(_KIND_OF[kind], step, microbatch, _tensors(frames, checked, taken), extra)


def _header(frames: Sequence[Any]) -> tuple[int, int, int, list, dict]:
    """Frame 0 unpacked and checked field by field: ``(kind, step, microbatch, tensor entries, extra)``."""
    if not frames:
        raise FrameCountError("empty message: no header frame")
    head = _buffer(frames[0])
    if len(head) > MAX_HEADER_BYTES:
        raise HeaderError(f"header of {len(head)} bytes is over the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = msgpack.unpackb(head, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise HeaderError(f"header is not valid msgpack: {exc}") from None
    if type(header) is not list or not header:
        raise HeaderError("header must be a msgpack array")
    if header[0] != FORMAT_VERSION:  # checked first: another version may have another layout
        raise VersionError(f"wire format version {header[0]!r}, this pipeq speaks {FORMAT_VERSION}")
    if len(header) != 6:
        raise HeaderError("header must be a 6-element msgpack array")
    version, kind, step, microbatch, metas, extra = header
    if _check_int("kind", kind) not in _KINDS:
        raise HeaderError(f"unknown message kind {kind}")
    _check_int("step", step)
    _check_int("microbatch", microbatch)
    if extra is None:
        extra = {}
    elif type(extra) is not dict:
        raise HeaderError("header field 'extra' must be a map or nil")
    if type(metas) is not list:
        raise HeaderError("header field 'tensors' must be an array")
    if len(metas) > MAX_TENSORS:
        raise FrameCountError(f"{len(metas)} tensors is over the limit of {MAX_TENSORS}")
    return kind, step, microbatch, metas, extra


def _entries(metas: list) -> list[tuple[int, list[int], int, int]]:
    """Every tensor entry checked: ``(dtype code, shape, nbytes, where its bytes are)``, where is 0
    for a frame of its own, else _IN_SLOT or _IN_CUDA."""
    checked = []
    for i, meta in enumerate(metas):
        if type(meta) is not list or not (len(meta) == 3 or (len(meta) == 4 and type(meta[3]) is int
                                                             and meta[3] in (_IN_SLOT, _IN_CUDA))):
            raise HeaderError(f"tensor {i}: entry must be [dtype, shape, nbytes] (or [dtype, shape, nbytes, 1 or 2] "
                              "for one in shared memory or a CUDA slot)")
        code, shape, nbytes = meta[:3]
        if type(code) is not int or not 0 <= code < len(_DTYPES):
            raise DtypeError(f"tensor {i}: unknown dtype code {code!r}")
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise ShapeError(f"tensor {i}: shape must be a list of at most {MAX_NDIM} dims")
        # zero dims count as 1 in ``bound``, so an empty tensor cannot smuggle in overflowing strides
        bound = numel = 1
        for d in shape:
            if type(d) is not int or d < 0:
                raise ShapeError(f"tensor {i}: bad dimension {d!r} in shape {shape}")
            numel *= d
            bound *= d or 1
        if bound * _ITEMSIZE[code] > MAX_TENSOR_BYTES:
            raise ShapeError(f"tensor {i}: shape {shape} is absurdly large")
        expected = numel * _ITEMSIZE[code]
        if nbytes != expected or (len(meta) == 4 and expected == 0):
            raise FrameLengthError(f"tensor {i}: shape {shape} x {_ITEMSIZE[code]} bytes = {expected} bytes, "
                                   f"header says {nbytes!r}")
        checked.append((code, shape, expected, meta[3] if len(meta) == 4 else 0))
    return checked


def _slotted(checked: list[tuple[int, list[int], int, int]], n_frames: int, slot: Any, cuda: Any,
             take: Take | None, take_device: Take | None) -> dict[int, Iterator[Any]] | None:
    """Check that the frames match the entries that have one, and read the tensors that have
    none out of the slots the header names: their buffers, in order, by where they are (None
    when the message names no slot)."""
    in_slot = [c[2] for c in checked if c[3] == _IN_SLOT]
    in_cuda = [c[2] for c in checked if c[3] == _IN_CUDA]
    inline = len(checked) - len(in_slot) - len(in_cuda)
    if n_frames != inline + 1:
        raise FrameCountError(f"header announces {inline} tensor frame(s) but {n_frames - 1} arrived")
    if in_slot or in_cuda or slot is not None or cuda is not None:
        return {_IN_SLOT: iter(_take(take, slot, in_slot, "a shared-memory slot")),
                _IN_CUDA: iter(_take(take_device, cuda, in_cuda, "a CUDA slot"))}
    return None


def _tensors(frames: Sequence[Any], checked: list[tuple[int, list[int], int, int]],
             taken: dict[int, Iterator[Any]] | None) -> list[torch.Tensor]:
    """The tensors, each over its frame's (or its slot's) buffer: zero copy but for the few noted."""
    tensors = []
    f = 0
    for i, (code, shape, expected, where) in enumerate(checked):
        if where:
            buf = next(taken[where])  # type: ignore[index]
        else:
            f += 1
            buf = _buffer(frames[f])
            if len(buf) != expected:
                raise FrameLengthError(f"tensor {i}: shape {shape} x {_ITEMSIZE[code]} bytes = {expected} bytes, "
                                       f"frame has {len(buf)}")
        dtype = _DTYPES[code]
        if expected == 0:
            t = torch.empty(shape, dtype=dtype)
        elif isinstance(buf, torch.Tensor):
            t = buf.view(dtype).view(shape)
        else:
            if buf.readonly:  # bytes from a file or a test; ZeroMQ frames are writable
                buf = memoryview(bytearray(buf))
            if _ITEMSIZE[code] == 16:
                raw = torch.frombuffer(buf, dtype=torch.uint8)
                if raw.data_ptr() % 16:
                    raw = raw.clone()  # complex128 kernels need 16-byte alignment; ZeroMQ's frames are 8 mod 16
                t = raw.view(dtype).view(shape)
            else:
                np_dtype = _NP_DTYPES[code]
                if np_dtype is not None:  # over the same bytes, as frombuffer's, at half its cost
                    t = torch.from_numpy(numpy.ndarray(shape, np_dtype, buf))
                else:  # (bfloat16: no numpy dtype)
                    t = torch.frombuffer(buf, dtype=dtype).view(shape)
        tensors.append(t)
    return tensors
