"""engine.kernels.select: GEMM paths are chosen by measurement, checked against the reference, and cached."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import gemm
from engine.kernels.bind import TIMED_ONLY, gemm_paths, make_selector, plan_linears
from engine.kernels.gemm import Act, KernelPath, OneDNNPath, Run, TorchPath
from engine.kernels.select import CLASSES, ROWS, GemmPlan, GemmSelector, PlanCache, cache_key
from engine.layers.mlp import GatedMLP


def quiet() -> bool:  # the machine is never busy for these tests
    return False


class FakeClock:
    """A timer whose time passes only when a fake path runs: each call costs cost(name, rows) seconds."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls = 0

    def timer(self, fn: Callable[[], object]) -> float:
        self.calls += 1
        start = self.now
        fn()
        return self.now - start


class FakePath:
    """Computes the right answer (or a wrong one) and charges the fake clock what `cost` says."""

    def __init__(self, name: str, clock: FakeClock, cost: Callable[[int], float], wrong: bool = False) -> None:
        self.name, self.clock, self.cost, self.wrong = name, clock, cost, wrong
        self.prepared = 0

    def accepts(self, weight: torch.Tensor, act: Act | None) -> bool:
        return True

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None, act: Act | None) -> Run:
        self.prepared += 1

        def run(x: torch.Tensor) -> torch.Tensor:
            self.clock.now += self.cost(x.shape[0])
            y = F.linear(x, weight, bias)
            y = act(y) if act is not None else y
            return y + 1 if self.wrong else y

        return run


def _samples(n: int = 3, shape: tuple[int, int] = (24, 16)) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(*shape, generator=g), None) for _ in range(n)]


def _selector(*paths: FakePath, clock: FakeClock, **kw: object) -> GemmSelector:
    return GemmSelector(list(paths), torch.float32, timer=clock.timer, **kw)  # type: ignore[arg-type]


def test_the_fastest_path_wins_each_class_and_a_slow_one_is_never_chosen() -> None:
    clock = FakeClock()
    base = FakePath("onednn", clock, lambda r: 10.0 + r)
    fast_small = FakePath("ours", clock, lambda r: 1.0 if r <= 8 else 1000.0)
    slow = FakePath("slow", clock, lambda r: 1e6)
    choice = _selector(base, fast_small, slow, clock=clock).choose("24x16", _samples(), None)
    assert choice.per_class == ["ours", "ours", "onednn", "onednn", "onednn"]
    assert "slow" not in choice.per_class
    assert choice.us["ours"][0] == pytest.approx(1e6)  # µs per call: 1 s each on the fake clock
    assert len(CLASSES) == len(ROWS) == len(choice.per_class)


def test_a_path_with_wrong_answers_is_dropped_however_fast() -> None:
    clock = FakeClock()
    base = FakePath("onednn", clock, lambda r: 10.0)
    liar = FakePath("liar", clock, lambda r: 0.001, wrong=True)
    choice = _selector(base, liar, clock=clock).choose("24x16", _samples(), None)
    assert choice.per_class == ["onednn"] * len(ROWS)
    assert all(math.isinf(v) for v in choice.us["liar"])


def test_never_a_path_slower_than_the_baseline_and_at_most_max_layouts() -> None:
    clock = FakeClock()
    base = FakePath("onednn", clock, lambda r: 10.0)
    a = FakePath("a", clock, lambda r: 1.0 if r == 1 else 20.0)  # wins one class only
    b = FakePath("b", clock, lambda r: 2.0 if r in (8, 32) else 30.0)  # wins two
    two = _selector(base, a, b, clock=clock, max_layouts=2).choose("s", _samples(), None)
    assert two.per_class == ["onednn", "b", "b", "onednn", "onednn"]  # b wins more classes; a is not held
    one = _selector(base, a, b, clock=clock, max_layouts=1).choose("s", _samples(), None)
    assert one.per_class == ["onednn"] * len(ROWS)
    three = _selector(base, a, b, clock=clock, max_layouts=3).choose("s", _samples(), None)
    assert three.per_class == ["a", "b", "b", "onednn", "onednn"]


