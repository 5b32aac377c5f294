"""ffstate/placement.py: where a node's daemon is reached, found as the job's own traffic finds its way; simulated
nodes' ports checked at a rank's start."""

import pytest

from ffstate import Config, placement
from ffstate.errors import FFStateError


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_the_address_set_wins_and_simulated_nodes_share_loopback(clean_env):
    assert placement.local_address(Config(daemon_host="10.1.2.3")) == "10.1.2.3"
    assert placement.daemon_address(1, Config(daemon_host="10.1.2.3", base_port=7000)) == "10.1.2.3:7000"
    assert placement.daemon_address(1, Config(simulated_nodes=2, base_port=7000)) == "127.0.0.1:7001"


def test_the_collectives_interface_then_the_route_to_the_rendezvous_host(clean_env):
    clean_env.setenv("GLOO_SOCKET_IFNAME", "lo")  # the interface gloo is told to use
    assert placement.local_address(Config()) == "127.0.0.1"
    clean_env.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")  # not there: the next way
    assert placement.interface_address("no-such-if0") is None
    assert placement.route_address("127.0.0.1", 1) == "127.0.0.1"
    got = placement.local_address(Config())
    assert got == "127.0.0.1" or not placement.is_loopback(got)  # a loopback route is passed over for the host's


def test_loopback_is_recognised_by_name_and_address():
    assert placement.is_loopback("127.0.0.1") and placement.is_loopback("localhost") and placement.is_loopback("127.5.0.1")
    assert not placement.is_loopback("10.77.1.1")


def test_simulated_nodes_whose_last_port_is_past_65535_are_refused_at_the_start_naming_the_setting(clean_env):
    clean_env.delenv("LOCAL_WORLD_SIZE", raising=False)
    clean_env.delenv("GROUP_RANK", raising=False)
    assert placement.topology(3, 4, Config(simulated_nodes=4, base_port=65532, bulk_port=65500)).node == 3
    for knob in ("base_port", "metrics_port", "bulk_port"):
        with pytest.raises(FFStateError, match=rf"{knob} \(FFSTATE_{knob.upper()}\) 65534: simulated node 3's daemon "
                                               r"would listen on 65537, past 65535"):
            placement.topology(0, 4, Config(simulated_nodes=4, **{knob: 65534}))
    assert placement.topology(0, 4, Config(base_port=65535, bulk_port=65535)).num_nodes == 1  # real nodes: the port itself
