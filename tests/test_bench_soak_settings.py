"""The launcher's allocator setting for long simulations (issue 17's memory item, ``experiments/bench/soak.py``)."""

from __future__ import annotations

from fedrec_flwr.launch import flwr_env


def test_flwr_env_caps_malloc_arenas_unless_the_user_set_them(monkeypatch, tmp_path):
    """``MALLOC_ARENA_MAX=2`` reaches every process of the run (SuperLink, simulation, Ray actors inherit it), and a
    value the user set is kept."""
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert flwr_env(tmp_path / "home")["MALLOC_ARENA_MAX"] == "2"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert flwr_env(tmp_path / "home")["MALLOC_ARENA_MAX"] == "8"
