"""multigpu/engine/replicas.py: what a replica group checks of the peer it heals from (the runs themselves, with
a Lighthouse, are in tests/parallel/test_fault_tolerance.py and test_semi_sync.py)."""

from __future__ import annotations

import pytest

from multigpu.config import parse_config
from multigpu.engine.replicas import refuse_other_settings
from multigpu.errors import UsageError

GROUP = ["--fault-tolerance", "--ft-replica-groups", "2", "--ft-replica-id", "1", "--save-dir", "r"]
DILOCO = [*GROUP, "--semi-sync", "diloco", "--sync-every", "4"]


@pytest.mark.parametrize(
    "mine, said",
    [
        ([*DILOCO, "--outer-lr", "0.5"], "outer_lr: 0.7 -> 0.5"),
        ([*GROUP, "--semi-sync", "diloco", "--sync-every", "8"], "sync_every: 4 -> 8"),
        (GROUP, "semi_sync: diloco -> None; sync_every: 4 -> None"),
        ([*DILOCO, "--lr", "0.01"], "lr: 0.001 -> 0.01"),
    ],
    ids=["outer lr", "sync every", "no semi-sync", "lr"],
)
def test_a_group_that_would_sync_or_step_by_other_rules_than_its_peer_is_refused(mine, said):
    peer = parse_config(DILOCO).to_dict()
    with pytest.raises(UsageError, match=f"with other settings than replica group 0, .*\\({said}: group 0.s"):
        refuse_other_settings(peer, parse_config(mine), 1, 0)


def test_a_group_with_its_peers_settings_joins_whatever_its_devices():
    peer = parse_config(DILOCO).to_dict()
    refuse_other_settings(peer, parse_config([*DILOCO, "--ft-min-replicas", "2", "--num-workers", "2"]), 1, 0)
