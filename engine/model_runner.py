from __future__ import annotations

import logging
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import torch

from engine.block_manager import cdiv
from engine.config import EngineConfig
from engine.context import AttentionContext, PrefillMeta, reset_context, set_context
from engine.errors import ConfigError
from engine.hugepages import collapse_resident
from engine.kernels import pointwise, wbf16
from engine.kernels.bind import BindReport, bind_cpu_kernels, gemm_paths, make_selector
from engine.kernels.decode_attn import DECODE_ROWS, runs_at
from engine.kernels.kernel_set import CpuKernels
from engine.kernels.op_choice import choose_kernels, decode_attention_kernels, grouped_kernels
from engine.kernels.select import streams_from_memory
from engine.loader import ModelFiles, load_model
from engine.malloc import keep_freed_memory, release_freed_memory
from engine.models.decode_program import programmable, programs_possible
from engine.outputs import ModelOutput, ScheduledSeq, SchedulerOutput
from engine.parallel.group import Group, SingleGroup
from engine.params import torch_seed
from engine.sampler import Sampler
from engine.structured import GrammarMask, fill_masks

log = logging.getLogger(__name__)

MAX_DEFAULT_KV_BYTES = 4 << 30


class ModelRunner:
    """Owns the model, its paged KV cache and the sampler; runs one SchedulerOutput per call.

    With a tensor-parallel `group`, this rank's part of the model and of the KV cache: every rank runs every step
    (the same SchedulerOutput), and only rank 0 samples."""

    def __init__(
        self,
        config: EngineConfig,
        files: ModelFiles,
        hf_config: dict[str, Any],
        max_model_len: int,
        group: Group | None = None,
    ) -> None:
        self.config = config
        self.group = group or SingleGroup()
        self.num_steps, self.step_seconds = 0, 0.0
        # True: every row's final hidden state is computed, sampled or not (calibration and fidelity read them
        # through hooks); False: the last layer's MLP runs on the sampled rows only (AttentionContext.keep_rows)
        self.every_row = False
        self.device, self.dtype = config.torch_device, config.torch_dtype
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        if config.keep_freed_memory and self.device.type == "cpu":
            keep_freed_memory()
        self.block_size = config.block_size
        cpu = self.device.type == "cpu"
        compact = bf16_weight_storage(config)
        self.model = load_model(
            files,
            hf_config,
            self.device,
            self.dtype,
            bf16_storage=compact,
            group=self.group,
            expert_parallel=config.enable_expert_parallel,
        )
        loaded = getattr(self.model, "quantization", "none")
        if config.quantization not in ("auto", loaded):
            raise ConfigError(f"quantization={config.quantization} but the checkpoint holds {loaded} weights")
        config.quantization = loaded
        self.num_blocks = self._size_kv_cache(max_model_len)
        self.pad_block = self.num_blocks  # one spare block past the pool absorbs padded slots
        for layer in self.model.attention_layers():
            for name, shape in self.model.kv_cache_shape(self.num_blocks + 1, self.block_size):
                setattr(layer, name, torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.sampler = Sampler()
        self.kernel_report = BindReport()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # a model that stays in cache between steps gains little from the page size, and the pass over the
        # process's memory would cost more than it gives
        self.huge_pages = config.huge_pages and cpu and streams_from_memory(self.weight_bytes)
        if cpu:
            self.kernel_report = self._bind_cpu_kernels(compact)
        self.plan_attention()
        if config.keep_freed_memory and cpu:
            release_freed_memory()  # the checkpoint's tensors and the trial copies: freed, but kept resident
        if self.huge_pages:
            done = collapse_resident()
            log.info(
                "huge pages: %d MiB of the process's memory (weights, KV cache, buffers) on 2 MiB pages, "
                "%d MiB could not be moved, %.2f s",
                done.huge_bytes >> 20,
                done.failed_bytes >> 20,
                done.seconds,
            )
        log.info(
            "model on %s, %s math, %s weights: %d KV blocks of %d tokens",
            self.device,
            str(self.dtype).removeprefix("torch."),
            "bf16/float" if config.quantization == "none" else config.quantization,
            self.num_blocks,
            self.block_size,
        )
        for line in self.kernel_report.lines():
            log.info("%s", line)
        self.generators: dict[str, torch.Generator] = {}
        self._rng = random.Random(config.seed)
        self.vocab_size: int = self.model.args.vocab_size
        # grammar masks are filled on this worker while the model runs: they depend only on tokens already out
        self._mask_worker: ThreadPoolExecutor | None = None
        self._mask_executor: llguidance.LLExecutor | None = None
        self.last_mask_s = 0.0  # the last step's mask fill (benchmarks.structured)
        self.last_mask_wait_s = 0.0  # how long the step waited for it after the forward

    # ---- set-up -------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model, self.dtype, self.block_size)

    def _size_kv_cache(self, max_model_len: int) -> int:
        return kv_cache_blocks(self.config, self.kv_bytes_per_block(), max_model_len)

    def _bind_cpu_kernels(self, bf16_weights: bool) -> BindReport:
        """Every kernel the model takes, in one pass; each linear layer's GEMM chosen by timing on this CPU."""
        c = self.config
        use = c.cpu_kernels
        paths = gemm_paths(self.dtype, c.max_num_seqs, use, bf16_weights)
        # without our kernels oneDNN leads, unless torch is asked for: its quantized path is the reference
        # (dequantize, then F.linear), what fidelity checks want (engine.quant.fidelity)
        forced = c.gemm_path if use or c.gemm_path == "torch" else "onednn"
        settle = collapse_resident if self.huge_pages else None
        selector = make_selector(
            paths, self.dtype, forced, max_layouts=c.gemm_layouts, model_bytes=self.weight_bytes, settle=settle
        )
        kernels = CpuKernels()
        if use:
            pw = pointwise.kernel()
            attn = decode_attention_kernels()
            timer = selector.timer if selector.measure else None  # a forced gemm_path binds every kernel untimed
            grouped = grouped_kernels(self.dtype, c.gemm_path)
            programs = programs_possible(self.model, c.decode_program)
            kernels = choose_kernels(
                self.model, pw, attn, self.dtype, timer, selector.cache, self.block_size, grouped, selector.flush,
                programs,
            )  # fmt: skip
        kernels.decode_program = c.decode_program
        return bind_cpu_kernels(self.model, [self.sampler], kernels, selector, c.max_num_seqs)

    def plan_attention(self) -> None:
        """How the attention layers, as bound, take a step's rows: per decode batch class whether every layer reads
        the cache in place (else SDPA's paths need a mask), and how long a prompt chunk may attend in place too."""
        layers = list(self.model.attention_layers())
        self.in_place_at = tuple(all(m.in_place(rows) for m in layers) for rows in DECODE_ROWS)
        self.attention_in_place = all(self.in_place_at)
        # prompt chunks up to this long attend in place too, as decode rows (engine.kernels.op_choice)
        self.prefill_in_place = min((getattr(m, "prefill_in_place", 0) for m in layers), default=0)
        if not self.attention_in_place:
            self.prefill_in_place = 0

    def agree_with_ranks(self) -> None:
        """Tensor parallel, once every rank has loaded its part: the smallest of the ranks' measured limits.
        WHY: which prompt chunks attend in place decides whether a step keeps every row (a decode-only step
        does), so it decides the rows of the last layer's all-reduce; with limits of their own, rank 0 reduced a
        23-row prompt while rank 1 reduced its one sampled row, and gloo failed the step."""
        self.prefill_in_place = self.group.min_over_ranks(self.prefill_in_place)

    # ---- one step -----------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        t0 = time.perf_counter()
        try:
            return self._execute(sched)
        finally:
            self.num_steps += 1
            self.step_seconds += time.perf_counter() - t0

    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput) -> ModelOutput:
        for req_id in sched.finished_req_ids:
            self.generators.pop(req_id, None)
        input_ids, positions, ctx, sample_rows = self._prepare(sched)
        sampled = [s for s in sched.seqs if s.sample]
        masks = self._start_masks(sampled)
        set_context(ctx)
        try:
            hidden = self.model(input_ids, positions)
        finally:
            reset_context()
            waited = time.perf_counter()
            mask = masks.result() if masks is not None else None  # never left running past the step
            self.last_mask_wait_s = time.perf_counter() - waited if masks is not None else 0.0
        if not sampled:
            return ModelOutput([], [])
        if hidden.shape[0] == input_ids.shape[0]:  # else the model kept only the sampled rows (ctx.keep_rows)
            hidden = hidden[sample_rows]
        logits = self.model.compute_logits(hidden)  # every rank: the vocabulary's all-gather
        if self.group.rank != 0:  # (workers have no matchers: masks are rank 0's, with the sampling)
            return ModelOutput([], [])
        return self._sample(sampled, logits, mask)

    def _start_masks(self, sampled: list[ScheduledSeq]) -> Future[GrammarMask] | None:
        constrained = [(row, s.matcher) for row, s in enumerate(sampled) if s.matcher is not None]
        if not constrained:
            return None
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="tianmen-grammar")
            self._mask_executor = llguidance.LLExecutor(num_threads=1)

        def fill() -> GrammarMask:
            start = time.perf_counter()
            try:
                return fill_masks(self._mask_executor, constrained, self.vocab_size)
            except Exception as e:  # the constrained rows fail (in _sample), the step goes on
                log.error("grammar masks failed (%s); their %d requests end", type(e).__name__, len(constrained))
                return GrammarMask([row for row, _ in constrained], torch.zeros(0, dtype=torch.int32), failed=True)
            finally:
                self.last_mask_s = time.perf_counter() - start

        return self._mask_worker.submit(fill)

    def _sample(self, seqs: list[ScheduledSeq], logits: torch.Tensor, mask: GrammarMask | None = None) -> ModelOutput:
        """Sample every row at once; if that raises, row by row, so that only the rows that raise fail."""
        failed: list[str] = []
        if mask is not None:  # a matcher past its limits (or broken) allows nothing: its request ends alone
            broken = {r for r, s in enumerate(seqs) if s.matcher is not None and (mask.failed or s.matcher.is_error())}
            if broken:
                for row in sorted(broken):
                    _log_failure(seqs[row].req_id, RuntimeError("grammar"), failed)
                keep_rows = [r for r in range(len(seqs)) if r not in broken]
                mask = _mask_rows(mask, keep_rows)
                seqs, logits = [seqs[r] for r in keep_rows], logits[keep_rows]
        gens: list[torch.Generator | None] = []
        keep: list[int] = []
        for k, s in enumerate(seqs):
            try:
                gens.append(None if s.params.greedy else self._generator(s.req_id, s.params.seed))
                keep.append(k)
            except Exception as e:
                _log_failure(s.req_id, e, failed)
        if len(keep) < len(seqs):
            seqs, logits = [seqs[k] for k in keep], logits[keep]
            mask = _mask_rows(mask, keep)
        if not seqs:
            return ModelOutput([], [], None, failed)
        params = [s.params for s in seqs]
        penal = any(p.has_penalties for p in params)
        prompts = [s.prompt_token_ids for s in seqs] if penal else []
        outputs = [s.output_token_ids for s in seqs] if penal else []
        # NOTE: a batch that raises may already have drawn from some generators; restoring them lets each row
        # draw exactly what it would have drawn alone (get_state is a 5 KB copy on CPU, 16 bytes on CUDA)
        states = [g.get_state() if g is not None else None for g in gens]
        try:
            if mask is None:  # NOTE: a sampler wrapper (tests) need not know about masks
                tokens, logprobs = self.sampler(logits, params, gens, prompts, outputs)
            else:
                tokens, logprobs = self.sampler(logits, params, gens, prompts, outputs, mask=mask)
            return ModelOutput([s.req_id for s in seqs], tokens, list(logprobs) if logprobs else None, failed)
        except Exception as e:
            log.warning("the batched sampler failed (%s); sampling its %d rows one by one", type(e).__name__, len(seqs))
        req_ids: list[str] = []
        tokens, row_lps = [], []
        for k, s in enumerate(seqs):
            gen, state = gens[k], states[k]
            if gen is not None and state is not None:
                gen.set_state(state)
            row_mask = mask.select(k) if mask is not None else None
            try:
                args = (logits[k : k + 1], [params[k]], [gen], prompts[k : k + 1], outputs[k : k + 1])
                token, lp = self.sampler(*args) if row_mask is None else self.sampler(*args, mask=row_mask)
            except Exception as e:
                _log_failure(s.req_id, e, failed)
                continue
            req_ids.append(s.req_id)
            tokens.append(token[0])
            row_lps.append(lp[0] if lp else None)
        logprob_list = row_lps if any(lp is not None for lp in row_lps) else None
        return ModelOutput(req_ids, tokens, logprob_list, failed)

    def _generator(self, req_id: str, seed: int | None) -> torch.Generator:
        gen = self.generators.get(req_id)
        if gen is None:
            gen = torch.Generator(self.device)
            gen.manual_seed(torch_seed(seed) if seed is not None else self._rng.getrandbits(63))
            self.generators[req_id] = gen
        return gen

    def _prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionContext, torch.Tensor]:
        bs, dev = self.block_size, self.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillMeta] = []
        # rows [0, in_place) attend through the decode kernel: the decodes, then every prompt chunk short enough
        # (one row per token, its context ending at that token). Chunks are laid out shortest first, so those are
        # a prefix and how a chunk attends depends on its own length only, never on what else is in the step.
        # NOTE: the layout must not depend on the measured limit itself: tensor-parallel ranks each measure their
        # own, and their all-reduces add row to row
        seqs, nd = sched.seqs, sched.num_decodes
        order = [*range(nd), *sorted(range(nd, len(seqs)), key=lambda i: len(seqs[i].token_ids))]
        first_row = [0] * len(seqs)
        in_place_seqs: list[tuple[list[int], int, int]] = []  # (block ids, first row's context length, rows)
        in_place = 0
        for i in order:
            s = seqs[i]
            n, row = len(s.token_ids), len(input_ids)
            first_row[i] = row
            input_ids.extend(s.token_ids)
            pos = range(s.start, s.start + n)
            positions.extend(pos)
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in pos)
            ctx_len = s.start + n
            if in_place == row and (i < nd or n <= self.prefill_in_place):
                in_place_seqs.append((s.block_ids[: cdiv(ctx_len, bs)], s.start + 1, n))
                in_place += n
                continue
            if s.start == 0:
                last = prefills[-1] if prefills else None
                if last is not None and last.block_ids is None and last.context_len == n and last.end == row:
                    last.end, last.num_seqs = row + n, last.num_seqs + 1  # same length: one batched attention call
                else:
                    prefills.append(PrefillMeta(row, row + n, ctx_len, None, None))
            else:
                block_ids = torch.tensor(s.block_ids[: cdiv(ctx_len, bs)], device=dev)
                mask = torch.arange(ctx_len, device=dev) <= torch.arange(s.start, ctx_len, device=dev).unsqueeze(1)
                prefills.append(PrefillMeta(row, row + n, ctx_len, block_ids, mask))

        # the sampled rows in the order of sched.seqs, as the caller reads them
        sample_rows = [first_row[i] + len(s.token_ids) - 1 for i, s in enumerate(seqs) if s.sample]
        tables, dmask, ctx_lens = None, None, None
        if in_place_seqs:
            width = max(len(ids) for ids, _, _ in in_place_seqs)
            padded = torch.tensor([ids + [self.pad_block] * (width - len(ids)) for ids, _, _ in in_place_seqs])
            counts = [n for _, _, n in in_place_seqs]
            # a prompt chunk's rows share its block table; each row's context ends at its own token
            tables = padded if in_place == len(counts) else padded.repeat_interleave(torch.tensor(counts), dim=0)
            tables = tables.to(dev)
            ctx_lens = torch.tensor([first + j for _, first, n in in_place_seqs for j in range(n)], device=dev)
            if not runs_at(self.in_place_at, in_place):  # the kernels read the lengths; SDPA's paths need a mask
                hidden = torch.arange(width * bs, device=dev) >= ctx_lens.unsqueeze(1)
                dmask = torch.zeros(hidden.shape, dtype=self.dtype, device=dev).masked_fill_(hidden, float("-inf"))
                dmask = dmask.view(in_place, 1, 1, -1)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        ctx = AttentionContext(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=in_place,
            decode_block_tables=tables,
            decode_mask=dmask,
            decode_context_lens=ctx_lens,
            prefills=prefills,
        )
        # a step a decode program may run keeps every row, so the program and the layers compute alike
        if len(sample_rows) < len(input_ids) and not self.every_row and not programmable(ctx, len(input_ids)):
            ctx.keep_rows = rows
        return (
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            ctx,
            rows,
        )


