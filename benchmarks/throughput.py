"""Engine throughput vs HF transformers on the same workload, in the same run.

    python -m benchmarks.throughput [--shape qwen2-0.5b|deepseek-v2-tiny] [--num-prompts 32] [--prompt-len 128]
                                    [--output-len 128] [--vllm /path/to/vllm-venv/bin/python] [--onednn-row]
                                    [--layers-row] [--small-pages-row]
                                    [--quantization w8a8|w4a16 [--group-size 128] [--quantize-lm-head] [--rotate]
                                                               [--alternate N]]
                                    [--device cpu|cuda] [--llamacpp DIR]

With --quantization, the shape's checkpoint is also quantized with `tianmen quantize` (round-to-nearest; kept
beside it for later runs) and a "tianmen <scheme>" row runs on it, beside the bf16 row and the peers; --rotate adds
a row on a `--rotate` copy (its down_proj inputs rotated online: what that costs at run time); --alternate N
then measures the bf16 and the quantized model in turn in one process, N rounds of new prompts, and prints each
round's ratios and their medians (on a VM whose bandwidth drifts, rows minutes apart compare different moments);
with --layers-row instead, it measures the bf16 model with its decode programs and through the layers in turn.

With --llamacpp DIR (llama.cpp's binaries, built from source), llama.cpp runs the same shape exported to GGUF in
BF16 and, with --quantization, in its nearest type (Q8_0 for w8a8, Q4_0 for w4a16: pair it with --group-size 32),
each ratio against our row of the same precision (benchmarks.llamacpp_peer).

With --vllm, vLLM's CPU build runs twice: plain (both cores bound) and with tcmalloc + Intel OpenMP preloaded
(its docs' advice, when both are installed); the better is reported as "vLLM". The machine bound (measured GEMM
peak and read bandwidth, benchmarks.bound) is printed beside the rows.

With --layers-row, a "tianmen-layers" row runs every decode step through the layers' Python instead of as one
program (engine.models.llama_program, deepseek_program), which the default row uses wherever it measured faster.
With --small-pages-row, a "tianmen-small-pages" row runs with huge_pages off (the engine's memory on 4 KiB pages,
engine.hugepages); with --alternate N, both are measured in turn in one process (the huge-page engine built first).

Batch: N prompts of random token ids, greedy, EOS ignored → output tok/s. Batch-1: ms per decoded token. Each
tianmen row first prints its process's resident memory once the engine is loaded (weights as packed for the
chosen kernels, the KV cache, what the allocator keeps).
Each engine runs in a fresh process of its own, so neither inherits the other's threads, caches or malloc
settings (ours keeps freed memory for reuse, see engine/malloc.py; transformers runs as its users run it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

from benchmarks.bound import Machine, Workload
from benchmarks.shapes import SHAPES, checkpoint
from engine import LLM, EngineConfig, SamplingParams
from engine.models.decode_program import TRIALS

T = TypeVar("T")


def ours(
    path: str,
    prompts: list[list[int]],
    n: int,
    dtype: str,
    cpu_kernels: bool = True,
    device: str = "auto",
    decode_program: str = "auto",
    huge_pages: bool = True,
) -> tuple[float, float]:
    llm = engine(path, len(prompts), dtype, cpu_kernels, device, decode_program, huge_pages)
    print(f"{Path(path).name}: {resident_mib():.0f} MiB resident after load", flush=True)  # weights, layouts, KV
    return measure(llm, prompts, n)


def engine(
    path: str, seqs: int, dtype: str, cpu_kernels: bool = True, device: str = "auto", decode_program: str = "auto",
    huge_pages: bool = True,
) -> LLM:  # fmt: skip
    """An engine on `path` for `seqs` sequences at a time, warmed up: long enough for batch-1 decode steps to settle
    whether they run as one program (the batch's steps settle within their first 2 * TRIALS + 2 of a timed run).
    The warm-up's 16 token ids share no prefix with the measured prompts' (random ids, another seed)."""
    config = EngineConfig(
        model=path,
        dtype=dtype,
        device=device,
        max_num_seqs=max(seqs, 1),
        max_model_len=1024,
        cpu_kernels=cpu_kernels,
        decode_program=decode_program,
        huge_pages=huge_pages,
    )
    llm = LLM(config)
    warm = random.Random(1).choices(range(1000), k=16)
    llm.generate([warm], SamplingParams(max_tokens=2 * TRIALS + 4, temperature=0, ignore_eos=True))
    return llm


def measure(llm: LLM, prompts: list[list[int]], n: int) -> tuple[float, float]:
    """Batch tok/s of `prompts` (met for the first time), then batch-1 ms/token (batch_one_ms)."""
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    batch_s = time.perf_counter() - t
    assert all(len(o.token_ids) == n for o in outs)
    return len(prompts) * n / batch_s, batch_one_ms(llm, prompts[0], prompts[1], n)


def batch_one_ms(llm: LLM, warm: list[int], prompt: list[int], n: int) -> float:
    """ms per decoded token of one sequence: `prompt` (already in the prefix cache) decoded for n tokens, less a
    one-token run of `warm` (its cached prefill), over the n - 1 decode steps."""
    t = time.perf_counter()
    llm.generate([warm], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    one_s = time.perf_counter() - t
    return (one_s - prefill_s) / (n - 1) * 1e3


def alternated(
    paths: list[str], rounds: list[list[list[int]]], n: int, dtype: str, device: str = "auto",
    modes: tuple[str, ...] = ("auto", "auto"),
    huge: tuple[bool, ...] = (True, True),
) -> list[list[tuple[float, float]]]:  # fmt: skip
    """Batch tok/s and batch-1 ms/token (as `measure`) of each model in `paths` (engine i with decode_program
    modes[i], huge_pages huge[i]), all loaded in this process and measured in turn, one round per prompt set in
    `rounds` (each set new to every engine): [round][model]. WHY: a shared VM's read bandwidth moved 24-64 GB/s
    within minutes (a 2-core Zen 4, 2026-12-06), and rows run minutes apart in processes of their own compared
    different moments of it; measured in turn, a ratio compares the same one.

    Engines on huge pages are built first: an engine moves all of the process's resident memory to them
    (engine.hugepages), so one on small pages built before it would be moved too. One built after it may still
    reuse freed memory that was moved, so a gain measured this way is a lower bound."""
    order = sorted(range(len(paths)), key=lambda i: not huge[i])
    built = {
        i: engine(paths[i], len(rounds[0]), dtype, device=device, decode_program=modes[i], huge_pages=huge[i])
        for i in order
    }
    llms = [built[i] for i in range(len(paths))]
    return [[measure(llm, prompts, n) for llm in llms] for prompts in rounds]


def resident_mib() -> float:
    """This process's resident memory (Linux VmRSS), MiB; 0 where /proc cannot be read."""
    try:
        line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmRSS"))
    except (OSError, StopIteration):
        return 0.0
    return int(line.split()[1]) / 1024


def hf(path: str, prompts: list[list[int]], n: int, dtype: torch.dtype, device: str = "cpu") -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def timed(ids: list[list[int]], tokens: int) -> float:
        t = time.perf_counter()
        model.generate(torch.tensor(ids, device=device), max_new_tokens=tokens, min_new_tokens=tokens, **kw)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t

    with torch.inference_mode():
        timed([prompts[0][:16]], 4)
        batch_s = timed(prompts, n)
        prefill_s = timed([prompts[0]], 1)
        one_s = timed([prompts[1]], n)
    return len(prompts) * n / batch_s, (one_s - prefill_s) / (n - 1) * 1e3


def vllm(
    python: str, path: str, prompts: list[list[int]], n: int, dtype: str, preload: str = ""
) -> tuple[float, float]:
    """The same workload on vLLM's CPU build, in its own venv (`python` is that venv's interpreter); `preload`
    goes to LD_PRELOAD (tcmalloc and Intel OpenMP, as vLLM's CPU docs recommend)."""
    env = dict(os.environ, LD_PRELOAD=preload) if preload else None
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(prompts, f)
        f.flush()
        script = Path(__file__).with_name("vllm_peer.py")
        done = subprocess.run(
            [python, str(script), path, f.name, str(n), dtype], capture_output=True, text=True, check=False, env=env
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:] or ['no output']}")
    result = json.loads(lines[0][7:])
    VLLM_VERSION[0] = result["version"]
    return result["batch_tok_s"], result["ms_per_token"]


