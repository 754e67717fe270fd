"""``swarm.config_for``: the one ``Experiment -> SwarmConfig`` builder of volunteers and the backbone."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import tiny_experiment

from dedloc_core.catalog.model import experiment_from
from dedloc_core.engine import swarm

PEER = "/ip4/192.0.2.1/tcp/4001/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"

# the fields that are deliberately not the catalog's on the backbone (swarm.config_for says why)
BACKBONE_OWN = {"initial_peers", "overlap", "dht_client", "relay_service"}


def _exp(**overrides):
    return experiment_from(tiny_experiment(initial_peers=[PEER], overlap=True, average_state_every=3,
                                           volunteer_dht="client", **overrides))


def test_the_catalogs_values_reach_volunteers_and_the_backbone_alike():
    exp = _exp()
    volunteer, backbone = swarm.config_for(exp), swarm.config_for(exp, role="backbone")
    assert (volunteer.run_id, volunteer.target_batch_size, volunteer.batch_size_per_step) == ("tiny_lm_test", 512, 8)
    assert (volunteer.matchmaking_time, volunteer.averaging_timeout) == (2.0, 15.0)
    assert (volunteer.average_state_every, volunteer.overlap, volunteer.dht_client) == (3, True, True)
    assert volunteer.initial_peers == [PEER] and not volunteer.relay_service
    assert (backbone.initial_peers, backbone.overlap, backbone.dht_client, backbone.relay_service) == ([], False,
                                                                                                    False, True)
    differ = {f.name for f in dataclasses.fields(swarm.SwarmConfig)
              if getattr(volunteer, f.name) != getattr(backbone, f.name)}
    assert differ == BACKBONE_OWN


def test_a_peers_own_fields_override_the_catalogs():
    cfg = swarm.config_for(_exp(), role="backbone", initial_peers=[PEER], relay_service=False,
                           host_maddrs=["/ip4/0.0.0.0/tcp/31337"])
    assert (cfg.initial_peers, cfg.relay_service, cfg.host_maddrs) == ([PEER], False, ["/ip4/0.0.0.0/tcp/31337"])
    assert swarm.config_for(_exp(), batch_size_per_step=2).batch_size_per_step == 2
    with pytest.raises(ValueError, match="role"):
        swarm.config_for(_exp(), role="keeper")