def bf16_weight_storage(config: EngineConfig) -> bool:
    """CPU, float32 math: weights that are exactly bf16 stay bf16 in memory, where the bf16-weight kernel runs."""
    on = config.torch_device.type == "cpu" and config.torch_dtype == torch.float32
    return on and config.compact_weights and config.cpu_kernels and wbf16.kernel() is not None


def kv_bytes_per_block(model: Any, dtype: torch.dtype, block_size: int) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    per_layer = sum(torch.Size(shape).numel() for _, shape in model.kv_cache_shape(1, block_size))
    return per_layer * itemsize * len(model.attention_layers())


def kv_cache_blocks(config: EngineConfig, per_block: int, max_model_len: int) -> int:
    """The KV cache's blocks: kv_cache_bytes, or room for max_num_seqs full-length sequences (at most 4 GiB)."""
    need_one = cdiv(max_model_len, config.block_size)
    if config.kv_cache_bytes is None:
        budget = min(config.max_num_seqs * need_one * per_block, MAX_DEFAULT_KV_BYTES)
    else:
        budget = config.kv_cache_bytes
    num_blocks = budget // per_block
    if num_blocks < need_one:
        raise ConfigError(
            f"kv_cache_bytes={budget} holds {num_blocks} blocks of {per_block} bytes, fewer than one "
            f"max_model_len={max_model_len} sequence needs ({need_one}); "
            "raise kv_cache_bytes or lower max_model_len"
        )
    return num_blocks


def _mask_rows(mask: GrammarMask | None, keep: list[int]) -> GrammarMask | None:
    """`mask` for the batch cut to rows `keep` (renumbered from 0); None if none of them is constrained."""
    if mask is None:
        return None
    where = {row: j for j, row in enumerate(mask.rows)}
    pairs = [(new, where[old]) for new, old in enumerate(keep) if old in where]
    if not pairs:
        return None
    return GrammarMask([new for new, _ in pairs], mask.words[[j for _, j in pairs]])


def _log_failure(req_id: str, error: Exception, failed: list[str]) -> None:
    # the type only: a message could quote the request's content
    log.error("request %s failed while sampling (%s); the engine serves the others", req_id, type(error).__name__)
    failed.append(req_id)
