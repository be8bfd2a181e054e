"""The sample ledger of a fault-tolerant run (plait.engine.ledger): whatever the groups taking part, the steps
that fail and the groups left out, every sample up to the frontier is trained exactly once or waits in the queue;
its state survives a round trip, and a malformed one is refused by field, changing nothing."""

from __future__ import annotations

import json
import random

import pytest

from plait.core.errors import ConfigError
from plait.engine.ledger import LedgerError, SampleLedger, Share
from plait.parallel.replicas.contributions import ContributionCheck

BATCH, ROUND = 4, 3  # a group's batch, and the steps of a (DiLoCo) round


def samples(share: Share) -> list[int]:
    """A share's samples as the loader takes them (plait.data.loader.TokenLoader.place: rank `index` of `count`,
    in global batches of `count` group batches, for the round's steps)."""
    width = share.count * BATCH
    return [share.cursor + r * width + share.index * BATCH + j for r in range(ROUND) for j in range(BATCH)]


def test_a_left_out_share_is_trained_by_the_next_step_and_the_frontier_moves_past_fresh_blocks_only():
    ledger = SampleLedger(BATCH * ROUND)
    first = ledger.assign(3)
    assert first == [Share(0, 0, 3), Share(0, 1, 3), Share(0, 2, 3)]
    ledger.settle(first, left_out={1})
    assert (ledger.frontier, ledger.queue, ledger.pending()) == (36, [Share(0, 1, 3)], 12)
    second = ledger.assign(3)  # the queued share to slot 1 (settled = 1), a fresh block of two for the others
    assert second == [Share(36, 0, 2), Share(0, 1, 3), Share(36, 1, 2)]
    ledger.settle(second, left_out=set())
    assert (ledger.frontier, ledger.queue, ledger.requeued) == (60, [], 1)


def test_a_group_always_left_out_does_not_hold_a_share_back():
    """Slot 0 is left out at every step (a quarantined group): the queued share rotates to another slot."""
    ledger = SampleLedger(BATCH * ROUND)
    waited: dict[Share, int] = {}
    for _ in range(30):
        shares = ledger.assign(3)
        for s in ledger.queue:
            waited[s] = waited.get(s, 0) + 1
        ledger.settle(shares, left_out={0})
        assert len(ledger.queue) == 1
    assert max(waited.values()) <= 3


@pytest.mark.parametrize("seed", range(20))
def test_every_sample_is_trained_once_or_queued_whoever_comes_goes_or_is_left_out(seed):
    rng = random.Random(seed)
    ledger = SampleLedger(BATCH * ROUND)
    trained: list[int] = []
    for _ in range(60):
        groups = rng.randint(1, 5)
        shares = ledger.assign(groups)
        assert len(shares) == groups and len(set(shares)) == groups
        if rng.random() < 0.2:
            continue  # the step failed on a group: nothing commits, nothing moves
        left_out = {s for s in range(groups) if rng.random() < 0.25}
        for slot, share in enumerate(shares):
            if slot not in left_out:
                trained += samples(share)
        ledger.settle(shares, left_out)
    queued = [x for s in ledger.queue for x in samples(s)]
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert sorted(trained + queued) == list(range(ledger.frontier)), "a sample was lost or invented"


def test_the_ledger_survives_a_round_trip_and_a_checkpoint_without_one_leaves_it():
    ledger = SampleLedger(BATCH * ROUND)
    for left_out in ({2}, set(), {0, 1}):
        ledger.settle(ledger.assign(3), left_out)
    other = SampleLedger(BATCH * ROUND)
    other.loads(ledger.dumps())
    assert (other.frontier, other.queue, other.settled, other.requeued, other.loaded) == (
        ledger.frontier, ledger.queue, ledger.settled, ledger.requeued, True,
    )  # fmt: skip
    untouched = SampleLedger(BATCH * ROUND)
    untouched.load_state_dict({"train_state": {"step": 3}})
    assert (untouched.frontier, untouched.loaded) == (0, False)


