"""Ledger and partial-rollout buffer: transitions, FIFO, filter plugin contract, save/load."""

from __future__ import annotations

import json
import os

import pytest

from slime.ray.buffer import PartialRolloutBuffer
from slime.utils.ledger import DROPPED, FINISHED, ISSUED, PARKED, TRAINED, Ledger, LedgerError
from slime.utils.types import Sample, Status


def make_group(gid: int, n: int = 2, tokens: int = 0, version: int = 0, finished: int = 0) -> list[Sample]:
    """A group whose first `finished` members are COMPLETED and the rest ABORTED with `tokens` response tokens."""
    group = []
    for i in range(n):
        s = Sample(index=gid * 100 + i, group_index=gid, prompt=f"p{gid}", tokens=[1, 2, 3], label=str(gid))
        if tokens:
            s.append_response(list(range(10, 10 + tokens)), [-0.1 * (k + 1) - i for k in range(tokens)], version, "x" * tokens)
        s.status = Status.COMPLETED if i < finished else Status.ABORTED
        s.metadata["note"] = f"m{gid}.{i}"
        group.append(s)
    return group


# ---- Ledger -----------------------------------------------------------------------


def test_ledger_lifecycle_and_summary():
    led = Ledger()
    led.mark([1, 2, 3, 4], ISSUED)
    led.mark([1], PARKED)
    led.mark([2], FINISHED)
    led.mark([3], DROPPED, reason="filtered")
    led.mark([4], DROPPED, reason="discarded_unfinished")
    led.mark([1], ISSUED)  # parked -> issued (resumed)
    led.mark([1], FINISHED)
    led.mark([1, 2], TRAINED)
    s = led.summary()
    assert s[TRAINED] == 2 and s[DROPPED] == 2 and s[ISSUED] == 0 and s["total"] == 4
    assert s["dropped/filtered"] == 1 and s["dropped/discarded_unfinished"] == 1
    assert led.reason(3) == "filtered"


@pytest.mark.parametrize(
    "setup,state,reason",
    [
        ([], PARKED, None),  # a new group cannot be parked
        ([ISSUED, FINISHED, TRAINED], ISSUED, None),  # trained is final: never issued again
        ([ISSUED, FINISHED, TRAINED], DROPPED, "x"),
        ([ISSUED, FINISHED], PARKED, None),  # parking a finished group
        ([ISSUED, DROPPED], ISSUED, None),  # dropped is final
        ([ISSUED], ISSUED, None),  # issued twice
        ([ISSUED], DROPPED, None),  # drop without reason
        ([ISSUED], FINISHED, "why"),  # reason only with dropped
        ([ISSUED], "bogus", None),
    ],
)
def test_ledger_rejects_invalid_transitions(setup, state, reason):
    led = Ledger()
    for st in setup:
        led.mark([7], st, reason="r" if st == DROPPED else None)
    before = led.state(7)
    with pytest.raises(LedgerError):
        led.mark([7], state, reason)
    assert led.state(7) == before


def test_ledger_mark_is_all_or_nothing():
    led = Ledger()
    led.mark([1, 2], ISSUED)
    led.mark([2], FINISHED)
    with pytest.raises(LedgerError, match="group 2"):
        led.mark([1, 2], PARKED)
    assert led.state(1) == ISSUED and led.state(2) == FINISHED
    with pytest.raises(LedgerError, match="more than once"):
        led.mark([1, 1], PARKED)


def test_ledger_check_balanced():
    led = Ledger()
    led.mark([1, 2, 3], ISSUED)
    led.mark([1], PARKED)
    led.mark([2], FINISHED)
    with pytest.raises(LedgerError, match="still issued"):
        led.check_balanced([1], [2])
    assert led.check_balanced([1], [2], idle=False)[PARKED] == 1
    led.mark([3], DROPPED, reason="r")
    assert led.check_balanced([1], [2])["total"] == 3
    with pytest.raises(LedgerError, match="ledger parked but not held"):
        led.check_balanced([], [2])
    with pytest.raises(LedgerError, match="not 'finished'"):
        led.check_balanced([1], [3])
    with pytest.raises(LedgerError, match="held twice"):
        led.check_balanced([1, 1], [])


# ---- Buffer -----------------------------------------------------------------------


def issue_and_park(buf: PartialRolloutBuffer, groups):
    buf.issue(groups)
    buf.park(groups)


def test_buffer_fifo_and_ledger_states():
    buf = PartialRolloutBuffer()
    groups = [make_group(g, tokens=2) for g in (5, 3, 9, 1)]
    issue_and_park(buf, groups[:2])
    issue_and_park(buf, groups[2:])
    assert buf.num_parked() == 4
    first = buf.take_parked(3)
    assert [g[0].group_index for g in first] == [5, 3, 9]  # FIFO, not by id
    assert all(buf.group_state(g[0].group_index) == ISSUED for g in first)
    assert buf.parked_ids() == [1]
    assert buf.take_parked(0) == []
    # taken groups can be parked again and come after the ones already waiting
    buf.park(first[:1])
    assert [g[0].group_index for g in buf.take_parked(10)] == [1, 5]
    assert buf.num_parked() == 0


def test_buffer_refuses_to_park_finished_or_unissued_groups():
    buf = PartialRolloutBuffer()
    done = make_group(1, tokens=2, finished=2)
    buf.issue([done])
    with pytest.raises(LedgerError, match="finished"):
        buf.park([done])
    with pytest.raises(LedgerError, match="new -> parked"):
        buf.park([make_group(2, tokens=1)])
    assert buf.num_parked() == 0
    with pytest.raises(ValueError, match="group_index"):
        buf.issue([[Sample(group_index=1), Sample(group_index=2)]])


