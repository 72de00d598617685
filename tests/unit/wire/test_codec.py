"""The wire codec: exact round trips, zero copy both ways, and refusal of every malformed message."""

from __future__ import annotations

import gc
import pickle
import warnings

import msgpack
import numpy as np
import pytest
import torch
import zmq

import pipeq
from pipeq.wire import codec
from pipeq.wire.codec import (
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    MAX_NDIM,
    MAX_TENSORS,
    DtypeError,
    FrameCountError,
    FrameLengthError,
    HeaderError,
    Kind,
    ShapeError,
    VersionError,
    decode,
    encode,
)

pytestmark = pytest.mark.timeout(30)

F32 = 0  # wire dtype code of float32 (codes are part of the format)
BOOL = 9


def _sample(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype is torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if dtype in (torch.int32, torch.int64):
        # values that need the full width (negative, beyond 2**31 for int64)
        hi = 2**31 - 1 if dtype is torch.int32 else 2**62
        return torch.randint(-hi, hi, shape, generator=g, dtype=dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _roundtrip(tensors, kind=Kind.ACTIVATION, step=7, microbatch=3, extra=None):
    frames = encode(kind, step, microbatch, tensors, extra)
    # what the receiving side of ZeroMQ hands over: writable buffers, one per frame
    received = [bytearray(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in frames]
    return frames, decode(received)


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(got, want.detach().resolve_conj().resolve_neg())


# ---------------------------------------------------------------- round trips

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 4), (2, 3, 5), (0,), (3, 0, 2)], ids=str)
def test_roundtrip_dtype_and_shape(dtype, shape):
    t = _sample(dtype, shape)
    _, msg = _roundtrip([t])
    assert len(msg.tensors) == 1
    _assert_same(msg.tensors[0], t)


def test_roundtrip_preserves_special_float_values():
    t = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3.4e38])
    _, msg = _roundtrip([t])
    got = msg.tensors[0]
    assert torch.equal(got.view(torch.int32), t.view(torch.int32))  # bit for bit (nan, -0.0)


def test_roundtrip_header_fields_survive():
    extra = {"loss": 1.25, "name": "stage-2", "ids": [1, 2, 3], "nested": {"a": None, "b": True}}
    t = torch.arange(6.0).reshape(2, 3)
    _, msg = _roundtrip([t], kind=Kind.GRADIENT, step=123456789, microbatch=41, extra=extra)
    assert msg.kind is Kind.GRADIENT
    assert msg.step == 123456789
    assert msg.microbatch == 41
    assert msg.extra == extra
    _assert_same(msg.tensors[0], t)


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_every_kind_survives_without_tensors(kind):
    frames, msg = _roundtrip([], kind=kind, step=0, microbatch=0)
    assert len(frames) == 1  # header only
    assert msg.kind is kind and isinstance(msg.kind, Kind)
    assert msg.tensors == []
    assert msg.extra == {}  # nil extra decodes to an empty dict


def test_no_tensors_with_extra():
    _, msg = _roundtrip([], kind=Kind.LOSS, step=2, microbatch=0, extra={"loss": [0.5, 0.25]})
    assert msg.tensors == [] and msg.extra == {"loss": [0.5, 0.25]} and msg.step == 2


def test_several_tensors_in_one_message_keep_their_order():
    ts = [_sample(dt, (i + 1, 2), seed=i) for i, dt in enumerate(DTYPES)]
    ts.insert(3, torch.empty(0, 4))
    ts.append(torch.tensor(3.5))
    frames, msg = _roundtrip(ts)
    assert len(frames) == len(ts) + 1
    assert len(msg.tensors) == len(ts)
    for got, want in zip(msg.tensors, ts):
        _assert_same(got, want)


def _noncontiguous_cases():
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    c = torch.randn(4, 3, dtype=torch.complex64)
    return {
        "transposed": base.transpose(0, 2),
        "permuted": base.permute(1, 2, 0),
        "strided-slice": base[:, ::2, 1::2],
        "step-slice-1d": torch.arange(20, dtype=torch.int64)[::3],
        "expanded": torch.tensor([1.0, 2.0, 3.0]).expand(4, 3),
        "expanded-0d": torch.tensor(5, dtype=torch.int32).expand(2, 3),
        "column": base[:, :, 2],
        "bf16-transposed": base.to(torch.bfloat16).mT,
        "bool-strided": (base > 20)[::2],
        "conj-view": c.conj(),
        "complex-transposed": c.t(),
        "neg-view": torch._neg_view(base),  # what some autograd paths hand back
    }


