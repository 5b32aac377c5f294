"""ffstate/config.py: defaults, FFSTATE_* overrides, validation, and the daemon's configuration as flags."""

import dataclasses

import pytest

from ffstate import Config
from ffstate.config import DaemonConfig


def test_defaults_and_env_overrides(monkeypatch):
    assert Config().kernels == "auto" and Config().max_lag == 1
    monkeypatch.setenv("FFSTATE_MAX_LAG", "3")
    monkeypatch.setenv("FFSTATE_KERNELS", "torch")
    cfg = Config.from_env(codec_threads=3)
    assert (cfg.max_lag, cfg.kernels, cfg.codec_threads) == (3, "torch", 3)


def test_bad_values_are_refused_with_the_variable_named(monkeypatch):
    monkeypatch.setenv("FFSTATE_MAX_LAG", "lots")
    with pytest.raises(ValueError, match="FFSTATE_MAX_LAG"):
        Config.from_env()
    with pytest.raises(ValueError, match="kernels"):
        Config(kernels="cuda")
    for name in ("drain_hold", "pause_limit"):  # a pause must end (the drain's is its hold, plus a margin)
        with pytest.raises(ValueError, match=name):
            Config(**{name: float("inf")})


def test_a_value_refused_by_a_check_names_its_variable_and_a_size_is_checked_at_once(monkeypatch):
    monkeypatch.setenv("FFSTATE_HANG_ACTION", "kil")
    with pytest.raises(ValueError, match=r"hang_action must be one of .*got 'kil' \(set by FFSTATE_HANG_ACTION='kil'\)"):
        Config.from_env()
    assert Config.from_env(hang_action="log").hang_action == "log"  # an override is not the variable's
    monkeypatch.delenv("FFSTATE_HANG_ACTION")
    monkeypatch.setenv("FFSTATE_HANG_FLOOR", "-1")
    with pytest.raises(ValueError, match=r"\(set by FFSTATE_HANG_FLOOR='-1'\)"):
        Config.from_env()
    monkeypatch.delenv("FFSTATE_HANG_FLOOR")
    # a started daemon's flags: refused at entry, by name (a daemon's start failed on them, after a rendezvous)
    monkeypatch.setenv("FFSTATE_DAEMON_MEMORY_LIMIT", "lots")
    with pytest.raises(ValueError, match=r"daemon_memory_limit is a size such as 512M or 8G, got 'lots' \(set by "
                                         r"FFSTATE_DAEMON_MEMORY_LIMIT='lots'\)"):
        Config.from_env()
    with pytest.raises(ValueError, match="link_bandwidth is a size"):
        Config(link_bandwidth="fast")
    assert Config(daemon_memory_limit="1.5G", link_bandwidth="25M").link_bandwidth == "25M"


def test_a_variable_no_setting_reads_is_named_once(monkeypatch, caplog):
    from ffstate import envconfig

    monkeypatch.setattr(envconfig, "_warned", set())
    monkeypatch.setenv("FFSTATE_MAXLAG", "2")  # FFSTATE_MAX_LAG, misspelt
    monkeypatch.setenv("FFSTATE_ATTEMPT", "1")  # the in-process engine's: read elsewhere
    with caplog.at_level("WARNING", logger="ffstate"):
        assert Config.from_env().max_lag == 1
        Config.from_env()
    said = [r.getMessage() for r in caplog.records if "no such setting" in r.getMessage()]
    assert said == ["FFSTATE_MAXLAG: no such setting, ignored (misspelt? every FFSTATE_ variable is in "
                    "docs/configuration.md)"], said