def test_paths_over_one_packed_copy_count_as_one_layout() -> None:
    """w4mm's entry points (direct, panel, AMX) run on one packed weight: holding all of them costs one layout, so
    a class won by one of them is not handed to a slower one for want of room (a 2-core AMX Xeon ran its W4A16
    batch-1 layers 1.2x slower so)."""
    clock = FakeClock()
    base = FakePath("onednn", clock, lambda r: 10.0)
    a = FakePath("w4-direct", clock, lambda r: 1.0 if r == 1 else 20.0)
    b = FakePath("w4-amx", clock, lambda r: 2.0 if r in (8, 32) else 30.0)
    c = FakePath("w4-dequant", clock, lambda r: 3.0 if r > 32 else 40.0)
    for path in (a, b, c):
        path.layout = "w4"  # type: ignore[attr-defined]
    two = _selector(base, a, b, c, clock=clock, max_layouts=2).choose("s", _samples(), None)
    assert two.per_class == ["w4-direct", "w4-amx", "w4-amx", "w4-dequant", "w4-dequant"]
    other = FakePath("other", clock, lambda r: 0.5 if r == 1 else 50.0)  # its own layout: no room left for it
    three = _selector(base, a, b, c, other, clock=clock, max_layouts=2).choose("s", _samples(), None)
    assert three.per_class == two.per_class  # class 1 falls to w4-direct: on the copy held anyway


def test_the_layout_that_wins_most_classes_is_held_with_all_its_builds() -> None:
    """Timings of Qwen2-0.5B's o_proj (896 x 896, µs a call) on a 2-core AMX Xeon: amxmm's two builds (with and
    without prefetch, one packed copy) win two classes between them, three other paths one each. The selection
    held oneDNN and F.linear's plain weight (the prefill's winner, first in a set's order) and ran oneDNN at
    every decode class, where amxmm was 13-27% faster."""
    us = {
        "onednn": (119, 135, 137, 132, 710),
        "torch": (223, 178, 227, 225, 432),
        "bf16mm": (95, 140, 302, 1121, 4066),
        "amxmm": (104, 109, 119, 180, 558),
        "amxmm-noprefetch": (101, 98, 134, 159, 551),
    }
    clock = FakeClock()
    paths = {name: FakePath(name, clock, lambda r, t=t: float(t[ROWS.index(r)])) for name, t in us.items()}
    paths["amxmm"].layout = paths["amxmm-noprefetch"].layout = "amxmm"  # type: ignore[attr-defined]
    choice = _selector(*paths.values(), clock=clock, max_layouts=2).choose("896x896", _samples(), None)
    assert choice.per_class == ["amxmm-noprefetch", "amxmm-noprefetch", "amxmm", "onednn", "amxmm-noprefetch"]
    assert choice.layouts() == ["amxmm", "amxmm-noprefetch", "onednn"]


class CountingKernel:
    """A GemmKernel whose pack is counted (engine.kernels.gemm.GemmKernel)."""

    def __init__(self) -> None:
        self.packs = 0

    def accepts(self, weight: torch.Tensor) -> bool:
        return True

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        self.packs += 1
        return weight.t().contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, packed.t(), bias)


def test_builds_of_one_kernel_share_one_packed_copy() -> None:
    """amxmm and bf16mm are built with and without software prefetch over one packing: both builds run on one
    copy of a weight (as the selection counts them), made once and dropped with the weight."""
    kernel = CountingKernel()
    with_pf, without = KernelPath("k", kernel, torch.float32), KernelPath("k-noprefetch", kernel, torch.float32, "k")
    assert with_pf.layout == without.layout == "k"
    w, x = torch.randn(24, 16), torch.randn(3, 16)
    runs = [with_pf.prepare(w, None, None), without.prepare(w, None, None)]
    assert kernel.packs == 1
    for run in runs:
        torch.testing.assert_close(run(x), F.linear(x, w))
    KernelPath("other", kernel, torch.float32).prepare(w, None, None)  # another layout: its own copy
    assert kernel.packs == 2
    key = ("k", id(w))
    assert key in gemm._PACKED
    del w
    assert key not in gemm._PACKED
    for path in gemm_paths(torch.bfloat16, 32, use_kernels=True, bf16_weights=True):  # whatever builds here
        if path.name.endswith(TIMED_ONLY):
            assert getattr(path, "layout", None) == path.name.removesuffix(TIMED_ONLY)


def test_a_win_within_noise_of_the_baseline_keeps_the_baseline() -> None:
    clock = FakeClock()
    choice = _selector(
        FakePath("onednn", clock, lambda r: 10.0), FakePath("ours", clock, lambda r: 9.9), clock=clock
    ).choose("s", _samples(), None)
    assert choice.per_class == ["onednn"] * len(ROWS)


