"""The program executor's ops for DeepSeek's decode step (engine/kernels/program.c, engine.models.deepseek_program)
on every CPU, in float32: each against the Python call of the same kernel or the torch code it stands for, over
two steps of different rows (the step's rows, slots and angles move; the buffers stay)."""

from __future__ import annotations

import torch

from engine.kernels import pointwise, program, wbf16
from engine.kernels.grouped import GroupedLinear
from engine.kernels.pointwise import route_config
from engine.kernels.program import INPUT, ProgramBuilder, address
from engine.layers.moe import MoEGate

F32, ES = torch.float32, 4
WIDTH, H, NOPE, R, Q_LORA, LAT = 4, 3, 16, 8, 20, 32  # rows of the class, heads, dims


def _step(rows: int, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> tuple[int, ...]:
    return (rows, 0, 0, 0, slots.data_ptr(), cos.data_ptr(), sin.data_ptr(), torch.get_num_threads(), x.data_ptr())


def test_mla_pieces_compute_what_the_layer_computes() -> None:
    """A strided slice's norm, RoPE on pairs of strided heads, [rows][heads] to [heads][rows] and back, rows into
    the cache at the step's slots, and a grouped call's counts filled with the step's rows."""
    lib, pw = program.library(), pointwise.kernel()
    assert lib is not None and pw is not None
    g = torch.Generator().manual_seed(0)
    cols = Q_LORA + LAT + R  # [q_a | c | k_pe], as MLA's input projection writes it
    norm_w = 1 + 0.1 * torch.randn(Q_LORA, generator=g)
    cache = torch.zeros(16, LAT + R)
    b = ProgramBuilder()
    normed, heads, back = (b.buffer(WIDTH, c, dtype=F32) for c in (Q_LORA, H * NOPE, H * NOPE))
    counts = b.buffer(H, dtype=torch.int64)
    q_in = b.buffer(WIDTH, H * (NOPE + R), dtype=F32)
    x_in = b.buffer(WIDTH, cols, dtype=F32)
    b.copy(1, cols * ES, INPUT, cols * ES, 0, x_in.data_ptr(), cols * ES, 0)  # the step's input
    b.norm_rows(address(pw.norm_entry(F32)), Q_LORA, x_in.data_ptr(), cols * ES, norm_w.data_ptr(), 1e-6,
                normed.data_ptr(), Q_LORA * ES)  # fmt: skip
    rope = address(pw.rope_pairs_entry(F32))
    b.rope_pairs(rope, H, R, q_in.data_ptr() + NOPE * ES, H * (NOPE + R), NOPE + R)
    b.rope_pairs(rope, 1, R, x_in.data_ptr() + (Q_LORA + LAT) * ES, cols, R)
    b.scatter((LAT + R) * ES, x_in.data_ptr() + Q_LORA * ES, cols * ES, cache.data_ptr())
    b.copy(H, NOPE * ES, q_in.data_ptr(), H * (NOPE + R) * ES, (NOPE + R) * ES, heads.data_ptr(), NOPE * ES, 0)
    b.copy(H, NOPE * ES, heads.data_ptr(), NOPE * ES, 0, back.data_ptr(), H * NOPE * ES, NOPE * ES)
    b.fill_rows(H, counts.data_ptr())
    prog = b.build(lib, normed)
    want_cache = cache.clone()
    for rows in (3, 1):
        x = torch.randn(rows, cols, generator=g)
        qr = torch.randn(rows, H, NOPE + R, generator=g)
        q_in[:rows] = qr.view(rows, -1)
        angles = torch.randn(rows, R // 2, generator=g).repeat(1, 2)
        cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
        slots = torch.randperm(16, generator=g)[:rows]
        prog(_step(rows, slots, cos, sin, x))
        assert torch.equal(normed[:rows], pw.rms_norm(x[:, :Q_LORA], None, norm_w, 1e-6)[0])
        want_q = qr.clone()
        pw.rotary_interleaved(want_q[..., NOPE:], cos[:, None], sin[:, None])
        assert torch.equal(q_in[:rows].view(rows, H, -1), want_q)
        k_pe = pw.rotary_interleaved(x[:, Q_LORA + LAT :].clone(), cos, sin)
        want_cache[slots] = torch.cat((x[:, Q_LORA : Q_LORA + LAT], k_pe), -1)
        assert torch.equal(cache, want_cache)
        nope = want_q[..., :NOPE]
        assert torch.equal(heads.flatten()[: rows * H * NOPE].view(H, rows, NOPE), nope.transpose(0, 1))
        assert torch.equal(back[:rows].view(rows, H, NOPE), nope)
        assert counts.tolist() == [rows] * H


def test_moe_ops_compute_what_the_layer_computes() -> None:
    """Routing and grouping, the experts' grouped call over the counts the routing wrote, and the combine."""
    lib, pw, gemm = program.library(), pointwise.kernel(), wbf16.kernel()
    assert lib is not None and pw is not None and gemm is not None
    g = torch.Generator().manual_seed(1)
    hidden, experts, k, n = 32, 6, 2, 48
    gate = MoEGate(hidden, experts, k, "softmax", 1, 1, False, 1.5)
    gate.weight.data = torch.randn(experts, hidden, generator=g) * hidden**-0.5
    config = route_config(gate)
    weights = [torch.randn(n, hidden, generator=g).bfloat16() for _ in range(experts)]
    grouped = GroupedLinear(gemm, weights)
    down = GroupedLinear(gemm, [torch.randn(hidden, n, generator=g).bfloat16() for _ in range(experts)])
    b = ProgramBuilder()
    x_in = b.buffer(WIDTH, hidden, dtype=F32)
    w_buf, ids = b.buffer(WIDTH, k, dtype=F32), b.buffer(WIDTH, k, dtype=torch.int64)
    order, counts = b.buffer(WIDTH * k, dtype=torch.int64), b.buffer(experts, dtype=torch.int64)
    xs, up, ys = (b.buffer(WIDTH * k, c, dtype=F32) for c in (hidden, n, hidden))
    shared, out = b.buffer(WIDTH, hidden, dtype=F32), b.buffer(WIDTH, hidden, dtype=F32)
    b.copy(1, hidden * ES, INPUT, hidden * ES, 0, x_in.data_ptr(), hidden * ES, 0)
    b.route(address(pw.route_entry(F32)), hidden, experts, k, x_in.data_ptr(), gate.weight.data_ptr(), None,
            config.data_ptr(), 1.5, w_buf.data_ptr(), ids.data_ptr(), order.data_ptr(), counts.data_ptr(),
            xs.data_ptr())  # fmt: skip
    grouped.emit(b, counts.data_ptr(), xs.data_ptr(), up.data_ptr())
    down.emit(b, counts.data_ptr(), up.data_ptr(), ys.data_ptr())
    b.combine(address(pw.combine_entry(F32)), k, hidden, order.data_ptr(), ys.data_ptr(), w_buf.data_ptr(),
              shared.data_ptr(), out.data_ptr())  # fmt: skip
    prog = b.build(lib, out)
    for rows in (4, 2):
        x = torch.randn(rows, hidden, generator=g)
        shared[:rows] = torch.randn(rows, hidden, generator=g)
        none = torch.empty(0)
        prog(_step(rows, none, none, none, x))
        want_w, want_ids, want_order, want_counts, want_xs = pw.route(x, gate)
        assert torch.equal(w_buf[:rows], want_w) and torch.equal(ids[:rows], want_ids)
        assert torch.equal(order[: rows * k], want_order) and torch.equal(counts, want_counts)
        assert torch.equal(xs[: rows * k], want_xs)
        want_ys = down(grouped(want_xs, want_counts.tolist()), want_counts.tolist())
        assert torch.equal(ys[: rows * k], want_ys)
        assert torch.equal(out[:rows], pw.moe_combine(want_ys, want_order, want_w, shared[:rows], rows))


def test_the_int4_w_uk_ops_scale_per_latent_group_and_merge_as_torch_does() -> None:
    """MLA's query scaled per latent group ([heads][rows] → [heads][groups][rows], rounded to bf16 as torch rounds
    float32; a NaN stays one) and the products by group back to [heads][rows][latent] (engine.quant.absorbed_key);
    a profiled run adds each op's wall time and computes the same."""
    lib = program.library()
    assert lib is not None
    g = torch.Generator().manual_seed(2)
    groups, gs, bf = 4, 8, torch.bfloat16
    scales = torch.rand(H, groups, NOPE, generator=g) * 3 + 1e-3
    b = ProgramBuilder()
    x, xs = b.buffer(H * WIDTH, NOPE, dtype=bf), b.buffer(H * groups * WIDTH, NOPE, dtype=bf)
    ys, y = b.buffer(H * groups * WIDTH, gs, dtype=bf), b.buffer(H * WIDTH, groups * gs, dtype=bf)
    b.scale_groups(H, groups, NOPE, x.data_ptr(), scales.data_ptr(), xs.data_ptr())
    b.merge_groups(H, groups, gs * 2, ys.data_ptr(), y.data_ptr())
    prog = b.build(lib, y)
    for rows, profiled in ((3, False), (1, True)):
        ns = prog.profile() if profiled else None
        xr = torch.randn(H, rows, NOPE, generator=g).bfloat16()
        xr[0, 0, 0] = float("nan")
        x[: H * rows] = xr.view(-1, NOPE)
        yr = torch.randn(H, groups, rows, gs, generator=g).bfloat16()
        ys[: H * groups * rows] = yr.view(-1, gs)
        prog(_step(rows, torch.zeros(1), torch.zeros(1), torch.zeros(1), x))
        want = (xr.view(H, 1, rows, NOPE).float() * scales.view(H, groups, 1, NOPE)).to(bf)
        got = xs[: H * groups * rows].view(H, groups, rows, NOPE)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # the same values, a NaN a NaN
        assert torch.equal(y[: H * rows].view(H, rows, -1), yr.transpose(1, 2).reshape(H, rows, -1))
        if ns is not None:
            assert ns.shape == (2, 2) and bool((ns > 0).all()) and bool((ns[1] <= ns[0]).all())  # sums, bests