def test_a_started_daemons_command_line_gives_back_its_configuration(tmp_path):
    """A worker starts its node's daemon from one DaemonConfig: its flags, parsed by `ffstate serve`'s own
    parser, must give the same configuration back, field for field (the token travels in the environment)."""
    from ffstate.cli import build_parser
    from ffstate.config import DaemonConfig
    from ffstate.daemon.launch import daemon_config

    cfg = Config(replicas=1, max_lag=6, daemon_memory_limit="1.5G", daemon_idle_exit=42.0, scheduler="naive",
                 link_share=0.25, link_bandwidth="25M", metrics_port=9100, base_port=7800, persist_dir=str(tmp_path),
                 persist_nice="7", daemon_nice="19", daemon_cpus="60-63", bulk_port=7900)
    want = daemon_config(cfg, 1, "node1", "10.0.0.2:7800", tmp_path)
    args = build_parser().parse_args(["serve", *want.to_args()])
    got = DaemonConfig.from_args(args, token=want.token)
    assert got == want
    assert (got.port, got.node_id, got.keep_deltas, got.memory_limit, got.link_bandwidth, got.metrics_port) == (
        7800, "node1", 7, 3 << 29, 25 << 20, 9100)  # keep_deltas: max_lag + 1
    assert (got.persist_dir, got.persist_nice, got.nice, got.cpus) == (tmp_path, 7, 19, "60-63")
    assert got.bulk_port == 7900  # every node's daemon on the same ports: a firewall rule and a scrape config for all
    moved = daemon_config(cfg, 1, "node1", "10.0.0.2:7801", tmp_path)  # a daemon of another job held 7800
    assert (moved.metrics_port, moved.bulk_port) == (9101, 7901)  # its other ports move as far as its own
    sim = dataclasses.replace(cfg, simulated_nodes=2)
    assert [(d.metrics_port, d.bulk_port) for d in (daemon_config(sim, 1, "node1", "127.0.0.1:7801", tmp_path),
                                                     daemon_config(sim, 1, "node1", "127.0.0.1:7803", tmp_path))] == [
        (9101, 7901), (9103, 7903)]  # nodes sharing a host: port + node, and + the nodes' count a port moved
    # 0 (the kernel's pick) and -1 (off) pass as they are
    assert [daemon_config(Config(bulk_port=p, simulated_nodes=2), 1, "n1", "h:1", tmp_path).bulk_port
            for p in (0, -1)] == [0, -1]
    assert "--token" not in " ".join(want.to_args())
    with pytest.raises(ValueError, match="go together"):
        DaemonConfig(tls_cert=tmp_path / "cert.pem")
    with pytest.raises(ValueError, match=r"bulk_port \(--bulk-port\) takes a TCP port, 0 .* or -1 \(none\); got -2"):
        DaemonConfig(bulk_port=-2)
    with pytest.raises(ValueError, match="FFSTATE_BULK_PORT"):
        Config(bulk_port=70000)



def test_the_flushing_process_and_the_started_daemon_priorities_are_idle_or_a_niceness(monkeypatch):
    from ffstate.config import DaemonConfig

    assert Config().persist_nice == "idle" and DaemonConfig().persist_nice == "idle"
    monkeypatch.setenv("FFSTATE_PERSIST_NICE", "20")
    with pytest.raises(ValueError, match="persist_nice must be a niceness 0-19 or 'idle', got '20'"):
        Config.from_env()
    with pytest.raises(ValueError, match="persist_nice"):
        DaemonConfig(persist_nice="low")
    monkeypatch.setenv("FFSTATE_PERSIST_NICE", "idle")
    monkeypatch.setenv("FFSTATE_DAEMON_NICE", "-5")  # a started daemon may lower its priority, never raise it
    with pytest.raises(ValueError, match="daemon_nice must be a niceness 0-19 or 'idle', got '-5'"):
        Config.from_env()
    monkeypatch.setenv("FFSTATE_DAEMON_NICE", "idle")
    assert Config.from_env().daemon_nice == "idle" and Config().daemon_nice == "0"


def test_cpu_lists_are_read_as_taskset_writes_them_and_anything_else_is_refused_by_name():
    from ffstate.config import cpu_list

    assert cpu_list("") == frozenset() and cpu_list("60-63") == {60, 61, 62, 63}
    assert cpu_list("0,2,4-6") == {0, 2, 4, 5, 6} and cpu_list(" 7 ") == {7}
    for bad in ("3-1", "a", "1,,2", "-1", "1-", "0-70000"):
        with pytest.raises(ValueError, match="daemon_cpus is a CPU list"):
            Config(daemon_cpus=bad)
    assert DaemonConfig(cpus="2-3").to_args()[-2:] == ["--cpus", "2-3"]
    with pytest.raises(ValueError, match=r"cpus \(--cpus\) is a CPU list"):
        DaemonConfig(cpus="x")
