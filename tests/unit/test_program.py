"""The program executor (engine/kernels/program.c) on every CPU: ops of each kind, with arguments fixed or read
from the step's values, against the torch code each kernel replaces; an unknown op stops the program."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.kernels import decode_attn, pointwise, program, wbf16
from engine.kernels.program import COS, INPUT, ROWS, SIN, Program, ProgramBuilder, address
from engine.layers.rotary import apply_rotary

H, KV, D, HIDDEN, BLOCK = 4, 2, 16, 32, 4


def _step(rows: int, tables: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor, x: torch.Tensor) -> tuple[int, ...]:  # fmt: skip
    return (rows, tables.data_ptr(), tables.shape[1], lens.data_ptr(), slots.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), torch.get_num_threads(), x.data_ptr())  # fmt: skip


def test_a_layer_of_float32_kernels_computes_what_torch_computes() -> None:
    """norm → GEMM → RoPE → K/V into the cache → decode attention, over two steps of different rows and contexts:
    the step values (rows, input, angles, slots, tables) move, the buffers and the cache stay."""
    lib, pw, attn, gemm = program.library(), pointwise.kernel(), decode_attn.kernel(), wbf16.kernel()
    assert lib is not None and pw is not None and attn is not None and gemm is not None
    g = torch.Generator().manual_seed(0)
    cols = (H + 2 * KV) * D
    w = torch.randn(cols, HIDDEN, generator=g).bfloat16().float()  # bf16 values: wbf16 holds them exactly
    norm_w = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    blocks = 8
    k_cache, v_cache = (torch.zeros(blocks, BLOCK, KV, D) for _ in range(2))
    packed = gemm.pack(w)
    b = ProgramBuilder()
    width = 4
    normed, qkv, q, out = (b.buffer(width, c, dtype=torch.float32) for c in (HIDDEN, cols, H * D, H * D))
    f32 = torch.float32
    b.norm(address(pw.norm_entry(f32)), HIDDEN, INPUT, None, norm_w.data_ptr(), 1e-6, normed.data_ptr(), None)
    b.gemm(address(gemm.lib.wbf16_linear), cols, HIDDEN, normed.data_ptr(), packed.data_ptr(), None, qkv.data_ptr())
    b.rope(address(pw.rope_entry(f32)), H + KV, D, qkv.data_ptr(), cols)
    b.store(cols * 4, qkv.data_ptr(), H * D * 4, q.data_ptr(), qkv.data_ptr() + H * D * 4,
            qkv.data_ptr() + (H + KV) * D * 4, KV * D * 4, k_cache.data_ptr(), v_cache.data_ptr())  # fmt: skip
    b.attention(address(attn.entry(f32)), H, KV, D, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), BLOCK,
                D**-0.5, out.data_ptr())  # fmt: skip
    prog = b.build(lib, out)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int64)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()  # the cache as the torch code writes it
    for rows, start in ((3, 0), (2, 1)):  # two steps: 3 sequences at positions 0, then 2 of them at position 1
        x = torch.randn(rows, HIDDEN, generator=g)
        positions = torch.full((rows,), start, dtype=torch.int64)
        angles = torch.randn(8, D, generator=g)
        cos, sin = angles.cos()[positions].contiguous(), angles.sin()[positions].contiguous()
        slots = tables[:rows, 0] * BLOCK + start
        lens = torch.full((rows,), start + 1, dtype=torch.int64)
        prog(_step(rows, tables[:rows].contiguous(), lens, slots, cos, sin, x))
        want_qkv = pointwise.rms_norm(x, None, norm_w, 1e-6)[0] @ w.t()
        qk = apply_rotary(want_qkv[:, : (H + KV) * D].view(rows, H + KV, D), cos[:, None], sin[:, None])
        ref_k.view(-1, KV, D)[slots] = qk[:, H:]
        ref_v.view(-1, KV, D)[slots] = want_qkv[:, (H + KV) * D :].view(rows, KV, D)
        want = decode_attn.reference(qk[:, :H].contiguous(), ref_k, ref_v, tables[:rows], lens, D**-0.5)
        assert torch.allclose(k_cache, ref_k, atol=1e-5) and torch.allclose(v_cache, ref_v, atol=1e-5)
        assert torch.allclose(out[:rows].view(rows, H, D), want, atol=1e-4, rtol=1e-4)


def test_an_op_of_unknown_kind_stops_the_program() -> None:
    lib = program.library()
    assert lib is not None
    out = torch.zeros(1)
    table = torch.zeros(2, program.OP_WIDTH, dtype=torch.int64)
    table[0, 0] = 99  # no such kind: nothing runs
    with pytest.raises(RuntimeError, match="op 0 has an unknown kind 99"):
        Program(lib, table, [], out)((0,) * program.NUM_STEP_VALUES)


def test_a_quantized_kernel_without_memory_stops_the_program_with_memory_error() -> None:
    """A quantized GEMM's entry returns -1 when it cannot allocate its buffers: the ops after it do not run and the
    call raises MemoryError, as the kernel's call from Python does. (A Python stand-in for the kernel.)"""
    lib = program.library()
    assert lib is not None
    calls: list[int] = []
    signature = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_int,
                                 *[ctypes.c_void_p] * 5, ctypes.c_int)  # fmt: skip
    failing = signature(lambda m, *rest: calls.append(m) or -1)
    after = signature(lambda m, *rest: calls.append(-m) or 0)
    b = ProgramBuilder()
    out = b.buffer(1, 4, dtype=torch.bfloat16)
    for fn in (failing, after):
        b.i8mm(address(fn), 4, 4, out.data_ptr(), 1, 2, 3, None, out.data_ptr(), silu=False)
    with pytest.raises(MemoryError, match="no memory"):
        b.build(lib, out)((3,) + (0,) * (program.NUM_STEP_VALUES - 1))
    assert calls == [3]  # the rows reached the first; the second never ran


def test_step_arguments_are_read_from_the_step_values() -> None:
    """An argument marked as a step value is its index among them; the others pass as written."""
    b = ProgramBuilder()
    b.rope(1234, 5, 6, 7, 8)
    row = b.rows[0]
    assert row[:2] == [program.OP_ROPE, 1234]
    assert row[3:11] == [ROWS.index, 5, 6, 7, 8, COS.index, SIN.index, program.THREADS.index]
    assert row[2] == 1 << 0 | 1 << 5 | 1 << 6 | 1 << 7  # which of them are step values
