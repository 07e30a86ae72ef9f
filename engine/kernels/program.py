"""A fixed list of kernel calls run by one C call (engine/kernels/program.c): a decode step without Python.

At batch 1 a small model's kernels take a few microseconds each, and reaching each of them from Python took
longer than running it: module calls, argument checks, a `torch.empty` per output and the ctypes call came to
~100 us a layer on a Zen 4 (`qwen2-0.5b-hollow`, docs/PERFORMANCE.md). A `Program` records the calls once, with
their weights, caches and buffers, and replays them in C; what changes between steps (the rows, the block tables,
the context lengths, the cache slots, the rotary angles, the input) is read from a handful of step values.

The entry points are the kernels' own (bf16mm.c, amxmm.c, wbf16.c, i8mm.c / i8amx.c, w4mm.c / w4amx.c / w4fp16.c,
their grouped entries, pointwise.c, decode_attn*.c), called with the same arguments as from Python, so a program
computes exactly what the layers compute; torch code with no kernel (a gated MLP's act after a plain GEMM) runs
between two C calls. A few ops are the executor's own: K/V rows into the cache, copies between [rows][heads] and
[heads][rows] layouts, a grouped call's row counts (MLA's per-head products), MLA's query scaled per latent group
for its int4 W_UK (engine.quant.absorbed_key).
"""

from __future__ import annotations

import ctypes
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.kernels.cbuild import Once, build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("program.c")
OP_WIDTH = 20  # as in program.c
OP_GEMM, OP_NORM, OP_ROPE, OP_STORE, OP_ATTN, OP_I8, OP_I8_SILU, OP_W4 = 1, 2, 3, 4, 5, 6, 7, 8
OP_NORM_ROWS, OP_ROPE_PAIRS, OP_COPY, OP_SCATTER, OP_FILL, OP_GROUPED = 9, 10, 11, 12, 13, 14
OP_GROUPED_W4, OP_GROUPED_I8, OP_ROUTE, OP_COMBINE = 15, 16, 17, 18
OP_SCALE_GROUPS, OP_MERGE_GROUPS = 19, 20
# ops that may fail: no memory for the kernel's buffers
MAY_FAIL = (OP_I8, OP_I8_SILU, OP_W4, OP_GROUPED_W4, OP_GROUPED_I8, OP_COMBINE)


@dataclass(frozen=True, slots=True)
class Step:
    """An argument read from the step's values when the program runs (its index among them)."""

    index: int


ROWS, TABLES, TABLE_WIDTH, LENS, SLOTS, COS, SIN, THREADS, INPUT = (Step(i) for i in range(9))
NUM_STEP_VALUES = 9
Arg = int | Step | None
Hook = Callable[[int], object]  # Python between two runs of C calls, given the step's rows


def timing_step(rows: int, x: int = 0) -> tuple[int, ...]:
    """The step values for running a program outside a decode step (to time it): `rows` rows of input `x`, torch's
    threads; no cache, tables or angles."""
    values = [0] * NUM_STEP_VALUES
    values[ROWS.index], values[THREADS.index], values[INPUT.index] = rows, torch.get_num_threads(), x
    return tuple(values)


