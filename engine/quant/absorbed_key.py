"""MLA decode's W_UK product (q_nope W_UK per head) over kv_b_proj's own 4-bit key rows, about a third of the bf16
copy's bytes with their scales.

kv_b_proj's int4 rows run along the latent (its inputs), grouped there: row n of head h holds W_UK[n, l] =
s[n, g(l)] (q[n, l] - 8) (symmetric). W_UK's product sums over n, and within a latent group the scale changes with
n, so no int4 GEMM's per-(output, input group) scale can carry it; but the scale moves onto the input:

    q_lat[l] = sum_n (x[n] s[n, g]) (q[n, l] - 8)          for l in latent group g

so each head and latent group is one int4 product over N = nope inputs with unit scales: the query scaled per
group (x'[h, g, n] = x[h, n] s[h, n, g], rounded to bf16 as every W4A16 kernel's input is) through the checkpoint's
codes transposed. One grouped call runs all heads * groups of them. Checkpoints with zero points keep the bf16
copy (a zero point per n would leave a sum per group to subtract).

WHY: DeepSeek-V2-tiny's W4A16 decode step at batch 1 read its bf16 W_UK (1 MiB a layer, ~8% of the step's bytes)
beside int4 everything else; kv_b_proj's value rows (W_UV) already run from the checkpoint's rows
(MLAttention.absorbed_quantized).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.grouped import GroupedLinear
from engine.kernels.program import ProgramBuilder
from engine.quant.grouped import GroupedQuantLinear, QuantKernel, rows_dtype
from engine.quant.weights import Int4Weight, pack_nibbles


@dataclass(slots=True)
class KeyPieces:
    """W_UK as int4 products: per head and latent group (head-major), the codes [group, nope] with unit scales
    (zero 8, one group over all of nope), and the scales the query takes per group, float32 [heads, groups, nope]."""

    weights: list[Int4Weight]
    scales: torch.Tensor


def key_pieces(kv_b: Int4Weight, heads: int, nope: int, v_dim: int) -> KeyPieces | None:
    """kv_b_proj's int4 weight [heads * (nope + v_dim), latent] → its key rows as KeyPieces; None where it has
    zero points other than 8 or nope is no multiple of 4 (the W4A16 kernels' input step)."""
    if not bool((kv_b.zero == 8).all()) or nope % 4:
        return None
    per, gs = nope + v_dim, kv_b.group_size
    weights, scales = [], []
    for h in range(heads):
        rows = kv_b.rows(h * per, h * per + nope)  # [nope, latent]
        codes = rows.values()
        for g in range(rows.shape[1] // gs):
            piece = codes[:, g * gs : (g + 1) * gs].t()  # [gs, nope]: this group's latents out, nope in
            unit, eight = torch.ones(gs, 1), torch.full((gs, 1), 8, dtype=torch.uint8)
            weights.append(Int4Weight(pack_nibbles(piece.contiguous()), unit, eight, nope))
        scales.append(rows.scale.float().t())  # [groups, nope]
    return KeyPieces(weights, torch.stack(scales).contiguous())


ONE_ROW = 1  # the most rows a step takes the int4 call for; more go through the bf16 grouped call


class GroupScaledKey:
    """W_UK per head as one grouped int4 call (KeyPieces) for a single row, and through `wide` (the bf16 grouped
    call over the dequantized W_UK) for more: x [heads * rows, nope] heads-major → [heads * rows, latent], as
    MLAttention's grouped W_UK call takes and gives them. Without `wide` (float32 math, where the dequantized W_UK
    holds no bf16 weights for a grouped call) the int4 call takes every row count, the query scaled in float32.

    WHY one row only: there the int4 call won (48 against 58 µs for DeepSeek-V2-tiny's 16 heads, from memory, as
    a program runs both on a 2-core Zen 4); at 8, 32 and 128 rows it lost (98 / 236 / 938 against 65 / 164 /
    623 µs): the scaled query is rows x groups as large as the query, and the products come out by group."""

    def __init__(self, kernel: QuantKernel, pieces: KeyPieces, wide: GroupedLinear | None) -> None:
        self.kernel, self.wide = kernel, wide
        self.grouped = GroupedQuantLinear(kernel, pieces.weights)  # type: ignore[arg-type]
        self.dtype = rows_dtype(kernel)  # the scaled query's and the products' type
        self.scales = pieces.scales
        self.heads, self.groups, self.k = pieces.scales.shape
        self.n = self.groups * self.grouped.n  # latent
        assert wide is None or (wide.n, wide.k, len(wide.packed)) == (self.n, self.k, self.heads)

    def wide_at(self, rows: int) -> bool:
        """Whether a step of `rows` rows takes the bf16 call rather than the int4 one."""
        return rows > ONE_ROW and self.wide is not None

    @staticmethod
    def accepts(kernel: QuantKernel, pieces: KeyPieces) -> bool:
        return GroupedQuantLinear.accepts(kernel, pieces.weights)  # type: ignore[arg-type]

    def __call__(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """counts: rows per head, all the same (a decode step's rows)."""
        h, g, k = self.scales.shape
        if len(counts) != h or len(set(counts)) != 1 or x.shape != (h * counts[0], k):
            raise ValueError(f"{len(counts)} heads of {counts[:1]} rows for {h} heads, x {tuple(x.shape)}")
        rows = counts[0]
        if self.wide_at(rows):
            return self.wide(x, counts)  # type: ignore[misc]
        xs = (x.view(h, 1, rows, k).float() * self.scales.view(h, g, 1, k)).to(self.dtype)
        y = self.grouped(xs.view(-1, k), [rows] * (h * g))  # [heads][groups][rows][gs]
        return y.view(h, g, rows, -1).transpose(1, 2).reshape(h * rows, self.n).to(x.dtype)

    def emit(self, b: ProgramBuilder, counts: int, x: int, y: int, width: int) -> None:
        """This call in a decode program of up to `width` rows: x [heads][rows][nope] and y [heads][rows][latent],
        in the kernel's row type (pointers); `counts`: the heads' rows, for the bf16 call past one row. The int4
        call: the scaled queries, the products by group and their counts in buffers of its own."""
        if self.wide_at(width):
            self.wide.emit(b, counts, x, y)  # type: ignore[union-attr]
            return
        h, g, k = self.scales.shape
        pieces = b.buffer(h * g, dtype=torch.int64)  # rows per head and group
        xs = b.buffer(h * g * width, k, dtype=self.dtype)
        ys = b.buffer(h * g * width, self.grouped.n, dtype=self.dtype)
        b.fill_rows(h * g, pieces.data_ptr())
        b.scale_groups(h, g, k, x, self.scales.data_ptr(), xs.data_ptr(), self.dtype == torch.float32)
        self.grouped.emit(b, pieces.data_ptr(), xs.data_ptr(), ys.data_ptr())
        b.merge_groups(h, g, self.grouped.n * ys.element_size(), ys.data_ptr(), y)
        b.keep += [self.scales]
