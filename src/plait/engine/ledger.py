"""Which samples each step of a fault-tolerant run takes (plait.engine.replicas), and what becomes of a share the
contribution check left out.

The run's samples form one stream. A step (a DiLoCo round: `round` steps) of n groups hands out n shares: the
next shares waiting in the queue first, then a fresh block of the rest from the frontier (the first sample no
step has handed out), share k of a block of c being its k-th of c equal parts (`Share`). Where the step commits,
the frontier moves past its fresh block, and the shares of the groups left out of the average (a contribution
refused by the check) join the queue: a later step trains them. So every sample of the stream up to the frontier
is trained exactly once, or still waits in the queue, whoever is left out or comes and goes; a step that does not
commit changes nothing (its shares are handed out again).

Which slots take the queued shares rotates with the steps settled, so that a group that keeps being left out
(quarantined, say) cannot hold one share back for good: the share goes to another group at the next step.

The ledger is the same on every group: each step's assignment follows from (groups, ledger) and the settlement
from the check's verdict, which every group reaches alike; a group that heals takes its peer's ledger with the
rest of the state, and a checkpoint holds it (plait.json: `replica_samples`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from plait.core.errors import ConfigError
from plait.engine.checkpoint.state import Part


class LedgerError(ConfigError, ValueError):
    """A malformed ledger, in a checkpoint's plait.json or a healing peer's payload: one line naming the field
    (a ConfigError: the command ends with it, exit 2, no traceback)."""


@dataclass(frozen=True)
class Share:
    """The `index`-th of `count` equal shares of the block of the stream that starts at sample `cursor` (for the
    loader: data-parallel rank `index` of `count`, from `cursor`, in global batches of `count` group batches)."""

    cursor: int
    index: int
    count: int


class SampleLedger(Part):
    """The frontier and the queue of one fault-tolerant run (see the module docstring). `share_samples`: the
    samples of one group's share (its batch times the steps of a round)."""

    OPTIONAL = True  # a checkpoint of another kind of run starts the ledger at its data position

    def __init__(self, share_samples: int) -> None:
        self.share_samples = share_samples
        self.frontier = 0
        self.queue: list[Share] = []
        self.settled = 0  # steps (rounds) committed so far
        self.requeued = 0  # shares put back in the queue so far
        self.loaded = False  # whether a checkpoint or a peer gave this ledger its state

    def assign(self, groups: int) -> list[Share]:
        """Every slot's share for a step of `groups` groups: queued shares first, to rotating slots."""
        taken = min(len(self.queue), groups)
        slots: list[Share | None] = [None] * groups
        for i in range(taken):
            slots[(self.settled + i) % groups] = self.queue[i]
        fresh = iter(range(groups - taken))
        return [s if s is not None else Share(self.frontier, next(fresh), groups - taken) for s in slots]

    def settle(self, shares: list[Share], left_out: set[int]) -> None:
        """After a committed step that took `shares` (by slot): the frontier past its fresh block, the queue
        without the shares it took, and with the left-out slots' shares at its end."""
        taken = sum(1 for s in shares if s.cursor < self.frontier)
        self.queue = self.queue[taken:] + [shares[slot] for slot in sorted(left_out)]
        self.frontier += (len(shares) - taken) * self.share_samples
        self.requeued += len(left_out)
        self.settled += 1

    def pending(self) -> int:
        """Samples waiting in the queue."""
        return len(self.queue) * self.share_samples

    def state_dict(self) -> dict[str, Any]:
        return {
            "replica_samples": {
                "frontier": self.frontier, "settled": self.settled, "requeued": self.requeued,
                "queue": [[s.cursor, s.index, s.count] for s in self.queue],
            }
        }  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A checkpoint's or a peer's ledger; a malformed one raises LedgerError naming the field, changing
        nothing (a checkpoint without one leaves this ledger as it is)."""
        if "replica_samples" not in state_dict:
            return
        got = state_dict["replica_samples"]
        if not isinstance(got, dict) or set(got) != {"frontier", "settled", "requeued", "queue"}:
            raise LedgerError(f"replica_samples: expected frontier, queue, requeued, settled; got {_keys(got)}")
        frontier, settled, requeued = (_whole(got[k], k) for k in ("frontier", "settled", "requeued"))
        queue = [_share(item, frontier) for item in _list(got["queue"])]
        self.frontier, self.settled, self.requeued, self.queue = frontier, settled, requeued, queue
        self.loaded = True

    def dumps(self) -> str:
        """The ledger as one JSON string (what a healing peer receives: its length varies with the queue)."""
        return json.dumps(self.state_dict())

    def loads(self, text: str) -> None:
        self.load_state_dict(json.loads(text))


def _keys(x: Any) -> Any:
    return sorted(x) if isinstance(x, dict) else type(x).__name__


def _whole(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LedgerError(f"replica_samples: {name} must be a whole number >= 0, got {value!r}")
    return value


def _list(value: Any) -> list:
    if not isinstance(value, list):
        raise LedgerError(f"replica_samples: queue must be a list of [cursor, index, count], got {value!r}")
    return value


def _share(item: Any, frontier: int) -> Share:
    if not isinstance(item, list) or len(item) != 3:
        raise LedgerError(f"replica_samples: each queued share must be [cursor, index, count], got {item!r}")
    cursor, index, count = (_whole(v, "a queued share's field") for v in item)
    if not (index < count and cursor < frontier):
        raise LedgerError(f"replica_samples: queued share {item} is not a handed-out share (frontier {frontier})")
    return Share(cursor, index, count)
