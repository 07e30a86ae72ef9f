"""Checkpoint layouts → the in-memory form, bit for bit: compressed-tensors against the library's own pack /
compress / decompress, GPTQ and AWQ against reference packings written here from the formats' descriptions."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized import pack_to_int32, unpack_from_int32

from engine.errors import ModelLoadError
from engine.quant.layouts import stored_tensors, to_weight, unpack_int32
from engine.quant.quantize import pack_int4_words, rtn_int4
from engine.quant.spec import QuantSpec, quant_spec
from engine.quant.weights import Int4Weight, pack_nibbles

N, K, G = 48, 256, 128


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _signed4(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(-8, 8, (n, k), generator=_gen(seed), dtype=torch.int8)


def test_our_int4_words_are_compressed_tensors_pack_to_int32() -> None:
    q = _signed4(N, K)
    assert torch.equal(pack_int4_words(q), pack_to_int32(q, 4))


def test_compressed_tensors_packed_weight_unpacks_to_its_values() -> None:
    q = _signed4(N, K, 1)
    words = pack_to_int32(q, 4)
    assert torch.equal(unpack_int32(words, 1) - 8, q.int())
    assert torch.equal(unpack_int32(words, 1) - 8, unpack_from_int32(words, 4, torch.Size((N, K))).int())


def test_zero_points_packed_along_the_output_dimension_unpack() -> None:
    zp = _signed4(N, K // G, 2)
    assert torch.equal(unpack_int32(pack_to_int32(zp, 4, packed_dim=0), 0) - 8, zp.int())


def _ct_state(symmetric: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A pack-quantized layer written by compressed-tensors' own compressor, and its own decompression."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=G, symmetric=symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    w = torch.randn(N, K, generator=_gen(3))
    g = w.view(N, K // G, G)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if symmetric:
        scale, zp = torch.maximum(-lo, hi) / 7.5, torch.zeros(N, K // G, dtype=torch.int8)
    else:
        scale = (hi - lo) / 15
        zp = torch.round(-8 - lo / scale).clamp(-8, 7).to(torch.int8)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    return dict(compressed), PackedQuantizationCompressor.decompress(compressed, scheme)["weight"]


@pytest.mark.parametrize("symmetric", [True, False])
def test_pack_quantized_layer_dequantizes_as_compressed_tensors_does(symmetric: bool) -> None:
    state, theirs = _ct_state(symmetric)
    spec = QuantSpec("w4a16", "compressed-tensors", G, symmetric)
    assert set(state) == {t.name for t in stored_tensors(spec, N, K)}
    ours = to_weight(spec, state, N, K)
    assert isinstance(ours, Int4Weight)
    assert torch.equal(ours.float(), theirs.float())


def test_int_quantized_layer_dequantizes_as_compressed_tensors_does() -> None:
    from compressed_tensors.compressors.naive_quantized import NaiveQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
    acts = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    w = torch.randn(N, K, generator=_gen(4))
    scale = w.abs().amax(1, keepdim=True) / 127.5
    state = dict(NaiveQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme))
    theirs = NaiveQuantizationCompressor.decompress(dict(state), scheme)["weight"]
    ours = to_weight(QuantSpec("w8a8", "compressed-tensors"), state, N, K)
    assert state["weight"].dtype == torch.int8 and torch.equal(ours.float(), theirs.float())


def _gptq_pack(values: torch.Tensor, zeros: torch.Tensor, v1: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ as AutoGPTQ documents it: qweight[i, n] holds inputs 8i..8i+7 of output n, input 8i+j in bits 4j;
    qzeros[g, i] holds outputs 8i..8i+7 the same way; the v1 format stores each zero point minus one."""
    k, n = values.shape
    qweight = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        qweight |= values[j::8].long() << (4 * j)
    z = zeros.long() - (1 if v1 else 0)
    qzeros = torch.zeros(z.shape[0], n // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= (z[:, j::8] & 0xF) << (4 * j)
    return _as_int32(qweight), _as_int32(qzeros)


def _awq_pack(values: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ (GEMM) as AutoAWQ documents it: each int32 holds eight consecutive outputs, packed in the order
    0 2 4 6 1 3 5 7 (nibble i holds output order[i]); qweight [K, N/8], qzeros [K/G, N/8], zero points as is."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def pack(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(t.shape[0], t.shape[1] // 8, dtype=torch.int64)
        for i, col in enumerate(order):
            out |= t[:, col::8].long() << (4 * i)
        return _as_int32(out)

    return pack(values), pack(zeros)


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)


@pytest.mark.parametrize(("fmt", "v1"), [("gptq", True), ("gptq", False), ("awq", False)])
def test_gptq_and_awq_layers_unpack_to_their_values(fmt: str, v1: bool) -> None:
    values = torch.randint(0, 16, (K, N), generator=_gen(5))  # [K, N]: these formats store inputs first
    zeros = torch.randint(1, 16, (K // G, N), generator=_gen(6))
    scales = torch.rand(K // G, N, generator=_gen(7)) + 0.01
    qweight, qzeros = _gptq_pack(values, zeros, v1) if fmt == "gptq" else _awq_pack(values, zeros)
    spec = QuantSpec("w4a16", fmt, G, False, zero_offset=int(v1))
    assert {t.name: t.shape for t in stored_tensors(spec, N, K)} == {
        "qweight": tuple(qweight.shape), "qzeros": tuple(qzeros.shape), "scales": (K // G, N),
    }  # fmt: skip
    w = to_weight(spec, {"qweight": qweight, "qzeros": qzeros, "scales": scales.half()}, N, K)
    assert isinstance(w, Int4Weight)
    assert torch.equal(w.values(), values.T.int()) and torch.equal(w.zero.long(), zeros.T)
    want = (values.T.float() - zeros.T.repeat_interleave(G, 1)) * scales.half().float().T.repeat_interleave(G, 1)
    assert torch.equal(w.float(), want)


def test_nibbles_round_trip() -> None:
    v = torch.randint(0, 16, (N, K), generator=_gen(8))
    w = Int4Weight(pack_nibbles(v), torch.ones(N, K // G), torch.full((N, K // G), 8, dtype=torch.uint8), G)
    assert torch.equal(w.values(), v.int()) and w.shape == (N, K)


@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_int4_writes_what_compressed_tensors_writes(symmetric: bool) -> None:
    """Our round-to-nearest and packing against the library's min-max qparams and its compressor, bit for bit."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    from engine.quant.quantize import QuantizeReport, _convert

    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=G, symmetric=symmetric)
    w = torch.randn(N, K, generator=_gen(10))
    scale, zero = calculate_qparams(w.view(N, -1, G).amin(-1), w.view(N, -1, G).amax(-1), args)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
    theirs = PackedQuantizationCompressor.compress(state, QuantizationScheme(targets=["Linear"], weights=args))
    report = QuantizeReport("w4a16", G, symmetric=symmetric)
    layer = "model.layers.0.mlp.up_proj"
    ours = {
        k.removeprefix(layer + "."): v for k, v in _convert(layer + ".weight", w, "w4a16", G, False, report).items()
    }
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        assert torch.equal(value, theirs[name].to(value.dtype)), name


def test_rtn_int4_is_within_half_a_step() -> None:
    w = torch.randn(N, K, generator=_gen(9))
    q, scale, _ = rtn_int4(w, G, torch.float32)
    back = (q.float().view(N, -1, G) * scale[..., None]).view(N, K)
    assert bool(((back - w).abs() <= scale.repeat_interleave(G, 1) / 2 + 1e-6).all())


# ---- which configs are accepted -----------------------------------------------------------------------


def _ct(weights: dict, acts: dict | None, fmt: str, **top: object) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "format": fmt}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"g": group},
                                    "ignore": ["lm_head"], **top}}  # fmt: skip


W4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False}
W8 = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
A8 = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}


def test_accepted_configs() -> None:
    s = quant_spec(_ct(W4, None, "pack-quantized"))
    assert s is not None and (s.scheme, s.fmt, s.group_size, s.symmetric) == ("w4a16", "compressed-tensors", 128, False)
    assert not s.quantizes("lm_head") and s.quantizes("model.layers.0.mlp.down_proj")
    s = quant_spec(_ct(W8, A8, "int-quantized"))
    assert s is not None and s.scheme == "w8a8"
    s = quant_spec({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}})
    assert s is not None and (s.fmt, s.zero_offset) == ("gptq", 1)
    s = quant_spec({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                                            "modules_to_not_convert": ["mlp.gate"]}})  # fmt: skip
    assert s is not None and s.fmt == "awq" and not s.symmetric and not s.quantizes("model.layers.1.mlp.gate")
    assert quant_spec({"model_type": "llama"}) is None


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act true"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq with 8-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "awq version 'gemv'"),
        ({"quant_method": "fp8"}, "quant_method 'fp8'"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        (_ct({**W8, "type": "float"}, None, "float-quantized")["quantization_config"], "weights"),
        (_ct(W8, None, "int-quantized")["quantization_config"], "W8A8 needs dynamic per-token"),
        (_ct(W4, None, "pack-quantized", kv_cache_scheme={"num_bits": 8})["quantization_config"], "KV cache"),
    ],
)
def test_refused_configs_name_the_scheme_and_list_what_is_supported(config: dict, named: str) -> None:
    with pytest.raises(ModelLoadError, match="unsupported quantization") as e:
        quant_spec({"quantization_config": config})
    assert named in str(e.value) and "GPTQ and AWQ" in str(e.value) and "W8A8" in str(e.value)


def test_mixed_schemes_are_refused() -> None:
    cfg = _ct(W4, None, "pack-quantized")
    cfg["quantization_config"]["config_groups"]["h"] = {"targets": ["re:.*down_proj"], "weights": W8,
                                                        "input_activations": A8, "format": "int-quantized"}  # fmt: skip
    with pytest.raises(ModelLoadError, match="mixed precision"):
        quant_spec(cfg)


def test_the_in_memory_form_is_made_on_the_device_the_checkpoint_tensors_are_on() -> None:
    """A model loaded onto a GPU unpacks its weights there: nothing made on the host may join them (the meta
    device stands in for a GPU here; tests/parity/test_cuda.py runs the real one)."""
    meta = {
        "weight_packed": torch.empty(N, K // 8, dtype=torch.int32, device="meta"),
        "weight_scale": torch.empty(N, K // G, device="meta"),
        "weight_shape": torch.tensor([N, K]),  # read as numbers at load
    }
    w = to_weight(QuantSpec("w4a16", "compressed-tensors", G, True), meta, N, K)
    assert {t.device.type for t in (w.packed, w.scale, w.zero)} == {"meta"}
    assert w.float().device.type == "meta"
    assert unpack_int32(meta["weight_packed"], 1).device.type == "meta"
    assert unpack_int32(meta["weight_packed"], 1, (0, 2, 4, 6, 1, 3, 5, 7)).device.type == "meta"  # AWQ's order