def test_buffer_ready_groups_stay_finished():
    buf = PartialRolloutBuffer()
    g = make_group(4, tokens=3, finished=2)
    buf.issue([g])
    with pytest.raises(LedgerError, match="issued in the ledger"):
        buf.hold_ready([g])
    buf.mark([4], FINISHED)
    buf.hold_ready([g])
    with pytest.raises(LedgerError, match="not finished"):
        buf.hold_ready([make_group(5, tokens=1)])
    assert buf.check_balanced()[FINISHED] == 1
    assert buf.take_ready(5) == [g] and buf.num_ready() == 0
    buf.mark([4], TRAINED)
    with pytest.raises(LedgerError):
        buf.issue([g])  # a trained group is never issued again


# ---- buffer filter plugin ------------------------------------------------------------


def longest_first(args, parked, num):
    return sorted(parked, key=lambda g: -g[0].response_length)[:num]


def returns_copies(args, parked, num):
    return [list(g) for g in parked[:num]]


def returns_too_many(args, parked, num):
    return parked


def returns_dupes(args, parked, num):
    return [parked[0], parked[0]]


def test_buffer_filter_plugin_picks_subset(base_args):
    args = base_args.replace(buffer_filter_path=f"{__name__}.longest_first")
    buf = PartialRolloutBuffer(args)
    issue_and_park(buf, [make_group(1, tokens=1), make_group(2, tokens=5), make_group(3, tokens=3)])
    assert [g[0].group_index for g in buf.take_parked(2)] == [2, 3]
    assert buf.parked_ids() == [1]


@pytest.mark.parametrize("fn,match", [("returns_copies", "not one of the parked"), ("returns_too_many", "only 1"),
                                      ("returns_dupes", "twice")])
def test_buffer_filter_plugin_contract_enforced(fn, match, base_args):
    args = base_args.replace(buffer_filter_path=f"{__name__}.{fn}")
    buf = PartialRolloutBuffer(args)
    issue_and_park(buf, [make_group(1, tokens=1), make_group(2, tokens=2)])
    with pytest.raises(ValueError, match=match):
        buf.take_parked(1 if fn != "returns_dupes" else 2)
    assert buf.parked_ids() == [1, 2]  # nothing handed out, nothing lost
    assert buf.group_state(1) == PARKED


# ---- persistence ----------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    buf = PartialRolloutBuffer()
    parked = [make_group(1, n=3, tokens=4, version=2, finished=1), make_group(2, n=3, tokens=0)]
    issue_and_park(buf, parked)
    ready = make_group(3, n=3, tokens=2, version=1, finished=3)
    buf.issue([ready])
    buf.mark([3], FINISHED)
    buf.hold_ready([ready])
    buf.issue([make_group(4)])
    buf.mark([4], DROPPED, reason="filtered")
    buf.issue([make_group(6)])
    buf.mark([6], FINISHED)
    buf.mark([6], TRAINED)
    path = tmp_path / "ckpt" / "buffer.json"
    buf.save(str(path))
    assert [p.name for p in path.parent.iterdir()] == ["buffer.json"]  # no temp file left behind

    new = PartialRolloutBuffer()
    new.load(str(path))
    assert new.ledger_summary() == buf.ledger_summary()
    assert new.check_balanced()[PARKED] == 2
    got = new.take_parked(5)
    assert [[s.to_dict() for s in g] for g in got] == [[s.to_dict() for s in g] for g in parked]
    s = got[0][1]
    assert s.status == Status.ABORTED and s.weight_versions == [2] * 4 and s.rollout_log_probs[0] == pytest.approx(-1.1)
    assert s.tokens == [1, 2, 3, 10, 11, 12, 13] and s.loss_mask == [1] * 4 and s.metadata == {"note": "m1.1"}
    assert got[0][0].status == Status.COMPLETED  # finished members kept as they are
    assert new.take_ready(9)[0][2].to_dict() == ready[2].to_dict()
    with pytest.raises(LedgerError):
        new.issue([make_group(6)])  # trained before the restart: never issued again


def test_save_is_atomic_and_load_errors_name_the_file(tmp_path):
    buf = PartialRolloutBuffer()
    issue_and_park(buf, [make_group(1, tokens=1)])
    path = tmp_path / "buffer.json"
    buf.save(str(path))
    good = path.read_text()
    bad = make_group(2, tokens=1)
    bad[0].metadata["obj"] = object()
    buf.issue([bad])
    buf.park([bad])
    with pytest.raises(TypeError, match="JSON"):
        buf.save(str(path))
    assert path.read_text() == good and os.listdir(tmp_path) == ["buffer.json"]
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        PartialRolloutBuffer().load(str(tmp_path / "broken.json"))


def test_load_drops_groups_issued_at_save_time(tmp_path):
    buf = PartialRolloutBuffer()
    buf.issue([make_group(1), make_group(2)])
    buf.park([make_group(2, tokens=1)])
    buf.save(str(tmp_path / "b.json"))
    new = PartialRolloutBuffer()
    new.load(str(tmp_path / "b.json"))
    assert new.group_state(1) == DROPPED and new.ledger.reason(1) == "issued_at_save"
    assert new.check_balanced()["dropped/issued_at_save"] == 1
    data = json.loads((tmp_path / "b.json").read_text())
    data["ledger"]["state"]["2"] = "finished"
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(LedgerError, match="unbalanced"):
        PartialRolloutBuffer().load(str(tmp_path / "b.json"))
