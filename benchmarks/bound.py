"""What the machine allows for a workload: measured GEMM peak and memory read bandwidth → a time bound.

    python -m benchmarks.bound [--shape qwen2-0.5b] [--dtype bfloat16]

Batch-1 decode streams every weight once per token, so it is bounded by read bandwidth; a batch step by
whichever of its FLOPs at the GEMM peak and its weight bytes at the read bandwidth takes longer. Attention and
everything outside the GEMMs are left out, so real engines stay above (slower than) the bound.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from benchmarks.shapes import SHAPES, checkpoint
from benchmarks.timing import best_seconds
from engine.hugepages import collapse_resident
from engine.kernels.bind import gemm_paths


@dataclass(slots=True)
class Machine:
    gemm_gflops: float  # best of the engine's GEMM paths on a prefill-sized product
    read_gbs: float  # a 1 GiB float32 tensor on huge pages summed

    @classmethod
    def measure(cls, dtype: torch.dtype) -> Machine:
        g = torch.Generator().manual_seed(0)
        m, k, n = 4096, 896, 9728
        x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
        runs = [p.prepare(w, None, None) for p in gemm_paths(dtype, 32, True, False)]
        best = min(best_seconds(lambda run=run: run(x), 3) for run in runs)
        big = torch.ones(256 << 20, dtype=torch.float32)
        start = big.data_ptr()  # on 2 MiB pages, as the engine's weights are (engine.hugepages): ~10% faster here
        collapse_resident(within=(start, start + big.numel() * 4))
        read = best_seconds(big.sum, 3)
        return cls(2 * m * k * n / best / 1e9, big.numel() * 4 / read / 1e9)


_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


@dataclass(slots=True)
class Workload:
    params: int  # weights one token passes through in the decoder (an MoE: only its top-k routed experts)
    head_params: int  # the LM head's, applied only to the sampled rows
    all_bytes: int  # every weight a batch step reads (all experts, the head; not the embedding table)
    token_bytes: int  # what one token's step reads

    @classmethod
    def of(cls, path: Path, dtype: torch.dtype) -> Workload:
        config = json.loads((path / "config.json").read_text())
        numel: dict[str, int] = {}
        stored = 0  # the checkpoint's widest weight element, in bytes
        for f in path.glob("*.safetensors"):
            with safe_open(f, "pt") as st:
                for name in st.keys():  # noqa: SIM118  # safe_open has no __iter__
                    piece = st.get_slice(name)
                    numel[name] = math.prod(piece.get_shape())
                    stored = max(stored, _ITEMSIZE.get(piece.get_dtype(), 4))
        head = numel.get("lm_head.weight") or numel["model.embed_tokens.weight"]  # tied: the table is the head
        body = {k: v for k, v in numel.items() if k not in ("lm_head.weight", "model.embed_tokens.weight")}
        routed = sum(v for k, v in body.items() if ".mlp.experts." in k)
        share = config["num_experts_per_tok"] / config["n_routed_experts"] if routed else 0.0
        per_token = sum(body.values()) - routed + int(routed * share)
        # float32 math over a bf16 checkpoint reads bf16 (the engine keeps such weights bf16 and widens them in
        # registers), so a step reads the narrower of the math's and the checkpoint's element
        itemsize = min(torch.empty(0, dtype=dtype).element_size(), stored)
        return cls(per_token, head, (sum(body.values()) + head) * itemsize, (per_token + head) * itemsize)

    def step_s(self, machine: Machine, rows: int, sampled: int) -> float:
        flops = 2 * (rows * self.params + sampled * self.head_params)
        read = self.token_bytes if rows == 1 else self.all_bytes
        return max(flops / (machine.gemm_gflops * 1e9), read / (machine.read_gbs * 1e9))

    def batch_tok_s(self, machine: Machine, num_prompts: int, prompt_len: int, output_len: int) -> float:
        prefill = self.step_s(machine, num_prompts * prompt_len, num_prompts)
        decode = (output_len - 1) * self.step_s(machine, num_prompts, num_prompts)
        return num_prompts * output_len / (prefill + decode)

    def batch1_ms(self, machine: Machine) -> float:
        return self.step_s(machine, 1, 1) * 1e3

    def describe(self, machine: Machine, num_prompts: int, prompt_len: int, output_len: int) -> str:
        tok_s = self.batch_tok_s(machine, num_prompts, prompt_len, output_len)
        return (
            f"machine bound: GEMM peak {machine.gemm_gflops:.0f} GFLOP/s, read {machine.read_gbs:.1f} GB/s, "
            f"{self.all_bytes / 1e6:.0f} MB of weights -> batch <= {tok_s:.0f} tok/s, "
            f"batch-1 >= {self.batch1_ms(machine):.1f} ms/token"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(Workload.of(checkpoint(args.shape), dtype).describe(Machine.measure(dtype), 32, 128, 128))


if __name__ == "__main__":
    main()
