"""The pure pieces of tensor parallel: which heads a rank holds, the step message, a padded vocabulary part, how
ranks agree on a measured limit."""

from __future__ import annotations

import datetime
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from engine.errors import ConfigError, ModelLoadError
from engine.layers.parallel import Part, VocabEmbedding, split_heads, vocab_head
from engine.loader import _InMemory, _load_part
from engine.model_runner import ModelRunner
from engine.outputs import ScheduledSeq, SchedulerOutput
from engine.parallel import control
from engine.parallel.group import Group, TorchGroup
from engine.params import SamplingParams


class _Rank(Group):
    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.rank, self.size = rank, size


@pytest.mark.parametrize(
    ("heads", "kv", "size", "want"),
    [
        (4, 2, 2, [(2, 0, 1, 0), (2, 2, 1, 1)]),  # KV heads split
        (4, 1, 2, [(2, 0, 1, 0), (2, 2, 1, 0)]),  # one KV head, replicated
        (8, 2, 4, [(2, 0, 1, 0), (2, 2, 1, 0), (2, 4, 1, 1), (2, 6, 1, 1)]),  # each rank's queries use its KV head
        (8, 8, 4, [(2, 0, 2, 0), (2, 2, 2, 2), (2, 4, 2, 4), (2, 6, 2, 6)]),
    ],
)
def test_each_rank_holds_its_query_heads_and_the_kv_heads_they_use(heads: int, kv: int, size: int, want: list) -> None:
    got = [split_heads(heads, kv, _Rank(r, size)) for r in range(size)]
    assert [(h.num_heads, h.q_start, h.num_kv_heads, h.kv_start) for h in got] == want
    group = heads // kv  # query head j uses KV head j // group: the rank's KV heads must be those
    for h in got:
        assert h.q_start // group >= h.kv_start and (h.q_start + h.num_heads - 1) // group < h.kv_start + h.num_kv_heads


@pytest.mark.parametrize(("heads", "kv", "size"), [(4, 2, 3), (12, 6, 4), (6, 3, 2)])
def test_heads_that_do_not_split_are_refused(heads: int, kv: int, size: int) -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        split_heads(heads, kv, _Rank(0, size))


def test_the_step_message_carries_what_a_worker_runs_and_nothing_else() -> None:
    params = SamplingParams(temperature=0.5, seed=3, stop=["secret"])
    seqs = [
        ScheduledSeq("req-a", [5], 9, [0, 1], True, params, [1, 2, 3], [4]),
        ScheduledSeq("req-b", [7, 8, 9], 0, [2], False, params, [7, 8, 9], []),
    ]
    msg = control.encode(SchedulerOutput(seqs, 1, 4, ["gone"]))
    text = str(msg)
    assert "req-a" not in text and "secret" not in text and "gone" not in text
    back = control.decode(msg)
    assert (back.num_decodes, back.num_tokens) == (1, 4)
    assert [(s.token_ids, s.start, s.block_ids, s.sample) for s in back.seqs] == [
        ([5], 9, [0, 1], True),
        ([7, 8, 9], 0, [2], False),
    ]
    assert all(s.prompt_token_ids == [] and s.req_id == "" for s in back.seqs)


def test_the_last_rank_pads_an_uneven_vocabulary_with_zero_rows() -> None:
    table = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)  # vocabulary 10 over 3 ranks: 4, 4, 2
    for rank, rows in ((0, range(0, 4)), (2, range(8, 10))):
        emb = VocabEmbedding(10, 3, _Rank(rank, 3))
        _load_part(emb.weight, _InMemory(table), emb.tp_slices["weight"], "embed", "f", None)
        assert emb.weight.shape == (4, 3)
        assert torch.equal(emb.weight[: len(rows)], table[rows.start : rows.stop])
        assert not emb.weight[len(rows) :].any()
        head = vocab_head(3, 10, _Rank(rank, 3))
        assert head.weight.shape == (4, 3) and head.tp_slices["weight"] == Part(0, rows.start, len(rows))


def test_a_part_that_does_not_fit_the_checkpoint_is_refused() -> None:
    param = nn.Parameter(torch.empty(4, 3), requires_grad=False)
    with pytest.raises(ModelLoadError, match="does not fit"):
        _load_part(param, _InMemory(torch.zeros(10, 5)), Part(0, 8, 4), "w", "f", None)


def test_ranks_agree_on_the_smallest_of_their_measured_limits_over_gloo() -> None:
    """TorchGroup.min_over_ranks over a real gloo group (two ranks on threads of this process)."""
    store = dist.HashStore()
    got: dict[int, int] = {}

    def rank(r: int) -> None:
        pg = dist.ProcessGroupGloo(store, r, 2, datetime.timedelta(seconds=30))
        got[r] = TorchGroup(pg, r, 2).min_over_ranks((17, 5)[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {0: 5, 1: 5}


class _Agreeing(Group):
    """A rank whose peers measured `peer_limit`: what min_over_ranks over the group would give."""

    def __init__(self, peer_limit: int) -> None:
        super().__init__()
        self.peer_limit = peer_limit
        self.asked: list[int] = []

    def min_over_ranks(self, value: int) -> int:
        self.asked.append(value)
        return min(value, self.peer_limit)


class _Layer:
    def __init__(self, limit: int) -> None:
        self.prefill_in_place = limit

    def in_place(self, rows: int) -> bool:
        return True


@pytest.mark.parametrize(("own", "peer", "want"), [(32, 8, 8), (8, 32, 8), (0, 32, 0)])
def test_the_runner_lays_out_prompt_chunks_by_the_limit_every_rank_agreed_on(own: int, peer: int, want: int) -> None:
    """Which chunks attend in place decides how many rows a step's last all-reduce carries: each rank's own
    measured limit would let the ranks disagree (a gloo failure on the step), so the runner takes the group's."""
    group = _Agreeing(peer)
    model = SimpleNamespace(attention_layers=lambda: [_Layer(own), _Layer(own + 4)])
    runner = SimpleNamespace(model=model, group=group)
    ModelRunner.plan_attention(runner)  # type: ignore[arg-type]
    assert runner.prefill_in_place == own and group.asked == []  # the rank's own, until every rank has loaded
    ModelRunner.agree_with_ranks(runner)  # type: ignore[arg-type]
    assert runner.prefill_in_place == want and group.asked == [own]
