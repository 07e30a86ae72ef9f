"""All of an engine's CPU work on one thread (engine.step_thread): the core is built on the thread that steps it,
so the process holds one OpenMP pool, not two (two made libgomp stop spinning between parallel regions)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine import async_engine as async_engine_module
from engine import data_parallel as data_parallel_module
from engine.core import EngineCore
from engine.step_thread import StepThread
from tests.tiny_model import build_tiny_chat_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names in the OS are read from Linux /proc")
def test_the_thread_carries_its_name_in_the_os() -> None:
    """`top -H` and benchmarks.gateway tell the engine's CPU from the gateway's by this name (at most 15 bytes)."""
    thread = StepThread("tianmen-engine-long-name")
    tid = thread.call(threading.get_native_id)
    assert Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "tianmen-engine-"
    assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip() != "tianmen-engine-"
    thread.finish()
    thread.join(10)


def test_runs_jobs_in_order_on_one_thread_and_hands_back_results_and_errors() -> None:
    thread = StepThread("test-step")
    seen: list[tuple[int, int]] = []
    first = thread.submit(lambda: seen.append((1, threading.get_ident())) or "one")
    assert thread.call(lambda: seen.append((2, threading.get_ident())) or 2) == 2
    assert first.result() == "one"
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 // 0)
    assert thread.call(lambda: "still serving") == "still serving"  # a failed job does not end the thread
    assert [n for n, _ in seen] == [1, 2]
    assert seen[0][1] == seen[1][1] != threading.get_ident()
    thread.finish()
    thread.join(10)
    assert not thread._thread.is_alive()


class _Recording(EngineCore):
    """An EngineCore that records which threads built and stepped it."""

    built_on: list[int] = []
    stepped_on: set[int] = set()

    def __init__(self, *args: object, **kwargs: object) -> None:
        type(self).built_on.append(threading.get_ident())
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def step(self):  # type: ignore[no-untyped-def]
        type(self).stepped_on.add(threading.get_ident())
        return super().step()


async def _one(engine: AsyncEngine, request_id: str) -> str:
    text, greedy = "", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    async for out in engine.generate([1, 2, 3, 4], greedy, request_id):
        text += out.new_text
    return text


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_core_is_built_on_the_thread_that_steps_it(
    model: Path, replicas: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _Recording.built_on, _Recording.stepped_on = [], set()
    monkeypatch.setattr(async_engine_module, "EngineCore", _Recording)
    monkeypatch.setattr(data_parallel_module, "EngineCore", _Recording)
    config = EngineConfig(model=model, dtype="float32", data_parallel_size=replicas)
    engine = AsyncEngine.from_config(config)

    async def run() -> None:
        try:
            await asyncio.gather(*(_one(engine, f"r{i}") for i in range(2 * replicas)))
        finally:
            await engine.shutdown()

    asyncio.run(run())
    assert len(_Recording.built_on) == replicas
    assert threading.get_ident() not in _Recording.built_on
    assert _Recording.stepped_on and _Recording.stepped_on <= set(_Recording.built_on)


def test_a_core_that_fails_to_build_raises_to_the_caller_and_ends_its_thread(tmp_path: Path) -> None:
    config = EngineConfig(model=tmp_path / "missing")  # valid as a setting; the build finds nothing there
    before = _engine_threads()
    with pytest.raises(Exception, match=r"config\.json|model"):
        AsyncEngine.from_config(config)
    for _ in range(100):
        if _engine_threads() <= before:
            break
        threading.Event().wait(0.05)
    assert _engine_threads() <= before


def _engine_threads() -> int:
    return sum(t.name == "tianmen-engine" and t.is_alive() for t in threading.enumerate())


def test_engines_sharing_a_thread_take_turns_and_one_can_stop_alone(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several models on the CPU share one step thread (gateway.server): both serve at once, each built and
    stepped there; one shut down leaves the other serving; the thread ends with the last."""
    _Recording.built_on, _Recording.stepped_on = [], set()
    monkeypatch.setattr(async_engine_module, "EngineCore", _Recording)
    shared = StepThread("test-shared")
    config = EngineConfig(model=model, dtype="float32", enable_prefix_caching=False)  # the same floats each time
    a, b = (AsyncEngine.from_config(config, thread=shared) for _ in range(2))
    shared.finish()

    async def run() -> None:
        texts = await asyncio.gather(*(_one(e, f"{n}{i}") for i in range(3) for n, e in (("a", a), ("b", b))))
        assert all(texts)
        await a.shutdown()
        assert shared._thread.is_alive()
        assert await _one(b, "b-after") == texts[1]  # greedy: the same as before the other stopped
        await b.shutdown()

    asyncio.run(run())
    shared.join(10)
    assert not shared._thread.is_alive()
    assert len(_Recording.built_on) == 2 and len(set(_Recording.built_on)) == 1
    assert _Recording.stepped_on == set(_Recording.built_on)


class _Broken:
    """A stepper whose turn raises (AsyncEngine.turn never does: it catches what a step raises)."""

    done = False

    def turn(self) -> bool:
        raise RuntimeError("injected")


class _Counting:
    def __init__(self, turns: int) -> None:
        self.left, self.done = turns, False

    def turn(self) -> bool:
        self.left -= 1
        self.done = self.left <= 0
        return not self.done


def test_a_stepper_that_raises_is_dropped_and_the_others_still_get_turns() -> None:
    thread = StepThread("test-broken")
    counting = _Counting(5)
    thread.attach(_Broken())
    thread.attach(counting)
    thread.finish()
    thread.join(10)
    assert not thread._thread.is_alive() and counting.done