def test_one_layout_may_replace_the_baseline_when_it_wins_everywhere() -> None:
    clock = FakeClock()
    choice = _selector(
        FakePath("onednn", clock, lambda r: 10.0), FakePath("ours", clock, lambda r: 1.0), clock=clock, max_layouts=1
    ).choose("s", _samples(), None)
    assert choice.per_class == ["ours"] * len(ROWS) and choice.layouts() == ["ours"]


def test_classes_past_max_rows_are_not_timed() -> None:
    clock = FakeClock()
    seen: list[int] = []
    base = FakePath("onednn", clock, lambda r: seen.append(r) or 10.0)  # type: ignore[func-returns-value]
    ours = FakePath("ours", clock, lambda r: 1.0)
    choice = _selector(base, ours, clock=clock).choose("s", _samples(), None, max_rows=32)
    assert max(seen) == 32 and choice.per_class == ["ours"] * len(ROWS)


def test_the_table_is_cached_and_a_new_cpu_or_kernel_source_measures_again(tmp_path: Path) -> None:
    src = tmp_path / "kernel.c"
    src.write_text("int f(void) { return 1; }")
    key = cache_key("cpu A", [src])
    clock = FakeClock()
    paths = (FakePath("onednn", clock, lambda r: 10.0), FakePath("ours", clock, lambda r: 1.0))
    first = _selector(*paths, clock=clock, cache=PlanCache(tmp_path, key, quiet)).choose("s", _samples(), None)
    timed = clock.calls
    assert timed > 0
    again = _selector(*paths, clock=clock, cache=PlanCache(tmp_path, key, quiet)).choose("s", _samples(), None)
    assert clock.calls == timed and again == first  # read from disk: nothing timed
    assert cache_key("cpu B", [src]) != key
    src.write_text("int f(void) { return 2; }")
    assert cache_key("cpu A", [src]) != key
    _selector(*paths, clock=clock, cache=PlanCache(tmp_path, cache_key("cpu A", [src]), quiet)).choose(
        "s", _samples(), None
    )
    assert clock.calls > timed


def test_a_cached_choice_naming_a_missing_path_is_measured_again(tmp_path: Path) -> None:
    clock = FakeClock()
    cache = PlanCache(tmp_path, "k", quiet)
    _selector(FakePath("onednn", clock, lambda r: 10.0), FakePath("gone", clock, lambda r: 1.0), clock=clock,
              cache=cache).choose("s", _samples(), None)  # fmt: skip
    choice = _selector(
        FakePath("onednn", clock, lambda r: 10.0), clock=clock, cache=PlanCache(tmp_path, "k", quiet)
    ).choose("s", _samples(), None)
    assert choice.per_class == ["onednn"] * len(ROWS)


def test_a_plan_runs_the_path_of_the_call_rows() -> None:
    calls: list[str] = []

    def tagged(name: str) -> Run:
        return lambda x: calls.append(name) or x  # type: ignore[func-returns-value]

    plan = GemmPlan([tagged(c) for c in CLASSES], 4, list(CLASSES))
    for rows, want in (
        (1, "1"),
        (2, "<=8"),
        (8, "<=8"),
        (9, "<=32"),
        (128, "<=128"),
        (129, "prefill"),
        (4096, "prefill"),
    ):
        plan(torch.zeros(rows, 4))
        assert calls[-1] == want, rows
    plan(torch.zeros(2, 3, 4))  # [B, T, K]: 6 rows
    assert calls[-1] == "<=8"


def test_plans_over_a_real_mlp_give_the_module_reference_answers(tmp_path: Path) -> None:
    """Real paths (oneDNN, F.linear), real timing: whatever wins, the MLP computes what it computed before."""
    torch.manual_seed(0)
    mlp = GatedMLP(32, 64, "silu").float()
    for p in mlp.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(5, 32)
    want = mlp(x)
    paths = [p for p in (OneDNNPath(torch.float32, 8), TorchPath(torch.float32)) if getattr(p, "available", True)]
    report = plan_linears(mlp, make_selector(paths, torch.float32, cache_dir=tmp_path))  # type: ignore[arg-type]
    assert mlp.gate_up_act is not None and mlp.down_proj.plan is not None
    assert mlp.gate_up_proj.weight.numel() == 0  # the plain weight is gone: the plan holds the packed copies
    assert len(report.shapes) == 2 and all(line.startswith("gemm ") for line in report.lines())
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)