def f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def address(fn: Any) -> int:
    """A ctypes function's entry point."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


class ProgramBuilder:
    """Ops in the order they run. Pointers are plain ints: whoever builds a program keeps what they point to alive
    (`keep`)."""

    def __init__(self) -> None:
        self.rows: list[list[int]] = []
        self.keep: list[object] = []  # tensors, packed weights, ctypes arrays of pointers
        self.hooks: list[tuple[int, Hook]] = []  # (ops before it, the Python to run there)

    def _op(self, kind: int, fn: int, *args: Arg) -> None:
        assert len(args) <= OP_WIDTH - 3
        row = [kind, fn, 0] + [0] * (OP_WIDTH - 3)
        for j, a in enumerate(args):
            if isinstance(a, Step):
                row[2] |= 1 << j
                row[3 + j] = a.index
            else:
                row[3 + j] = 0 if a is None else int(a)
        self.rows.append(row)

    def gemm(self, fn: int, n: int, k: int, x: Arg, w: int, bias: int | None, y: int) -> None:
        """y[rows, n] = x[rows, k] through an entry point taking engine.kernels.gemm.run_bf16's arguments (bf16mm,
        amxmm, wbf16 and their fused SiLU entries)."""
        self._op(OP_GEMM, fn, ROWS, n, k, x, w, bias, y, THREADS)

    def i8mm(
        self, fn: int, n: int, k: int, x: int, packed: int, colsum: int, scale: int, bias: int | None, y: int,
        silu: bool, bf16: bool = True,
    ) -> None:  # fmt: skip
        """W8A8 (i8mm.c / i8amx.c): y = x W^T + b over bf16 rows (or float32 ones, `bf16` False: the plain entry
        takes both), or silu(gate) * up through the fused entry (bf16 rows)."""
        if silu:
            self._op(OP_I8_SILU, fn, ROWS, n, k, x, packed, colsum, scale, bias, y, THREADS)
        else:
            self._op(OP_I8, fn, ROWS, n, k, x, int(bf16), packed, colsum, scale, bias, y, THREADS)

    def w4mm(
        self, fn: int, n: int, k: int, group: int, x: int, nibbles: int, scales: int, bias: int | None, y: int
    ) -> None:
        """W4A16 (w4mm.c / w4amx.c / w4fp16.c, bf16 rows): any of their entry points, plain or fused."""
        self._op(OP_W4, fn, ROWS, n, k, group, x, nibbles, scales, bias, y, THREADS)

    def norm(self, fn: int, dim: int, x: Arg, residual: Arg, w: int, eps: float, out: int, total: Arg) -> None:
        """out = RMSNorm(x + residual), total = x + residual (pointwise.c; `total` may be `residual` itself)."""
        self._op(OP_NORM, fn, ROWS, dim, x, residual, w, f32_bits(eps), out, total, THREADS)

    def rope(self, fn: int, heads: int, head_dim: int, x: int, ld: int) -> None:
        """RoPE in place over [rows][heads][head_dim], rows `ld` elements apart (pointwise.c)."""
        self._op(OP_ROPE, fn, ROWS, heads, head_dim, x, ld, COS, SIN, THREADS)

    def store(
        self, ld: int, q: int, q_bytes: int, q_out: int, k: int, v: int, kv_bytes: int, k_cache: int, v_cache: int
    ) -> None:
        """K and V rows into the cache at the step's slots; the query rows into a dense buffer (bytes)."""
        self._op(OP_STORE, 0, ROWS, ld, q, q_bytes, q_out, k, v, kv_bytes, k_cache, v_cache, SLOTS)

    def attention(
        self, fn: int, heads: int, kv_heads: int, head_dim: int, q: int, k_cache: int, v_cache: int, block_size: int,
        scale: float, out: int,
    ) -> None:  # fmt: skip
        """Decode attention over the paged cache (decode_attn*.c's arguments)."""
        args = (ROWS, heads, kv_heads, head_dim, q, k_cache, v_cache, block_size, TABLES, TABLE_WIDTH, LENS)
        self._op(OP_ATTN, fn, *args, f32_bits(scale), out, THREADS)

    def norm_rows(self, fn: int, dim: int, x: int, ldx: int, w: int, eps: float, out: int, ldo: int) -> None:
        """out = RMSNorm(x) row by row, rows `ldx` and `ldo` bytes apart (a slice of a wider output; no residual)."""
        self._op(OP_NORM_ROWS, fn, ROWS, dim, x, ldx, w, f32_bits(eps), out, ldo, THREADS)

    def rope_pairs(self, fn: int, heads: int, head_dim: int, x: int, ld: int, head_ld: int) -> None:
        """RoPE on interleaved pairs in place over [rows][heads][head_dim], rows `ld` and heads `head_ld` elements
        apart (pointwise.c's rope_interleaved)."""
        self._op(OP_ROPE_PAIRS, fn, ROWS, heads, head_dim, x, ld, head_ld, COS, SIN, THREADS)

    def copy(
        self, heads: int, nbytes: int, src: Arg, s_row: int, s_head: int, dst: int, d_row: int, d_head: int
    ) -> None:
        """Each row's `heads` runs of `nbytes` from src to dst, strides in bytes; a head stride of 0 means the
        [heads][rows] layout of a grouped call (rows times the row stride)."""
        self._op(OP_COPY, 0, ROWS, heads, nbytes, src, s_row, s_head, dst, d_row, d_head)

    def scatter(self, nbytes: int, src: int, s_row: int, cache: int) -> None:
        """Row r (`nbytes` of it) into the cache's slot the step gives it (rows of `nbytes`)."""
        self._op(OP_SCATTER, 0, ROWS, nbytes, src, s_row, cache, SLOTS)

    def fill_rows(self, n: int, counts: int) -> None:
        """counts[0..n) = the step's rows (a grouped call's rows per layer, every layer taking each row)."""
        self._op(OP_FILL, 0, n, ROWS, counts)

    def grouped(
        self, kind: int, fn: int, groups: int, counts: int, n: int, k: int, x: int, weights: Sequence[int], y: int,
        silu: bool, group_size: int = 0,
    ) -> None:  # fmt: skip
        """A grouped entry (OP_GROUPED: bf16mm / amxmm / wbf16; OP_GROUPED_W4: w4mm / w4amx, `group_size`;
        OP_GROUPED_I8: i8mm / i8amx), layer g taking counts[g] rows; `weights`: the entry's pointer arrays."""
        shape = (n, k, group_size) if kind == OP_GROUPED_W4 else (n, k)
        self._op(kind, fn, groups, counts, *shape, x, *weights, y, THREADS, int(silu))

    def scale_groups(self, heads: int, groups: int, n: int, x: int, scales: int, out: int, f32: bool = False) -> None:
        """out [heads][groups][rows][n] = x [heads][rows][n] times scales [heads][groups][n] (float32), rounded to
        bf16 (x bf16), or with `f32` x and out float32 (float32 math): MLA's query scaled per latent group for
        W_UK's int4 products (engine.quant.absorbed_key)."""
        self._op(OP_SCALE_GROUPS, 0, ROWS, heads, groups, n, x, scales, out, int(f32))

    def merge_groups(self, heads: int, groups: int, nbytes: int, src: int, dst: int) -> None:
        """dst [heads][rows][groups * nbytes] from src [heads][groups][rows][nbytes]: the products by latent group
        back to each head's rows."""
        self._op(OP_MERGE_GROUPS, 0, ROWS, heads, groups, nbytes, src, dst)

    def route(
        self, fn: int, hidden: int, experts: int, top_k: int, x: int, w: int, bias: int | None, config: int,
        scale: float, weights: int, ids: int, order: int, counts: int, xs: int,
    ) -> None:  # fmt: skip
        """A MoE layer's routing and grouping (pointwise.c's moe_route; `config`: its route_t as 4 int64) of the
        step's rows."""
        self._op(OP_ROUTE, fn, ROWS, hidden, experts, top_k, x, w, bias, config, f32_bits(scale), weights, ids,
                 order, counts, xs, THREADS)  # fmt: skip

    def combine(
        self, fn: int, top_k: int, hidden: int, order: int, ys: int, weights: int, shared: int | None, out: int
    ) -> None:
        """A MoE layer's output from its routed rows (the step's rows times top_k) and shared rows (pointwise.c)."""
        self._op(OP_COMBINE, fn, ROWS, top_k, hidden, order, ys, weights, shared, out, THREADS)

    def python(self, hook: Hook) -> None:
        """Stop the C calls here for `hook(rows)` (torch code that has no C kernel), then go on."""
        self.hooks.append((len(self.rows), hook))

    def buffer(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(*shape, dtype=dtype)
        self.keep.append(t)
        return t

    def build(self, lib: ctypes.CDLL, output: torch.Tensor) -> Program:
        return Program(lib, torch.tensor(self.rows, dtype=torch.int64), self.keep, output, self.hooks)


class Program:
    """The ops, and `output`: the buffer whose first rows hold the result after a call. `hooks`: Python run
    between the C calls, each after the ops before it."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        table: torch.Tensor,
        keep: list[object],
        output: torch.Tensor,
        hooks: Sequence[tuple[int, Hook]] = (),
    ) -> None:
        self.lib, self.table, self.keep, self.output = lib, table, keep, output
        self.n = table.shape[0]
        segments: list[tuple[int, int, Hook | None]] = []
        start = 0
        for at, hook in hooks:
            segments.append((start, at - start, hook))
            start = at
        segments.append((start, self.n - start, None))
        row_bytes = table.element_size() * OP_WIDTH
        self._segments = [(table.data_ptr() + a * row_bytes, a, n, hook) for a, n, hook in segments]
        self.python_calls = len(segments) - 1  # hooks a run makes between its C calls
        self.op_ns: torch.Tensor | None = None  # float64 [2, ops]: each op's summed and least wall time (profile())

    def profile(self) -> torch.Tensor:
        """From now on time each op (benchmarks.program_ops): the returned zeros [2, ops] get, per op, the sum of
        its wall times (ns) and the least of them. WHY both: on a shared VM an op's mean ran 25-35% above its best,
        which is what the kernel selection's timings (a best of several) compare with."""
        self.op_ns = torch.zeros(2, self.n, dtype=torch.float64)
        return self.op_ns

    def __call__(self, step: Sequence[int]) -> None:
        values = (ctypes.c_int64 * NUM_STEP_VALUES)(*step)
        for ops, first, n, hook in self._segments:
            if self.op_ns is None:
                done = self.lib.program_run(ops, n, values)
            else:
                sums, least = (self.op_ns[j].data_ptr() + first * 8 for j in (0, 1))
                done = self.lib.program_run_timed(ops, n, values, sums, least)
            if done != n:
                kind = int(self.table[first + done, 0])
                if kind in MAY_FAIL:
                    raise MemoryError("a kernel of the decode program found no memory for its buffers")
                # a table this module wrote cannot hold another kind: a bug, never input
                raise RuntimeError(f"program op {first + done} has an unknown kind {kind}")
            if hook is not None:
                hook(step[ROWS.index])


def _load() -> ctypes.CDLL:
    lib = build(SOURCE, ("-march=native",))
    lib.program_run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.program_run.restype = ctypes.c_int64
    lib.program_run_timed.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
    lib.program_run_timed.restype = ctypes.c_int64
    return lib


# the executor is a loop and a switch: checked through the programs' own parity with the layers (tests)
library = Once(_load, log, "decode steps will call each kernel from Python (slower at small batches)")
