from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.errors import EngineOverloadedError, InvalidRequestError
from engine.outputs import ModelOutput, SchedulerOutput
from engine.params import SamplingParams
from engine.request import Request
from engine.scheduler import Scheduler


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 4,
    budget: int = 32,
    max_len: int = 64,
    max_waiting: int = 100,
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, max_len, max_waiting)


def add(s: Scheduler, rid: str, n: int, max_tokens: int = 8) -> Request:
    r = Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=max_tokens, temperature=0))
    s.add_request(r)
    return r


def finish_step(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    sampled = [q.req_id for q in out.seqs if q.sample]
    s.update_from_output(out, ModelOutput(sampled, [token] * len(sampled)))


def test_budget_is_never_exceeded_and_prefill_is_chunked() -> None:
    s = make(budget=16)
    add(s, "a", 40)
    out = s.schedule()
    assert [(q.req_id, q.start, len(q.token_ids), q.sample) for q in out.seqs] == [("a", 0, 16, False)]
    finish_step(s, out)
    out = s.schedule()
    assert [(q.start, len(q.token_ids)) for q in out.seqs] == [(16, 16)]
    finish_step(s, out)
    out = s.schedule()
    assert [(q.start, len(q.token_ids), q.sample) for q in out.seqs] == [(32, 8, True)]


def test_decodes_come_first_and_share_the_budget() -> None:
    s = make(budget=10)
    add(s, "a", 3)
    finish_step(s, s.schedule())
    add(s, "b", 20)
    out = s.schedule()
    assert out.num_decodes == 1
    assert [(q.req_id, len(q.token_ids)) for q in out.seqs] == [("a", 1), ("b", 9)]
    assert out.num_tokens == 10


def test_max_num_seqs_caps_admission_fcfs() -> None:
    s = make(max_num_seqs=2)
    for rid in "abc":
        add(s, rid, 4)
    out = s.schedule()
    assert [q.req_id for q in out.seqs] == ["a", "b"]
    assert [r.req_id for r in s.waiting] == ["c"]


def test_preempts_newest_when_blocks_run_out_and_recomputes() -> None:
    s = make(num_blocks=4, block_size=4, max_len=64)
    a, b = add(s, "a", 7, max_tokens=20), add(s, "b", 7, max_tokens=20)
    finish_step(s, s.schedule())  # prefill: each holds 2 blocks (8 slots)
    finish_step(s, s.schedule())  # decode of token 8 still fits
    out = s.schedule()  # both need a 3rd block for token 9: the pool is empty, so b (newest) gives way
    assert [q.req_id for q in out.seqs] == ["a"]
    assert b.status.value == "preempted" and a.status.value == "running"
    assert s.num_preemptions == 1 and b.num_computed_tokens == 0
    assert [r.req_id for r in s.waiting] == ["b"]
    assert s.bm.num_free_blocks == 1


def test_duplicate_ids_are_refused() -> None:
    s = make()
    add(s, "a", 3)
    with pytest.raises(InvalidRequestError, match="already in use") as e:
        add(s, "a", 3)
    assert e.value.param == "request_id"


def test_a_failed_request_ends_alone_and_frees_its_blocks() -> None:
    s = make()
    a, b = add(s, "a", 5), add(s, "b", 5)
    out = s.schedule()
    outs = s.update_from_output(out, ModelOutput(["a"], [7], None, ["b"]))
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outs] == [("a", [7], None), ("b", [], "error")]
    assert b.finished and b.finish_reason == "error" and not a.finished
    assert s.bm.block_ids("b") == [] and [r.req_id for r in s.running] == ["a"]
    assert "b" in s.schedule().finished_req_ids  # the runner drops its generator


def test_waiting_queue_is_bounded() -> None:
    s = make(max_waiting=2)
    add(s, "a", 3)
    add(s, "b", 3)
    with pytest.raises(EngineOverloadedError):
        add(s, "c", 3)


