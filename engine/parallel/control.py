"""Rank 0 → workers: each step's SchedulerOutput as JSON over the control group (never pickle: a worker
unpickling what arrives on a socket would run whatever a peer on that network sent).

A worker needs only what its model reads: per scheduled sequence the new tokens, their first position, the block
table and whether the step samples it. Sampling parameters, prompts and request ids stay on rank 0, which alone
samples.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch
import torch.distributed as dist

from engine.outputs import ScheduledSeq, SchedulerOutput
from engine.params import SamplingParams

_BLANK = SamplingParams()
STOP = {"kind": "stop"}


def encode(sched: SchedulerOutput) -> dict[str, Any]:
    return {
        "kind": "step",
        "seqs": [[s.token_ids, s.start, s.block_ids, s.sample] for s in sched.seqs],
        "num_decodes": sched.num_decodes,
        "num_tokens": sched.num_tokens,
    }


def decode(msg: dict[str, Any]) -> SchedulerOutput:
    seqs = [ScheduledSeq("", list(t), int(start), list(b), bool(s), _BLANK, [], []) for t, start, b, s in msg["seqs"]]
    return SchedulerOutput(seqs, int(msg["num_decodes"]), int(msg["num_tokens"]))


def send(ctl: dist.ProcessGroup, msg: dict[str, Any], timeout: datetime.timedelta) -> None:
    """Broadcast `msg` from rank 0; raises if a worker does not take it within `timeout` or has died."""
    data = torch.frombuffer(bytearray(json.dumps(msg, separators=(",", ":")).encode()), dtype=torch.uint8)
    _broadcast(ctl, torch.tensor([data.numel()], dtype=torch.int64), timeout)
    _broadcast(ctl, data, timeout)


def receive(ctl: dist.ProcessGroup, timeout: datetime.timedelta) -> dict[str, Any]:
    """The next message from rank 0 (on a worker); raises once rank 0 is gone."""
    size = torch.zeros(1, dtype=torch.int64)
    _broadcast(ctl, size, timeout)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    _broadcast(ctl, data, timeout)
    msg = json.loads(data.numpy().tobytes())
    if not isinstance(msg, dict) or msg.get("kind") not in ("step", "stop"):
        raise ValueError("a control message of an unknown kind")
    return msg


def _broadcast(ctl: dist.ProcessGroup, t: torch.Tensor, timeout: datetime.timedelta) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.timeout = 0, timeout
    ctl.broadcast([t], opts).wait()