def test_a_layer_s_online_input_rotation_goes_with_its_plan_even_into_a_gated_mlp_s_fused_call(
    tmp_path: Path,
) -> None:
    """A quantized layer whose inputs are rotated online (engine.quant.transform; `input_block` here on plain layers
    to keep the weights simple) rotates them in its plan: a gated MLP calls its gate/up plan directly, and a decode
    program calls plans directly, so the rotation must live there and not only in the layer's forward."""
    from engine.quant.transform import rotate_blocks

    torch.manual_seed(0)
    mlp = GatedMLP(32, 64, "silu").float()
    for p in mlp.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(5, 32)
    h = F.linear(rotate_blocks(x, 8), mlp.gate_up_proj.weight)
    want = F.linear(rotate_blocks(mlp.act(h), 16), mlp.down_proj.weight)
    mlp.gate_up_proj.input_block, mlp.down_proj.input_block = 8, 16  # type: ignore[attr-defined]
    paths = [p for p in (OneDNNPath(torch.float32, 8), TorchPath(torch.float32)) if getattr(p, "available", True)]
    plan_linears(mlp, make_selector(paths, torch.float32, cache_dir=tmp_path))  # type: ignore[arg-type]
    assert mlp.gate_up_act is not None and mlp.gate_up_act.pre is not None and mlp.down_proj.plan is not None
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)


def test_a_forced_path_runs_wherever_it_applies_untimed() -> None:
    clock = FakeClock()
    paths = [FakePath("onednn", clock, lambda r: 1.0), FakePath("torch", clock, lambda r: 1.0)]
    selector = make_selector(paths, torch.float32, forced="torch", timer=clock.timer)  # type: ignore[arg-type]
    assert selector.choose("s", _samples(), None).per_class == ["torch"] * len(ROWS)
    assert clock.calls == 0


