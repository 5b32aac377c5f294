"""ffstate/config.py: defaults, FFSTATE_* overrides, validation."""

import pytest

from ffstate import Config


def test_defaults_and_env_overrides(monkeypatch):
    assert Config().kernels == "auto" and Config().chunk_bytes == 1 << 20
    monkeypatch.setenv("FFSTATE_CHUNK_BYTES", "65536")
    monkeypatch.setenv("FFSTATE_KERNELS", "torch")
    cfg = Config.from_env(codec_threads=3)
    assert (cfg.chunk_bytes, cfg.kernels, cfg.codec_threads) == (65536, "torch", 3)


def test_bad_values_are_refused_with_the_variable_named(monkeypatch):
    monkeypatch.setenv("FFSTATE_CHUNK_BYTES", "lots")
    with pytest.raises(ValueError, match="FFSTATE_CHUNK_BYTES"):
        Config.from_env()
    with pytest.raises(ValueError, match="kernels"):
        Config(kernels="cuda")