def test_stop_conditions_and_abort_free_blocks() -> None:
    s = make()
    r = add(s, "a", 3, max_tokens=2)
    finish_step(s, s.schedule())
    out = s.schedule()
    outs = s.update_from_output(out, ModelOutput(["a"], [5]))
    assert outs[-1].finish_reason == "length" and r.output_token_ids == [7, 5]
    assert s.bm.num_free_blocks == 64 and not s.has_unfinished()

    r = add(s, "b", 3)
    r.eos_token_ids = frozenset({2})
    outs = s.update_from_output(s.schedule(), ModelOutput(["b"], [2]))
    assert outs[0].finish_reason == "stop" and r.stop_reason == 2

    add(s, "c", 3)
    s.schedule()
    s.finish_request("c", "abort")
    assert s.bm.num_free_blocks == 64 and "c" in s.schedule().finished_req_ids


def test_a_prefill_under_way_never_takes_a_decodes_place() -> None:
    s = Scheduler(BlockManager(64, 4, False), 8, 12, 128, long_prefill_token_threshold=8)
    add(s, "long", 100)
    finish_step(s, s.schedule())  # alone, it takes the whole budget
    add(s, "d", 3, max_tokens=50)
    out = s.schedule()
    assert [(q.req_id, len(q.token_ids)) for q in out.seqs] == [("long", 8), ("d", 3)]
    finish_step(s, out)
    done = 20
    while done < 100:  # d decodes behind long in the running list, yet it is served first in every step
        out = s.schedule()
        assert out.num_decodes == 1 and out.seqs[0].req_id == "d" and out.seqs[1].req_id == "long"
        assert out.seqs[1].start == done and out.num_tokens <= 12
        done += len(out.seqs[1].token_ids)
        finish_step(s, out)


def test_a_long_prefill_is_capped_while_others_run_but_not_alone() -> None:
    s = Scheduler(BlockManager(64, 4, False), 4, 32, 64, long_prefill_token_threshold=8)
    add(s, "long", 40)
    out = s.schedule()
    assert [len(q.token_ids) for q in out.seqs] == [32]  # alone: the whole budget
    finish_step(s, out)
    add(s, "new", 5)
    out = s.schedule()  # the newcomer is admitted in the step right after it arrived
    assert [(q.req_id, len(q.token_ids), q.sample) for q in out.seqs] == [("long", 8, True), ("new", 5, True)]
    finish_step(s, out)
    add(s, "later", 30)
    out = s.schedule()
    assert [(q.req_id, len(q.token_ids)) for q in out.seqs] == [("long", 1), ("new", 1), ("later", 8)]


def test_prompts_that_arrive_together_are_prefilled_a_few_at_a_time() -> None:
    s = Scheduler(BlockManager(256, 4, False), 16, 4096, 128, max_prefill_tokens_per_step=250)
    for i in range(6):
        add(s, f"r{i}", 100)
    out = s.schedule()  # 250 prefill tokens: two whole prompts and a chunk of the third, not all six
    assert [(q.req_id, len(q.token_ids), q.sample) for q in out.seqs] == [
        ("r0", 100, True),
        ("r1", 100, True),
        ("r2", 50, False),
    ]
    finish_step(s, out)
    out = s.schedule()  # the first two decode (outside the cap) while the next prompts prefill
    assert [(q.req_id, len(q.token_ids)) for q in out.seqs] == [
        ("r0", 1),
        ("r1", 1),
        ("r2", 50),
        ("r3", 100),
        ("r4", 100),
    ]
    assert out.num_tokens == 252


def test_the_prefill_budget_does_not_slow_a_prompt_that_is_alone() -> None:
    s = Scheduler(BlockManager(256, 4, False), 16, 4096, 128, max_prefill_tokens_per_step=16)
    add(s, "alone", 100)
    assert [len(q.token_ids) for q in s.schedule().seqs] == [100]
