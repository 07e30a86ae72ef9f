"""Choose each linear layer's GEMM by timing the candidates on this CPU, not by its feature flags.

For every weight shape of the model and every batch-size class (1, <= 8, <= 32, <= 128 rows, prefill) each
candidate path (engine.kernels.gemm) runs over real weights of that shape; one whose answer differs from the
float32 reference is dropped, and the fastest of the rest is kept. A path of our own is kept only where it beats
oneDNN: a weight holds at most `max_layouts` packed copies, and a class whose winner is not held runs the fastest
held path that is never slower than oneDNN there. The table is cached on disk beside the compiled kernels, keyed
by CPU, torch version, thread count and the kernels' sources, so later starts skip the timing.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.kernels.busy import Contention
from engine.kernels.gemm import Act, GemmPath, Run
from engine.kernels.program_step import program_step

log = logging.getLogger(__name__)

ROWS = (1, 8, 32, 128, 512)  # the rows timed for each class; a call with r rows takes the first class >= r
CLASSES = ("1", "<=8", "<=32", "<=128", "prefill")
MAX_SAMPLES = 8  # weights of one shape timed together: several layers' worth streams from memory as in the model
COLD_ROWS = 32  # classes up to this many rows are timed with cold caches (CacheFlush): they stream weights
PROGRAM_ROWS = 128  # classes up to this many rows may run in a decode program: timed as one calls them
MIN_ROUNDS, MAX_ROUNDS, ROUND_BUDGET_S = 3, 15, 0.1  # per class: rounds of every candidate, more while cheap
# (or while the two best are close: _close)
PRUNE = 2.0  # past MIN_ROUNDS, paths slower than this many times the best stop being timed for the class
MARGIN = 1.03  # a path must be this much faster than the one it displaces: timings on a VM are noisy
Timer = Callable[[Callable[[], object]], float]


def last_level_cache_bytes() -> int:
    """The CPU's largest cache (Linux sysfs); 64 MiB where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        digits = text.rstrip("KM")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=64 << 20)


def streams_from_memory(model_bytes: int) -> bool:
    """Whether a model of `model_bytes` of weights streams them from memory at every decode step: more than half
    the last-level cache (the rest is for its KV cache and activations). A smaller one stays in cache between
    steps."""
    return 2 * model_bytes > last_level_cache_bytes()