def test_onednn_rows_are_bucketed_and_the_answer_is_unchanged() -> None:
    """Past a decode batch, oneDNN sees one of a few row counts (it compiles a kernel per new shape); the padding
    rows never reach the caller."""
    from engine.kernels.gemm import bucket_rows

    assert [bucket_rows(r) for r in (1, 7, 32)] == [1, 7, 32]
    for rows in (33, 47, 65, 100, 129, 257, 1000, 4097):
        b = bucket_rows(rows)
        assert rows <= b <= rows * 1.25 and b % (1 << (rows.bit_length() - 3)) == 0
    assert len({bucket_rows(r) for r in range(33, 4097)}) <= 4 * 7
    path = OneDNNPath(torch.float32, 8)
    if not path.available:
        pytest.skip("oneDNN prepacking is not available in this torch build")
    w, b = torch.randn(24, 16), torch.randn(24)
    run = path.prepare(w, b, None)
    for shape in ((45, 16), (3, 15, 16)):
        x = torch.randn(*shape)
        torch.testing.assert_close(run(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_timings_taken_on_a_busy_machine_are_not_cached(tmp_path: Path) -> None:
    clock = FakeClock()
    paths = (FakePath("onednn", clock, lambda r: 10.0), FakePath("ours", clock, lambda r: 1.0))
    _selector(*paths, clock=clock, cache=PlanCache(tmp_path, "k", lambda: True)).choose("s", _samples(), None)
    assert PlanCache(tmp_path, "k", quiet).get("s") is None


@pytest.mark.parametrize("second_quiet", [True, False])
def test_a_shape_timed_while_contended_is_timed_again_and_cached_only_once_quiet(
    tmp_path: Path, second_quiet: bool
) -> None:
    """A neighbour made the fast path slow through the first measurement: the shape is measured again, each path
    keeps its best of both, and the choice is cached only where the second measurement ran quiet."""
    clock, neighbour = FakeClock(), {"on": True}
    ours = FakePath("ours", clock, lambda r: 50.0 if neighbour["on"] else 1.0)
    verdicts = iter((True, not second_quiet))

    def busy() -> bool:  # asked after the first measurement (busy), then after the second
        neighbour["on"] = False
        return next(verdicts)

    cache = PlanCache(tmp_path, "k", busy)
    choice = _selector(FakePath("onednn", clock, lambda r: 10.0), ours, clock=clock, cache=cache).choose(
        "s", _samples(), None
    )
    assert choice.per_class == ["ours"] * len(ROWS)
    assert (PlanCache(tmp_path, "k", quiet).get("s") is not None) == second_quiet


def test_a_model_that_fits_in_the_last_level_cache_is_timed_hot(tmp_path: Path) -> None:
    """Small batches are timed after evicting the caches only where the model cannot stay in them between steps:
    a model within half the last-level cache is hot at inference, and a flush costs 1.5x that cache a call."""
    from engine.kernels.select import CacheFlush, last_level_cache_bytes

    paths = [TorchPath(torch.float32), TorchPath(torch.float32)]
    paths[1].name = "other"  # type: ignore[misc]
    llc = last_level_cache_bytes()
    assert make_selector(paths, torch.float32, cache_dir=tmp_path, model_bytes=llc // 4).flush is None  # type: ignore[arg-type]
    assert isinstance(
        make_selector(paths, torch.float32, cache_dir=tmp_path, model_bytes=llc * 3 // 4).flush, CacheFlush
    )  # type: ignore[arg-type]
    assert isinstance(make_selector(paths, torch.float32, cache_dir=tmp_path).flush, CacheFlush)  # type: ignore[arg-type]


def test_close_timings_get_more_rounds_than_the_budget_gives() -> None:
    """Paths within twice the margin of each other keep being timed past the time budget, up to MAX_ROUNDS:
    three rounds of a 12 ms LM head once ranked the slower of two paths first. Far apart, they stop at MIN_ROUNDS."""
    from engine.kernels.select import MAX_ROUNDS, MIN_ROUNDS

    def rounds(seconds: dict[str, float]) -> dict[str, int]:
        calls = dict.fromkeys(seconds, 0)
        paths = []
        for name in seconds:
            p = TorchPath(torch.float32)
            p.name = name  # type: ignore[misc]

            def prepare(w: torch.Tensor, b: object, act: object, name: str = name) -> Run:
                def run(x: torch.Tensor) -> torch.Tensor:
                    calls[name] += 1
                    return x @ w.t()

                return run

            p.prepare = prepare  # type: ignore[method-assign]
            paths.append(p)

        def timer(fn: Callable[[], object]) -> float:
            before = dict(calls)
            fn()
            ran = next(n for n in calls if calls[n] != before[n])
            return seconds[ran]  # each call alone is past the 0.1 s budget

        GemmSelector(paths, torch.float32, None, timer, max_layouts=2).choose(
            "8x8", [(torch.randn(8, 8), None)], None, 1
        )
        return {n: c - 2 for n, c in calls.items()}  # less the reference check and the warm-up

    assert rounds({"a": 0.2, "b": 0.201}) == {"a": MAX_ROUNDS, "b": MAX_ROUNDS}
    assert rounds({"a": 0.2, "b": 0.3}) == {"a": MIN_ROUNDS, "b": MIN_ROUNDS}


def test_the_trial_copies_are_settled_before_any_timing_and_cached_apart(tmp_path: Path) -> None:
    """The engine's memory step (huge pages) runs on the trial copies after every path has packed them and before
    the first timed call, so paths are timed on the pages they will run on; timings made without it are cached
    under another key."""
    clock, events = FakeClock(), []
    fast = FakePath("fast", clock, lambda r: 1e-3)
    prepare, timer = fast.prepare, clock.timer
    fast.prepare = lambda *a: (events.append("prepare"), prepare(*a))[1]  # type: ignore[method-assign]
    clock.timer = lambda fn: (events.append("time"), timer(fn))[1]  # type: ignore[method-assign]
    base = FakePath("onednn", clock, lambda r: 2e-3)
    sel = _selector(base, fast, clock=clock, settle=lambda: events.append("settle"))
    sel.choose("24x16", _samples(), None)
    assert events.count("settle") == 1
    assert events.index("settle") > max(i for i, e in enumerate(events) if e == "prepare")
    assert events.index("settle") < events.index("time")
    paths = [TorchPath(torch.float32)]
    settled = make_selector(paths, torch.float32, cache_dir=tmp_path, settle=lambda: None)  # type: ignore[arg-type]
    plain = make_selector(paths, torch.float32, cache_dir=tmp_path)  # type: ignore[arg-type]
    assert settled.cache is not None and plain.cache is not None and settled.cache.path != plain.cache.path