@pytest.mark.parametrize("t", [pytest.param(t, id=k) for k, t in _noncontiguous_cases().items()])
def test_roundtrip_noncontiguous(t):
    assert not t.is_contiguous() or t.is_conj() or t.is_neg()
    _, msg = _roundtrip([t])
    got = msg.tensors[0]
    _assert_same(got, t)
    assert got.is_contiguous()
    assert not got.is_conj() and not got.is_neg()


def test_roundtrip_does_not_change_the_source_tensor():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = t.t()
    before = t.clone()
    _roundtrip([view, t.conj(), torch._neg_view(t)])
    assert torch.equal(t, before)
    assert view.stride() == (1, 4)


def test_roundtrip_requires_grad_tensors():
    leaf = torch.randn(3, 4, requires_grad=True)
    nonleaf = leaf * 2  # has a grad_fn
    _, msg = _roundtrip([leaf, nonleaf, nonleaf.t()])
    for got, want in zip(msg.tensors, [leaf, nonleaf, nonleaf.t()]):
        _assert_same(got, want)
        assert not got.requires_grad and got.grad_fn is None
    assert leaf.requires_grad and nonleaf.grad_fn is not None  # sender's graph untouched


def test_decode_of_readonly_bytes_gives_a_writable_tensor_without_warning():
    t = torch.arange(4, dtype=torch.float32)
    frames = [bytes(memoryview(f).cast("B")) for f in encode(Kind.ACTIVATION, 0, 0, [t])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.frombuffer warns on read-only buffers
        msg = decode(frames)
    got = msg.tensors[0]
    got += 1  # writable
    assert torch.equal(got, t + 1)
    assert frames[1] == bytes(t.numpy())  # the bytes object is not modified


# ---------------------------------------------------------------- zero copy


def _ptr_of_buffer(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_is_zero_copy_for_contiguous_tensor(dtype):
    t = _sample(dtype, (4, 8))
    frames = encode(Kind.ACTIVATION, 0, 0, [t])
    frame = frames[1]
    assert memoryview(frame).nbytes == t.numel() * t.element_size()
    assert _ptr_of_buffer(frame) == t.data_ptr()
    # writes to the tensor are visible through the frame: they are the same memory
    raw = np.frombuffer(frame, dtype=np.uint8)
    before = raw.copy()
    t.view(torch.uint8).reshape(-1)[0] ^= 1
    assert raw[0] == before[0] ^ 1


def test_encode_is_zero_copy_for_contiguous_slice_with_offset():
    base = torch.arange(100, dtype=torch.float64)
    t = base[10:30]  # contiguous, storage offset 10
    frame = encode(Kind.ACTIVATION, 0, 0, [t])[1]
    assert _ptr_of_buffer(frame) == t.data_ptr() == base.data_ptr() + 10 * 8
    assert memoryview(frame).nbytes == 20 * 8


def test_encode_of_requires_grad_leaf_is_zero_copy():
    t = torch.randn(16, requires_grad=True)
    frame = encode(Kind.GRADIENT, 0, 0, [t])[1]
    assert _ptr_of_buffer(frame) == t.data_ptr()


def test_decode_is_zero_copy_over_bytearray():
    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    frames = encode(Kind.ACTIVATION, 1, 0, [t, t.to(torch.int64)])
    bufs = [bytes(frames[0])] + [bytearray(memoryview(f).cast("B")) for f in frames[1:]]
    msg = decode(bufs)
    for got, buf in zip(msg.tensors, bufs[1:]):
        start = _ptr_of_buffer(buf)
        assert start <= got.data_ptr() < start + len(buf)
        assert got.data_ptr() + got.numel() * got.element_size() <= start + len(buf)
    # same memory: a write into the buffer shows in the tensor
    np.frombuffer(bufs[1], dtype=np.float32)[5] = -1.0
    assert msg.tensors[0].reshape(-1)[5].item() == -1.0


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a = ctx.socket(zmq.PAIR)
    b = ctx.socket(zmq.PAIR)
    a.linger = b.linger = 0
    a.bind("inproc://pipeq-test-codec")
    b.connect("inproc://pipeq-test-codec")
    try:
        yield a, b
    finally:
        a.close()
        b.close()
        ctx.term()


def test_zmq_inproc_roundtrip_is_zero_copy_on_receive(pair):
    a, b = pair
    t = torch.randn(64, 32)
    i = torch.arange(1000, dtype=torch.int64)
    a.send_multipart(encode(Kind.ACTIVATION, 5, 2, [t, i], {"k": 1}), copy=False)
    frames = b.recv_multipart(copy=False)
    assert all(isinstance(f, zmq.Frame) for f in frames)
    msg = decode(frames)
    assert (msg.kind, msg.step, msg.microbatch, msg.extra) == (Kind.ACTIVATION, 5, 2, {"k": 1})
    _assert_same(msg.tensors[0], t)
    _assert_same(msg.tensors[1], i)
    for got, frame in zip(msg.tensors, frames[1:]):
        start = _ptr_of_buffer(frame)
        assert start <= got.data_ptr() < start + len(frame.bytes)


def test_decoded_tensor_keeps_zmq_frame_alive(pair):
    a, b = pair
    t = torch.arange(4096, dtype=torch.float32)
    a.send_multipart(encode(Kind.ACTIVATION, 0, 0, [t]), copy=False)
    frames = b.recv_multipart(copy=False)
    got = decode(frames).tensors[0]
    del frames
    gc.collect()
    # churn the allocator a little so freed memory would likely be reused
    junk = [torch.full((4096,), -7.0) for _ in range(8)]
    assert torch.equal(got, t)
    del junk


# ---------------------------------------------------------------- corrupted messages


def _header(version=FORMAT_VERSION, kind=int(Kind.ACTIVATION), step=0, microbatch=0, metas=(), extra=None):
    return msgpack.packb([version, kind, step, microbatch, list(metas), extra])


def _good(shape=(2, 3), code=F32, itemsize=4):
    n = int(np.prod(shape)) * itemsize
    return [_header(metas=[[code, list(shape), n]]), bytearray(n)]


def test_error_classes_are_codec_errors():
    for cls in (VersionError, HeaderError, DtypeError, ShapeError, FrameCountError, FrameLengthError):
        assert issubclass(cls, pipeq.CodecError)
        assert issubclass(cls, ValueError)
    assert pipeq.CodecError is codec.CodecError


def test_good_baseline_decodes():
    # the corrupted variants below are all one change away from this
    msg = decode(_good())
    assert msg.tensors[0].shape == (2, 3) and msg.tensors[0].dtype == torch.float32


@pytest.mark.parametrize("version", [0, 2, FORMAT_VERSION + 100, -1, "1", None, [1]])
def test_wrong_version(version):
    frames = _good()
    frames[0] = _header(version=version, metas=[[F32, [2, 3], 24]])
    with pytest.raises(VersionError):
        decode(frames)


def test_future_version_with_different_layout_is_version_error():
    # A message from a later wire format may have a different header layout; the receiver
    # should still say "wrong version", which is what VersionError is documented to mean.
    with pytest.raises(VersionError):
        decode([msgpack.packb([FORMAT_VERSION + 1, 1, 0, 0, [], None, "new field"])])


@pytest.mark.parametrize(
    "head",
    [
        b"",
        b"\xc1",  # the one byte msgpack never uses
        b"\x96\x01",  # 6-array announced, truncated
        b"\xff\xfe\xfd\x00garbage",
        bytes(range(256)),
        _header() + b"\x00",  # trailing bytes
        b"\xdd\xff\xff\xff\xff",  # array of 2**32-1 elements in a 5-byte header
    ],
    ids=["empty", "c1", "truncated", "garbage", "all-bytes", "trailing", "huge-array-len"],
)
def test_garbage_header_bytes(head):
    with pytest.raises(HeaderError):
        decode([head])


@pytest.mark.parametrize(
    "header",
    [
        [FORMAT_VERSION, 1, 0, 0, []],
        [FORMAT_VERSION, 1, 0, 0, [], None, None],
        [],
        {"version": FORMAT_VERSION},
        FORMAT_VERSION,
        "hello",
        None,
    ],
    ids=["5-array", "7-array", "empty-array", "map", "int", "str", "nil"],
)
def test_header_not_a_6_array(header):
    with pytest.raises(HeaderError):
        decode([msgpack.packb(header)])


@pytest.mark.parametrize("kind", [0, 3, 99, -1, 2**40, "ACTIVATION", 1.0, True, None])
def test_unknown_kind(kind):
    with pytest.raises(HeaderError):
        decode([_header(kind=kind)])


@pytest.mark.parametrize("field", ["step", "microbatch"])
@pytest.mark.parametrize("value", [1.5, 2.0, "3", None, True, [1], {"a": 1}])
def test_non_int_step_or_microbatch(field, value):
    with pytest.raises(HeaderError):
        decode([_header(**{field: value})])


@pytest.mark.parametrize("extra", [[1, 2], "x", 3])
def test_extra_not_a_map(extra):
    with pytest.raises(HeaderError):
        decode([_header(extra=extra)])


def test_extra_with_non_string_keys():
    with pytest.raises(HeaderError):
        decode([_header(extra={1: "a"})])


@pytest.mark.parametrize("metas", ["tensors", 3, {"a": 1}])
def test_tensors_field_not_an_array(metas):
    head = msgpack.packb([FORMAT_VERSION, 1, 0, 0, metas, None])
    with pytest.raises(HeaderError):
        decode([head])


@pytest.mark.parametrize("meta", [[F32, [2]], [F32, [2], 8, 0], "f32", 7, None])
def test_tensor_entry_malformed(meta):
    with pytest.raises(HeaderError):
        decode([_header(metas=[meta]), bytearray(8)])


@pytest.mark.parametrize("code", [len(codec._DTYPES), 99, -1, 2**33, "float32", 0.0, None, True])
def test_unknown_dtype_code(code):
    with pytest.raises(DtypeError):
        decode([_header(metas=[[code, [2], 8]]), bytearray(8)])


@pytest.mark.parametrize("shape", [[-1], [2, -3], [-(2**40), 2]])
def test_negative_dimension(shape):
    with pytest.raises(ShapeError):
        decode([_header(metas=[[F32, shape, 8]]), bytearray(8)])


@pytest.mark.parametrize("shape", [[2.0], ["2"], [None], [[2]], [True, 2]])
def test_non_int_dimension(shape):
    with pytest.raises(ShapeError):
        decode([_header(metas=[[F32, shape, 8]]), bytearray(8)])


@pytest.mark.parametrize("shape", ["23", 6, None, {"0": 2}])
def test_shape_not_a_list(shape):
    with pytest.raises(ShapeError):
        decode([_header(metas=[[F32, shape, 24]]), bytearray(24)])


def test_too_many_dims():
    ok = [1] * MAX_NDIM
    assert decode([_header(metas=[[F32, ok, 4]]), bytearray(4)]).tensors[0].dim() == MAX_NDIM
    with pytest.raises(ShapeError):
        decode([_header(metas=[[F32, [1] * (MAX_NDIM + 1), 4]]), bytearray(4)])


@pytest.mark.parametrize(
    "shape",
    [[2**40, 2**40], [2**20, 2**20, 2**20], [2**62], [2**64 - 1], [2**32] * MAX_NDIM],
    ids=["2^40x2^40", "2^20^3", "2^62", "u64max", "16x2^32"],
)
def test_absurdly_large_shape(shape):
    with pytest.raises(ShapeError):
        decode([_header(metas=[[F32, shape, 4]]), bytearray(4)])


@pytest.mark.parametrize(
    "shape",
    [[0, 2**62, 2**62], [0, 2**64 - 1], [2**63, 0], [0] + [2**40] * 3],
    ids=["0x2^62x2^62", "0xu64max", "2^63x0", "0x(2^40)^3"],
)
def test_absurd_dimension_in_empty_tensor(shape):
    # zero elements, so "shape x itemsize" is 0 and passes the byte limit, but no torch tensor can
    # have such dimensions: the decoder must still answer with a ShapeError, not a torch error.
    with pytest.raises(ShapeError):
        decode([_header(metas=[[F32, shape, 0]]), bytearray(0)])


@pytest.mark.parametrize("delta", [-1, -4, -24, +1, +4, +1000], ids=lambda d: f"{d:+d}")
def test_frame_length_not_matching_shape(delta):
    # header consistent with the shape (24 bytes), the frame is not
    frames = [_header(metas=[[F32, [2, 3], 24]]), bytearray(24 + delta)]
    with pytest.raises(FrameLengthError):
        decode(frames)


@pytest.mark.parametrize("nbytes", [23, 25, 0, 12, 48, -24, "24", None])
def test_header_nbytes_disagreeing(nbytes):
    # the frame matches the shape (24 bytes), the header's nbytes does not
    frames = [_header(metas=[[F32, [2, 3], nbytes]]), bytearray(24)]
    with pytest.raises(FrameLengthError):
        decode(frames)


def test_frame_and_nbytes_agree_but_not_shape():
    frames = [_header(metas=[[F32, [2, 3], 20]]), bytearray(20)]
    with pytest.raises(FrameLengthError):
        decode(frames)


def test_frame_length_uses_dtype_itemsize():
    # 6 bytes is right for 6 bools but not for 6 float16 values
    assert decode([_header(metas=[[BOOL, [6], 6]]), bytearray(6)]).tensors[0].dtype == torch.bool
    f16 = codec._DTYPES.index(torch.float16)
    with pytest.raises(FrameLengthError):
        decode([_header(metas=[[f16, [6], 6]]), bytearray(6)])


def test_more_frames_than_tensors():
    frames = _good() + [bytearray(24)]
    with pytest.raises(FrameCountError):
        decode(frames)
    with pytest.raises(FrameCountError):
        decode([_header(), bytearray(0)])  # no tensor announced, one frame sent


def test_fewer_frames_than_tensors():
    head = _header(metas=[[F32, [2], 8], [F32, [3], 12]])
    with pytest.raises(FrameCountError):
        decode([head, bytearray(8)])
    with pytest.raises(FrameCountError):
        decode([head])


def test_over_max_tensors():
    metas = [[F32, [0], 0]] * (MAX_TENSORS + 1)
    head = _header(metas=metas)
    assert len(head) <= MAX_HEADER_BYTES
    with pytest.raises(FrameCountError):
        decode([head] + [bytearray(0)] * (MAX_TENSORS + 1))
    with pytest.raises(FrameCountError):  # also when the frames are missing
        decode([head])
    # exactly MAX_TENSORS is fine
    head = _header(metas=[[F32, [0], 0]] * MAX_TENSORS)
    assert len(decode([head] + [bytearray(0)] * MAX_TENSORS).tensors) == MAX_TENSORS


@pytest.mark.parametrize("frames", [[], ()], ids=["list", "tuple"])
def test_empty_frame_list(frames):
    with pytest.raises(FrameCountError):
        decode(frames)


def test_header_over_max_header_bytes():
    # well-formed msgpack in every other respect, just too big
    head = _header(extra={"pad": "x" * MAX_HEADER_BYTES})
    assert len(head) > MAX_HEADER_BYTES
    with pytest.raises(HeaderError, match="limit"):
        decode([head])
    raw = b"\x00" * (MAX_HEADER_BYTES + 1)
    with pytest.raises(HeaderError):
        decode([raw])


# ---------------------------------------------------------------- nothing is unpickled

_UNPICKLED: list[str] = []


def _record(tag: str) -> list:
    _UNPICKLED.append(tag)
    return [FORMAT_VERSION, 1, 0, 0, [], None]


class _Bomb:
    """Unpickling this calls _record: if the codec ever unpickled, we would see it."""

    def __reduce__(self):
        return (_record, ("unpickled!",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_payload_is_refused_and_not_unpickled(protocol):
    _UNPICKLED.clear()
    payload = pickle.dumps(_Bomb(), protocol=protocol)
    assert pickle.loads(payload) == [FORMAT_VERSION, 1, 0, 0, [], None]  # it would decode...
    assert _UNPICKLED == ["unpickled!"]
    _UNPICKLED.clear()
    with pytest.raises(HeaderError):  # ...if anything unpickled it
        decode([payload])
    assert _UNPICKLED == []


def test_pickle_in_a_tensor_frame_is_just_bytes():
    _UNPICKLED.clear()
    payload = pickle.dumps(_Bomb())
    n = len(payload)
    msg = decode([_header(metas=[[codec._DTYPES.index(torch.uint8), [n], n]]), bytearray(payload)])
    assert bytes(msg.tensors[0].numpy()) == payload
    assert _UNPICKLED == []


def test_msgpack_ext_types_are_not_turned_into_objects():
    # ext types in 'extra' must not execute anything; they stay inert data
    head = msgpack.packb([FORMAT_VERSION, 1, 0, 0, [], {"x": msgpack.ExtType(42, b"payload")}])
    msg = decode([head])
    assert msg.extra["x"] == msgpack.ExtType(42, b"payload")


# ---------------------------------------------------------------- encoding refusals


def test_encode_refuses_meta_device_tensor():
    t = torch.empty(3, 4, device="meta")
    with pytest.raises(pipeq.CodecError, match="meta"):
        encode(Kind.ACTIVATION, 0, 0, [t])


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support:UserWarning")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_encode_refuses_sparse_tensor(layout):
    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    t = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    with pytest.raises(pipeq.CodecError):
        encode(Kind.ACTIVATION, 0, 0, [t])


def test_encode_refuses_unsupported_dtype():
    with pytest.raises(DtypeError):
        encode(Kind.ACTIVATION, 0, 0, [torch.zeros(3, dtype=torch.uint16)])


def test_encode_refuses_too_many_tensors():
    ts = [torch.zeros(1)] * (MAX_TENSORS + 1)
    with pytest.raises(pipeq.CodecError):
        encode(Kind.ACTIVATION, 0, 0, ts)
    assert len(encode(Kind.ACTIVATION, 0, 0, ts[:MAX_TENSORS])) == MAX_TENSORS + 1


def test_encode_refuses_bad_tensor_among_good_ones():
    with pytest.raises(pipeq.CodecError):
        encode(Kind.ACTIVATION, 0, 0, [torch.zeros(2), torch.empty(2, device="meta")])
