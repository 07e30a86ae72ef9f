from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load, save

from security.manifest import SealError
from security.safetensors_buffer import tensors_from_buffer

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.complex64,
]  # fmt: skip


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {f"t{i}": (torch.randn(3, 5, generator=g) * 4).to(dt) for i, dt in enumerate(DTYPES)}
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.zeros(0, 4)
    return out


def test_matches_safetensors_own_loader() -> None:
    data = save(sample(), metadata={"format": "pt"})
    want = load(data)
    got = dict(tensors_from_buffer(bytearray(data), "m.safetensors"))
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k  # bitwise


def test_tensors_are_views_of_the_decrypted_buffer() -> None:
    buf = bytearray(save({"w": torch.zeros(4, dtype=torch.float32)}))
    ((_, w),) = tensors_from_buffer(buf, "m.safetensors")
    buf[-4:] = struct.pack("<f", 1.5)
    assert w.tolist() == [0.0, 0.0, 0.0, 1.5]


def raw(header: dict[str, object], data: bytes) -> bytearray:
    h = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(h)) + h + data)


def test_a_misaligned_tensor_is_copied_not_refused() -> None:
    buf = raw(
        {
            "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},
        },
        b"\x01\x02\x03" + struct.pack("<2f", 1.0, -2.0),
    )
    got = dict(tensors_from_buffer(buf, "m.safetensors"))
    assert got["a"].tolist() == [1, 2, 3] and got["b"].tolist() == [1.0, -2.0]
    assert {k: v.tolist() for k, v in load(bytes(buf)).items()} == {k: v.tolist() for k, v in got.items()}


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "buf",
    [
        bytearray(b"\x01\x00"),
        bytearray(struct.pack("<Q", 1 << 40) + b"{}"),
        raw({}, b"") + b"x",
        bytearray(struct.pack("<Q", 2) + b"{]"),
        raw({"w": {**F32x2, "dtype": "F13"}}, bytes(8)),
        raw({"w": {**F32x2, "shape": [3]}}, bytes(8)),
        raw({"w": {**F32x2, "shape": [-2]}}, bytes(8)),
        raw({"w": {**F32x2, "data_offsets": [0, 12]}}, bytes(8)),
        raw({"w": F32x2, "v": F32x2}, bytes(8)),
        raw({"w": {**F32x2, "data_offsets": [4, 12]}}, bytes(12)),
        raw({"w": F32x2}, bytes(9)),
        raw({"w": "F32"}, bytes(8)),
        raw([1, 2], b""),  # type: ignore[arg-type]
    ],
    ids=[
        "short", "header too long", "trailing", "not json", "dtype", "shape", "negative dim", "past the end",
        "overlap", "gap", "left over", "entry not an object", "not an object",
    ],
)  # fmt: skip
def test_malformed_images_are_refused(buf: bytearray) -> None:
    with pytest.raises(SealError, match=r"m\.safetensors is not a valid safetensors file"):
        tensors_from_buffer(buf, "m.safetensors")
