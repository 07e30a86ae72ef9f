from __future__ import annotations

from engine.block_manager import BlockManager
from engine.params import SamplingParams
from engine.request import Request


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_salt=salt)


def admit(bm: BlockManager, r: Request) -> list[int]:
    hits = bm.get_computed_blocks(r)
    n = len(hits) * bm.block_size
    ids = bm.allocate(r, r.num_tokens - n, hits)
    r.num_computed_tokens = r.num_tokens
    return ids


def test_allocate_takes_blocks_in_order_and_counts_refs() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", list(range(10)))  # 3 blocks
    assert admit(bm, a) == [0, 1, 2]
    assert bm.num_free_blocks == 5
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 0]


def test_prefix_hit_shares_full_blocks_only() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = req("a", list(range(10)))
    admit(bm, a)
    b = req("b", list(range(9)) + [99])  # same first 8 tokens = 2 full blocks
    hits = bm.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    assert admit(bm, b) == [0, 1, 3]
    assert [bm.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert bm.num_hit_tokens == 8


def test_full_prompt_hit_leaves_last_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, req("a", list(range(8))))
    hits = bm.get_computed_blocks(req("b", list(range(8))))
    assert [h.block_id for h in hits] == [0]


def test_different_salts_never_share() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, req("a", list(range(8)), salt="tenant-a"))
    assert bm.get_computed_blocks(req("b", list(range(8)) + [1], salt="tenant-b")) == []
    assert bm.get_computed_blocks(req("c", list(range(8)) + [1], salt=None)) == []
    assert len(bm.get_computed_blocks(req("d", list(range(8)) + [1], salt="tenant-a"))) == 2


def test_free_returns_blocks_tail_first_and_cached_blocks_revive() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req("a", list(range(12)))
    admit(bm, a)  # blocks 0, 1, 2 all full and cached
    bm.free(a)
    assert list(bm.free_queue) == [3, 2, 1, 0]  # the never-used block first, then a's tail before its head
    b = req("b", list(range(8)) + [50, 51])
    hits = bm.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    assert admit(bm, b) == [0, 1, 3]
    assert list(bm.free_queue) == [2]


def test_lru_eviction_drops_the_hash() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a = req("a", list(range(8)))
    admit(bm, a)
    bm.free(a)  # free queue: 2, 1, 0 (1 and 0 cached)
    admit(bm, req("b", [7] * 9))  # needs 3 blocks: evicts all
    assert bm.get_computed_blocks(req("c", list(range(8)) + [1])) == []


def test_can_allocate_counts_revived_blocks() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    a = req("a", list(range(8)))
    admit(bm, a)
    bm.free(a)  # all 3 free, 2 of them cached
    b = req("b", list(range(8)) + [1, 2, 3, 4, 5])  # hits 2 blocks, needs 2 more: only 1 left
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    assert not bm.can_allocate(b, 5, hits)
    assert bm.can_allocate(b, 4, hits)


def test_decode_growth_allocates_a_block_at_the_boundary() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = req("a", list(range(4)))
    admit(bm, a)
    a.append_output(9)
    assert bm.num_blocks_needed(a, 1) == 1
    assert bm.allocate(a, 1) == [0, 1]
    a.num_computed_tokens += 1
    a.append_output(10)
    assert bm.num_blocks_needed(a, 1) == 0


def test_pinned_blocks_are_never_evicted_and_count_as_used() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    warm = req("w", list(range(10)), salt="acme")  # 2 full blocks + a partial one
    admit(bm, warm)
    assert bm.pin(warm, keep_free=2) == 8
    bm.free(warm)
    assert bm.num_pinned_blocks == 2 and bm.num_free_blocks == 4  # the partial block went back
    for i in range(20):  # pressure: every free block is reused many times over
        r = req(f"r{i}", [1000 + 16 * i + k for k in range(16)], salt="acme")
        admit(bm, r)
        bm.free(r)
    hits = bm.get_computed_blocks(req("x", list(range(8)) + [7, 7], salt="acme"))
    assert [h.block_id for h in hits] == [b.block_id for b in bm.blocks[:2]]
    assert bm.get_computed_blocks(req("y", list(range(8)) + [7, 7], salt="globex")) == []


def test_pinning_refuses_to_leave_less_than_one_sequence() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    warm = req("w", list(range(12)) + [1])
    admit(bm, warm)
    assert bm.pin(warm, keep_free=2) == -1 and bm.num_pinned_blocks == 0
    bm.free(warm)
    assert bm.num_free_blocks == 4
    again = req("v", list(range(8)) + [1])  # a prefix of what was refused: two blocks fit beside the reserve
    admit(bm, again)
    assert bm.pin(again, keep_free=2) == 8 and bm.pin(again, keep_free=2) == 8  # pinning twice pins once
    assert bm.num_pinned_blocks == 2