GOOD = {"frontier": 72, "settled": 2, "requeued": 1, "queue": [[36, 1, 3]]}
BAD = [
    ("not a mapping", [1, 2], "expected frontier, queue, requeued, settled"),
    ("a key missing", {k: v for k, v in GOOD.items() if k != "settled"}, "expected frontier"),
    ("an extra key", {**GOOD, "cursor": 0}, "expected frontier"),
    ("negative frontier", {**GOOD, "frontier": -12}, "frontier must be a whole number"),
    ("float frontier", {**GOOD, "frontier": 72.0}, "frontier must be a whole number"),
    ("bool settled", {**GOOD, "settled": True}, "settled must be a whole number"),
    ("string requeued", {**GOOD, "requeued": "1"}, "requeued must be a whole number"),
    ("queue not a list", {**GOOD, "queue": {"0": [36, 1, 3]}}, "queue must be a list"),
    ("share of two fields", {**GOOD, "queue": [[36, 1]]}, "must be [cursor, index, count]"),
    ("share not a list", {**GOOD, "queue": ["36,1,3"]}, "must be [cursor, index, count]"),
    ("negative cursor", {**GOOD, "queue": [[-1, 1, 3]]}, "a queued share's field must be a whole number"),
    ("index past count", {**GOOD, "queue": [[36, 3, 3]]}, "is not a handed-out share"),
    ("cursor at the frontier", {**GOOD, "queue": [[72, 0, 3]]}, "is not a handed-out share"),
]


@pytest.mark.parametrize(("what", "state", "message"), BAD, ids=[b[0] for b in BAD])
def test_a_malformed_ledger_is_refused_by_field_and_changes_nothing(what, state, message):
    ledger = SampleLedger(BATCH * ROUND)
    ledger.settle(ledger.assign(2), {1})
    before = ledger.dumps()
    with pytest.raises(LedgerError, match=r"^replica_samples: .*" + message.replace("[", r"\[").replace("]", r"\]")):
        ledger.load_state_dict({"replica_samples": state})
    assert ledger.dumps() == before and not ledger.loaded
    assert issubclass(LedgerError, ConfigError)  # a command ends with one line, exit 2, no traceback
    SampleLedger(BATCH * ROUND).load_state_dict({"replica_samples": GOOD})  # the good one loads


class _Probe:
    """A state part that records whether it was loaded."""

    def __init__(self) -> None:
        self.loaded = False

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = True


PEER = {"samples": json.dumps({"replica_samples": GOOD}), "contributions": json.dumps(ContributionCheck().state_dict())}
PEER_BAD = [
    ("ledger not JSON", {**PEER, "samples": "{frontier: 1"}, "user/default/samples"),
    ("ledger malformed", {**PEER, "samples": json.dumps({"replica_samples": {**GOOD, "frontier": -1}})}, "samples"),
    ("history not JSON", {**PEER, "contributions": "[1,"}, "user/default/contributions"),
    ("history malformed", {**PEER, "contributions": json.dumps({"round": 1})}, "contributions"),
]


@pytest.mark.parametrize(("what", "received", "field"), PEER_BAD, ids=[b[0] for b in PEER_BAD])
def test_a_peers_malformed_ledger_or_history_is_refused_before_anything_changes(what, received, field):
    """What a healing group receives as JSON strings (the transport checks only that they are strings) is parsed
    and checked before any part of the state is loaded."""
    from plait.engine.replicas import FaultTolerant
    from plait.parallel.replicas import HealRefused

    group = object.__new__(FaultTolerant)  # its state only: no torchft Manager is needed to heal into it
    group.ledger, group.check, group.parts = SampleLedger(BATCH * ROUND), ContributionCheck(), [_Probe()]
    before = group.ledger.dumps()
    with pytest.raises(HealRefused, match=field):
        group._load(received)
    assert not group.parts[0].loaded and group.ledger.dumps() == before
    group._load(PEER)  # a good one heals
    assert group.parts[0].loaded and group.ledger.frontier == GOOD["frontier"]