class CacheFlush:
    """Evicts the weights from every cache level before a timed call: in the model, a decode step streams all of
    its weights from memory, so a small-batch GEMM timed hot in cache would rank the paths wrongly."""

    def __init__(self, nbytes: int | None = None) -> None:
        self.nbytes = min(nbytes or last_level_cache_bytes() * 3 // 2, 1 << 30)
        # allocated at the first flush: a start with every shape cached has none
        self.buffer: torch.Tensor | None = None

    def __call__(self) -> None:
        if self.buffer is None:
            self.buffer = torch.zeros(self.nbytes // 4, dtype=torch.int32)
        self.buffer.add_(1)  # reads and writes every line: what was cached before is gone


def call_seconds(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def row_class(rows: int) -> int:
    return bisect.bisect_left(ROWS, rows, hi=len(ROWS) - 1)


class GemmPlan:
    """What one linear layer runs: the chosen path's function for each batch-size class of the call. `pre`: what
    the layer does to its inputs first (an online rotation, engine.quant.transform), so that whoever calls the
    plan (the layer, a gated MLP's fused gate/up call, a decode program) computes what the layer computes."""

    __slots__ = ("in_features", "names", "pre", "runs")

    def __init__(self, runs: Sequence[Run], in_features: int, names: Sequence[str], pre: Run | None = None) -> None:
        self.runs, self.in_features, self.names, self.pre = tuple(runs), in_features, tuple(names), pre

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre is not None:
            x = self.pre(x)
        return self.runs[bisect.bisect_left(ROWS, x.numel() // self.in_features, hi=len(ROWS) - 1)](x)


@dataclass(slots=True)
class ShapeChoice:
    """For one weight shape: the path run for each batch class, and what each candidate measured (µs a call;
    inf where it failed the reference check)."""

    per_class: list[str]
    us: dict[str, list[float]]

    def layouts(self) -> list[str]:
        return sorted(set(self.per_class))

    def describe(self) -> str:
        def cell(i: int, c: str, p: str) -> str:
            v = self.us[p][i]
            return f"{c} {p} {v:.0f}us" if math.isfinite(v) else f"{c} {p}"

        return " | ".join(cell(i, c, p) for i, (c, p) in enumerate(zip(CLASSES, self.per_class)))


class PlanCache:
    """The measured table, one JSON file per (CPU, torch, threads, kernel sources) key."""

    def __init__(self, directory: Path, key: str, busy: Callable[[], bool] | None = None) -> None:
        self.path = directory / f"gemm-plan-{key}.json"
        self.busy = busy or Contention()  # a window per choice: since the previous one was put
        try:
            self.table: dict[str, dict] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.table = {}

    def get(self, shape: str) -> ShapeChoice | None:
        entry = self.table.get(shape)
        try:
            return ShapeChoice(list(entry["per_class"]), dict(entry["us"])) if entry else None
        except (KeyError, TypeError):
            return None

    def put(self, shape: str, choice: ShapeChoice) -> None:
        self.table[shape] = asdict(choice)
        if self.busy():
            log.warning("other work kept this machine busy while %s was timed: the choice is used now but not "
                        "cached, and is timed again at the next start", shape)  # fmt: skip
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.table, indent=1))
            os.replace(tmp, self.path)  # atomic: a concurrent engine reads the old table or the new one
        except OSError as e:
            log.warning("cannot cache the GEMM timings in %s (%s); they are measured again at the next start", tmp, e)


def cache_key(cpu_signature: str, sources: Sequence[Path]) -> str:
    """What a measurement depends on: the CPU, torch, the thread count and every candidate's code."""
    h = hashlib.sha256()
    for part in (cpu_signature, torch.__version__, str(torch.get_num_threads()), str(ROWS)):
        h.update(part.encode() + b"\0")
    for src in sources:
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


class GemmSelector:
    """Times the candidate paths for each shape (or reads the cached table) and says which to run."""

    def __init__(
        self,
        paths: Sequence[GemmPath],
        dtype: torch.dtype,
        cache: PlanCache | None = None,
        timer: Timer = call_seconds,
        max_layouts: int = 2,
        baseline: str = "onednn",
        measure: bool = True,
        flush: Callable[[], None] | None = None,
        settle: Callable[[], object] | None = None,
    ) -> None:
        """`measure=False`: no timing, the first of `paths` that takes a weight runs it (a forced path).
        `settle`: what the engine does to its memory once loaded (engine.hugepages), done to the trial copies
        before they are timed, so the paths are timed on the pages they will run on."""
        assert paths and max_layouts >= 1
        self.paths = {p.name: p for p in paths}
        self.measure, self.flush, self.settle = measure, flush, settle
        self.dtype, self.cache, self.timer, self.max_layouts = dtype, cache, timer, max_layouts
        self.baseline = baseline if baseline in self.paths else next(iter(self.paths))

    def choose(
        self,
        shape: str,
        samples: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
        act: Act | None,
        max_rows: int | None = None,
        programmed: bool = False,
    ) -> ShapeChoice:
        """The paths for a weight shape (`samples`: weights and biases of that shape); classes past `max_rows`
        (the most rows a call can have, e.g. the LM head's max_num_seqs) are not timed and take the last one's.
        `programmed`: the layers run in decode programs, so each path's calls at decode classes are timed as a
        program makes them (engine.kernels.program_step); the caller keys such a shape apart in the cache."""
        weight = samples[0][0]
        usable = [n for n, p in self.paths.items() if p.accepts(weight, act)]
        cached = self.cache.get(shape) if self.cache is not None else None
        if cached is not None and set(cached.per_class) <= set(usable):
            return cached
        if len(usable) == 1 or not self.measure:
            choice = ShapeChoice([usable[0]] * len(ROWS), {usable[0]: [math.nan] * len(ROWS)})
        else:
            paths = {n: self.paths[n] for n in usable}
            us = self._measure(paths, samples, act, max_rows, programmed)
            if self.cache is not None and self.cache.busy():  # contended: timed again (see op_choice.fastest)
                again = self._measure(paths, samples, act, max_rows, programmed)
                us = {n: [min(a, b) for a, b in zip(us[n], again[n], strict=True)] for n in us}
            choice = self._decide(us)
        if self.cache is not None:
            self.cache.put(shape, choice)
        return choice

    def _measure(
        self,
        paths: dict[str, GemmPath],
        samples: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
        act: Act | None,
        max_rows: int | None,
        programmed: bool = False,
    ) -> dict[str, list[float]]:
        """µs a call per path and class. Candidates take turns, round after round, and each keeps its fastest
        round: a burst of load from elsewhere on the machine then slows one round of each, not one candidate."""
        runs = {name: [path.prepare(w, b, act) for w, b in samples[:MAX_SAMPLES]] for name, path in paths.items()}
        if self.settle is not None:
            self.settle()
        us = {name: [math.inf] * len(ROWS) for name in paths}
        weight, bias = samples[0]
        classes: list[tuple[int, torch.Tensor]] = []
        for i, rows in enumerate(ROWS):
            if i and max_rows is not None and ROWS[i - 1] >= max_rows:
                break
            x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(self.dtype)
            for name in [n for n in runs if not _matches_reference(runs[n][0], x, weight, bias, act)]:
                log.warning("GEMM path %s gave wrong results for a %s weight at %d rows on this CPU: not used",
                            name, tuple(weight.shape), rows)  # fmt: skip
                del runs[name]
                us[name] = [math.inf] * len(ROWS)
            classes.append((i, x))
        for _, x in classes:  # warm-up, all of it before any timing: first touches, oneDNN's primitive cache
            for prepared in runs.values():
                _over(prepared, x)()
        for i, x in classes:
            steps = {name: _over(prepared, x) for name, prepared in runs.items()}
            if programmed and x.shape[0] <= PROGRAM_ROWS:
                outputs: dict[tuple[int, int], torch.Tensor] = {}  # one set for every path: never read
                programs = {name: program_step(prepared, x, outputs) for name, prepared in runs.items()}
                steps |= {name: step for name, step in programs.items() if step is not None}
                for step in steps.values():  # the programs' first touches
                    step()
            spent, rounds = 0.0, 0
            while rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS and (spent < ROUND_BUDGET_S or _close(us, steps, i))):
                for name, step in steps.items():
                    if self.flush is not None and x.shape[0] <= COLD_ROWS:
                        self.flush()
                    dt = self.timer(step)
                    spent += dt
                    us[name][i] = min(us[name][i], dt / len(runs[name]) * 1e6)
                rounds += 1
                if rounds >= MIN_ROUNDS:  # a path still far behind after them gets no more rounds for the class
                    best = min(us[n][i] for n in steps)
                    steps = {n: step for n, step in steps.items() if us[n][i] <= PRUNE * best}
        return us

    def _decide(self, us: dict[str, list[float]]) -> ShapeChoice:
        """Per class the fastest path; then hold paths over at most `max_layouts` packed copies of the weight, never
        one slower than the baseline."""
        base = us.get(self.baseline)
        n = len(ROWS)

        def fine(p: str, i: int) -> bool:  # may run class i: measured, and not slower than the baseline
            return math.isfinite(us[p][i]) and (base is None or not math.isfinite(base[i]) or us[p][i] <= base[i])

        def best(i: int, among: Sequence[str]) -> str | None:
            ok = [p for p in among if fine(p, i)]
            if not ok:
                return None
            top = min(ok, key=lambda p: us[p][i])
            if self.baseline in ok and us[top][i] * MARGIN > us[self.baseline][i]:
                return self.baseline  # within noise of the baseline: no reason to hold another layout
            return top

        winners = [best(i, list(us)) for i in range(n)]
        # the baseline (or, where it failed, the path best overall) is always held, as every class's fallback
        finite = [p for p in us if all(map(math.isfinite, us[p]))] or list(us)
        fallback = self.baseline if self.baseline in finite else min(finite, key=lambda p: sum(us[p]))
        held = [fallback]
        # the layouts that win the most classes are held first: builds of one kernel over one packed copy (with
        # and without prefetch) count together, and a tie keeps the paths' order, not a set's
        wins = Counter(self._layout(w) for w in winners if w is not None)
        for p in sorted(dict.fromkeys(w for w in winners if w is not None), key=lambda p: -wins[self._layout(p)]):
            layouts = {self._layout(h) for h in held} - {""}
            if p not in held and (self._layout(p) in {"", *layouts} or len(layouts) < self.max_layouts):
                held.append(p)
        layouts = {self._layout(h) for h in held}  # a path over a layout already held costs no memory
        held += [p for p in us if p not in held and self._layout(p) in layouts]
        if self.max_layouts == 1 and all(w == winners[0] for w in winners) and winners[0] is not None:
            held = [winners[0]]  # one layout: a path that wins every class may replace the baseline
        per_class = [best(i, held) or fallback for i in range(n)]
        for i in range(1, n):
            if not any(math.isfinite(v[i]) for v in us.values()):
                per_class[i] = per_class[i - 1]  # not timed: no call has that many rows
        return ShapeChoice(per_class, us)

    def _layout(self, name: str) -> str:
        """The packed copy a path runs on: paths over one copy (w4mm's entry points) share it; "" for none (a path
        that runs on the weight as stored)."""
        return getattr(self.paths.get(name), "layout", name)


def _close(us: dict[str, list[float]], steps: dict[str, Callable[[], None]], i: int) -> bool:
    """Whether the two fastest paths of class i are still within noise of each other (twice MARGIN): then a
    slow shape (an LM head of 12 ms a call) gets rounds past the time budget, up to MAX_ROUNDS, since three
    rounds of it measured one path 2% ahead where it was 10% ahead (AMX Xeon)."""
    best = sorted(us[n][i] for n in steps)
    return len(best) > 1 and best[1] < best[0] * (1 + 2 * (MARGIN - 1))


def _over(runs: Sequence[Run], x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        for run in runs:
            run(x)

    return step


def _matches_reference(
    run: Run, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: Act | None
) -> bool:
    """The path's answer for `x` against float32 math (rounded once to x's dtype): within that rounding."""
    reference = getattr(weight, "reference", None)  # a quantized weight (engine.quant) defines its own math
    if reference is not None:
        want = reference(x, bias)
    else:
        want = torch.nn.functional.linear(x.float(), weight.float(), bias.float() if bias is not None else None)
    if act is not None:
        want = act(want)
    try:
        got = run(x).float()
    except RuntimeError:
        return False
    if got.shape != want.shape or not torch.isfinite(got).all():
        return False
    tol = 2e-2 if x.dtype != torch.float32 else 1e-4
    return bool((got - want).abs().max() <= tol * want.abs().max().clamp_min(1.0))