VLLM_VERSION = ["?"]


def vllm_preloads(python: str) -> str:
    """tcmalloc and the vLLM venv's Intel OpenMP, where both are installed; '' otherwise."""
    venv_lib = Path(python).absolute().parent.parent / "lib"  # not resolve(): a venv python links to the base one
    iomp = next(iter(venv_lib.glob("libiomp5.so")), None)
    tcmalloc = next(
        (p for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib") for p in Path(d).glob("libtcmalloc.so*")),
        None,
    )
    return f"{tcmalloc}:{iomp}" if tcmalloc and iomp else ""


def isolated(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) in a fresh interpreter (spawned, not forked)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    ap.add_argument(
        "--onednn-row", action="store_true", help="also run tianmen with cpu_kernels off (every GEMM in oneDNN)"
    )
    ap.add_argument(
        "--layers-row", action="store_true", help="also run tianmen with every decode step through the layers' Python"
    )
    ap.add_argument("--small-pages-row", action="store_true", help="also run tianmen with huge_pages off (4 KiB pages)")
    ap.add_argument("--vllm", metavar="PYTHON", help="also run vLLM's CPU build with this venv's python")
    ap.add_argument("--quantization", choices=["w8a8", "w4a16"], help="also run tianmen on a quantized copy")
    ap.add_argument("--group-size", type=int, default=128, help="W4A16's group size")
    ap.add_argument("--quantize-lm-head", action="store_true", help="quantize the LM head too (tied: its own copy)")
    ap.add_argument("--rotate", action="store_true", help="with --quantization: a row on a rotated copy too")
    ap.add_argument(
        "--alternate", type=int, default=0, metavar="N",
        help="with --quantization, --layers-row or --small-pages-row: also N rounds of both rows' engines in one "
        "process, in turn",
    )  # fmt: skip
    ap.add_argument("--device", default="cpu", help="cpu, or cuda[:N]: both tianmen and transformers run there")
    ap.add_argument("--llamacpp", metavar="DIR", help="also run llama.cpp (its binaries in DIR): BF16, and Q8_0 / Q4_0")
    args = ap.parse_args()
    if args.alternate < 0 or (args.alternate and not (args.quantization or args.layers_row or args.small_pages_row)):
        ap.error("--alternate takes a number of rounds >= 0, with --quantization, --layers-row or --small-pages-row")

    path = str(checkpoint(args.shape))
    vocab = SHAPES[args.shape]["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(max(args.num_prompts, 2))]
    dtype = EngineConfig(model=path, dtype=args.dtype).torch_dtype
    dname = str(dtype).removeprefix("torch.")
    chosen = prompts[: args.num_prompts]

    dev = args.device
    pairs: dict[str, str] = {}
    work = [("tianmen", lambda: isolated(ours, path, chosen, args.output_len, dname, True, dev))]
    if args.onednn_row:
        work.append(("tianmen-onednn", lambda: isolated(ours, path, chosen, args.output_len, dname, False, dev)))
    if args.layers_row:
        layers = ("tianmen-layers", lambda: isolated(ours, path, chosen, args.output_len, dname, True, dev, "layers"))
        work.append(layers)
    if args.small_pages_row:
        small = (
            "tianmen-small-pages",
            lambda: isolated(ours, path, chosen, args.output_len, dname, True, dev, "auto", False),
        )
        work.append(small)
    if args.quantization:
        qpath = str(quantized(Path(path), args.quantization, args.group_size, args.quantize_lm_head))
        qname = f"tianmen {args.quantization}" + (" +head" if args.quantize_lm_head else "")
        work.append((qname, lambda: isolated(ours, qpath, chosen, args.output_len, dname, True, dev)))
        if args.rotate:
            rpath = str(quantized(Path(path), args.quantization, args.group_size, args.quantize_lm_head, rotate=True))
            rot = (f"{qname} rotated", lambda: isolated(ours, rpath, chosen, args.output_len, dname, True, dev))
            work.append(rot)
    if not args.no_hf:
        hf_name = f"transformers {__import__('transformers').__version__}"
        work.append((hf_name, lambda: isolated(hf, path, chosen, args.output_len, dtype, dev)))
    if args.vllm:
        work.append(("vLLM plain", lambda: vllm(args.vllm, path, chosen, args.output_len, dname)))
        preload = vllm_preloads(args.vllm)
        if preload:
            work.append(("vLLM preloaded", lambda: vllm(args.vllm, path, chosen, args.output_len, dname, preload)))
        else:
            print("vLLM with tcmalloc + Intel OpenMP: not run (needs libgoogle-perftools4, and libiomp5 in its venv)")
    if args.llamacpp:
        from benchmarks.llamacpp_peer import TYPES, llamacpp, version

        tag = f"llama.cpp {version(args.llamacpp)}"
        for kind, ours_name in [("bf16", "tianmen")] + ([(args.quantization, qname)] if args.quantization else []):
            name = f"{tag} {TYPES[kind].lower()}"
            pairs[name] = ours_name  # its ratio is against our row of the same precision
            run = lambda k=kind: llamacpp(  # noqa: E731
                args.llamacpp, args.shape, k, args.prompt_len, args.output_len, args.num_prompts
            )
            work.append((name, run))
    # NOTE: before the engines run: measured after them, the probe shared the cores with what a peer left behind
    # (vLLM's engine process outlives its run by seconds): read bandwidth 18.6 GB/s in one run, 25-27 otherwise
    machine = Machine.measure(dtype) if dev == "cpu" else None
    rows: list[tuple[str, float, float]] = []
    for name, run in work:  # a peer that fails is reported and the others still run
        try:
            rows.append((name, *run()))
        except Exception as e:  # any failure of a peer's process
            print(f"{name}: failed ({type(e).__name__}: {str(e)[:300]})")
    vllm_rows = [r for r in rows if r[0].startswith("vLLM")]
    if vllm_rows:  # the better of vLLM's two set-ups is its figure
        best = max(vllm_rows, key=lambda r: r[1])
        rows.append((f"vLLM CPU {VLLM_VERSION[0]} (best)", best[1], min(r[2] for r in vllm_rows)))

    print(
        f"\n{args.shape}, {dname}, {args.num_prompts} x {args.prompt_len} -> {args.output_len}, greedy; "
        f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    if machine is not None:  # the bound is the CPU's (GEMM peak, read bandwidth)
        print(Workload.of(Path(path), dtype).describe(machine, args.num_prompts, args.prompt_len, args.output_len))
    else:
        print(f"on {dev}: {torch.cuda.get_device_name(dev) if dev.startswith('cuda') else dev} (no bound measured)")
    print(f"{'engine':<28} {'batch tok/s':>12} {'batch-1 ms/token':>18}")
    for name, tps, ms in rows:
        print(f"{name:<28} {tps:>12.1f} {ms:>18.1f}")
    by_name = {r[0]: r for r in rows}
    ours_row = by_name.get("tianmen")
    for name, tps, ms in rows:
        if ours_row is None or name == "tianmen" or name.startswith("vLLM plain") or name.startswith("vLLM preloaded"):
            continue
        if name.startswith("tianmen "):  # a quantized row: its speed against the bf16 one
            print(f"{name + ' vs bf16':<28} {tps / ours_row[1]:>11.2f}x {ours_row[2] / ms:>17.2f}x faster")
            continue
        mine = by_name.get(pairs.get(name, "tianmen"))
        if mine is None:
            continue
        peer = "hf" if name.startswith("transformers") else name.split()[0]
        peer += f" {name.split()[-1]}" if name in pairs else ""
        label = f"ratio vs {peer}" + (f" ({mine[0]})" if mine is not ours_row else "")
        print(f"{label:<28} {mine[1] / tps:>11.2f}x {ms / mine[2]:>17.2f}x faster")
    if args.alternate > 0:
        sets = [[[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(max(args.num_prompts, 2))]
                for _ in range(args.alternate)]  # fmt: skip
        if args.quantization:
            turns = isolated(alternated, [path, qpath], sets, args.output_len, dname, dev)
            in_turn(turns, "bf16", qname, "the bf16")
        elif args.layers_row:  # the same model, its decode programs against the layers
            turns = isolated(alternated, [path, path], sets, args.output_len, dname, dev, ("layers", "auto"))
            in_turn(turns, "tianmen-layers", "tianmen", "the layers'")
        else:  # --small-pages-row: the same model on 4 KiB pages against huge pages
            modes, huge = ("auto", "auto"), (False, True)
            turns = isolated(alternated, [path, path], sets, args.output_len, dname, dev, modes, huge)
            in_turn(turns, "tianmen-small-pages", "tianmen", "the small pages'")


def in_turn(turns: list[list[tuple[float, float]]], first: str, second: str, base: str) -> None:
    """Each round's figures of two engines measured in turn, the second's ratios to the first, and their medians."""
    print(f"\nmeasured in turn, one process, {len(turns)} rounds (new prompts each): {first}, then {second}")
    print(f"{'batch tok/s':>24} {'ratio':>7} {'batch-1 ms':>22} {'ratio':>7}")
    for (bt, bm), (qt, qm) in turns:
        print(f"{bt:>11.1f} {qt:>11.1f} {qt / bt:>6.2f}x {bm:>10.1f} {qm:>10.1f} {qm / bm:>6.2f}x")
    batch = sorted(q[0] / b[0] for b, q in turns)
    one = sorted(q[1] / b[1] for b, q in turns)
    print(f"median: batch {batch[len(batch) // 2]:.2f}x ({batch[0]:.2f}-{batch[-1]:.2f}x) {base} throughput, "
          f"batch-1 {one[len(one) // 2]:.2f}x ({one[0]:.2f}-{one[-1]:.2f}x) {base} time")  # fmt: skip


def quantized(src: Path, scheme: str, group_size: int, lm_head: bool = False, rotate: bool = False) -> Path:
    """`tianmen quantize`'s output for `src` (round-to-nearest), made once and kept beside it."""
    from engine.quant.quantize import quantize

    suffix = (f"-g{group_size}" if scheme == "w4a16" else "") + ("-head" if lm_head else "")
    suffix += "-rot" if rotate else ""
    dst = src.with_name(f"{src.name}-{scheme}{suffix}")
    if not (dst / "tianmen-quant.json").exists():
        if dst.exists():
            shutil.rmtree(dst)  # an interrupted earlier run
        quantize(src, dst, scheme, group_size=group_size, lm_head=lm_head, rotate=rotate)
    return dst


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
