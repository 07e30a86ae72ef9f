from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.request import Request


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the prefix cache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """A pool of fixed-size KV blocks with reference counts and a tenant-salted prefix cache.

    Free blocks sit in an LRU queue (head evicted first); a free block that is still cached can be
    revived by a prefix hit until it is reused. Hashes chain as H(parent, tokens) from a per-tenant
    root, so requests with different `cache_salt` never share a block. A pinned block (a warm-up prompt's,
    `pin`) holds a reference forever, so it never enters the free queue and is never evicted.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self._seed = os.urandom(16)  # NOTE: per process, so cache hits cannot be predicted from outside
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.pinned: dict[int, Block] = {}  # block id -> block: warm-up prefixes, held for the process's life

    # ---- prefix cache ------------------------------------------------------------------
    def _root(self, salt: str | None) -> bytes:
        return hashlib.sha256(self._seed + b"salt\0" + (salt or "").encode()).digest()

    def hash_blocks(self, req: Request) -> list[bytes]:
        """Extend req.block_hashes to every full block of its known tokens."""
        bs, hashes, tokens = self.block_size, req.block_hashes, req.token_ids
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[i - 1] if i else self._root(req.cache_salt)
            hashes.append(hashlib.sha256(parent + array("q", tokens[i * bs : (i + 1) * bs]).tobytes()).digest())
        return hashes

    def cached_prefix_blocks(self, token_ids: Sequence[int], salt: str | None) -> int:
        """How many leading full blocks of these tokens (for this tenant) the cache holds now; read-only, so a
        data-parallel front may ask from another thread (a stale answer only routes less well)."""
        if not self.enable_prefix_caching:
            return 0
        bs, parent, n = self.block_size, self._root(salt), 0
        for i in range(len(token_ids) // bs):
            parent = hashlib.sha256(parent + array("q", token_ids[i * bs : (i + 1) * bs]).tobytes()).digest()
            if parent not in self.cached:
                break
            n += 1
        return n

    def get_computed_blocks(self, req: Request) -> list[Block]:
        """Longest cached prefix of a request that has computed nothing yet, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching or req.num_computed_tokens:
            return []
        hits: list[Block] = []
        for h in self.hash_blocks(req):
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size >= req.num_tokens:
            hits.pop()  # the last token must run through the model to produce logits
        return hits

    # ---- allocation --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def num_blocks_needed(self, req: Request, num_new_tokens: int, computed: Sequence[Block] = ()) -> int:
        num_total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        have = len(self.req_blocks.get(req.req_id, ())) + len(computed)
        return max(0, cdiv(num_total, self.block_size) - have)

    def can_allocate(self, req: Request, num_new_tokens: int, computed: Sequence[Block] = ()) -> bool:
        revived = sum(1 for b in computed if b.ref_cnt == 0)  # cached-but-free hits leave the free queue
        return self.num_blocks_needed(req, num_new_tokens, computed) <= self.num_free_blocks - revived

    def allocate(self, req: Request, num_new_tokens: int, computed: Sequence[Block] = ()) -> list[int]:
        """Give `req` room for `num_new_tokens` more tokens (after `computed` prefix hits); returns its block ids."""
        assert self.can_allocate(req, num_new_tokens, computed)
        num_new_blocks = self.num_blocks_needed(req, num_new_tokens, computed)
        if req.req_id not in self.req_blocks and self.enable_prefix_caching:  # admission: count cache stats
            self.num_queried_tokens += req.num_tokens
            self.num_hit_tokens += len(computed) * self.block_size
        blocks = self.req_blocks.setdefault(req.req_id, [])
        for b in computed:
            if b.ref_cnt == 0:
                del self.free_queue[b.block_id]
            b.ref_cnt += 1
        blocks.extend(computed)
        for _ in range(num_new_blocks):
            blocks.append(self._pop_free())
        if self.enable_prefix_caching:
            num_known = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
            self._cache_full_blocks(req, blocks, num_known)
        return [b.block_id for b in blocks]

    def _pop_free(self) -> Block:
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:  # evict: its content is about to be overwritten
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def _cache_full_blocks(self, req: Request, blocks: list[Block], num_known: int) -> None:
        start = self.num_cached_blocks.get(req.req_id, 0)
        end = min(num_known, req.num_tokens) // self.block_size
        if end <= start:
            return
        hashes = self.hash_blocks(req)
        for i in range(start, end):
            block, h = blocks[i], hashes[i]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                self.cached[h] = block
        self.num_cached_blocks[req.req_id] = end

    def free(self, req: Request) -> None:
        """Release a request's blocks; its tail is freed first so it is evicted before its prefix."""
        self.num_cached_blocks.pop(req.req_id, None)
        for block in reversed(self.req_blocks.pop(req.req_id, [])):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def pin(self, req: Request, keep_free: int) -> int:
        """Pin the cached full blocks of `req`'s prompt (call before `free`); returns the tokens now pinned.

        Refuses (returns -1, pins nothing) if the pinned blocks would leave fewer than `keep_free` blocks for
        everything else: a request that cannot fit beside them could never run."""
        if not self.enable_prefix_caching:
            return 0
        blocks: list[Block] = []
        for h in self.hash_blocks(req)[: req.num_prompt_tokens // self.block_size]:
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        new = {b.block_id: b for b in blocks if b.block_id not in self.pinned}
        if self.num_blocks - len(self.pinned) - len(new) < keep_free:
            return -1
        for block in new.values():
            if block.ref_cnt == 0:  # NOTE: not while `req` holds it; kept for a caller that freed first
                del self.free_queue[block.block_id]
            block.ref_cnt += 1
        self.pinned.update(new)
        return len(blocks) * self.block_size

    @property
    def num_pinned_blocks(self) -> int:
        return len(self.pinned)

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, ())]

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
