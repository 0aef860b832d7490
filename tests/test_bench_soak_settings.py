"""The launcher's allocator and Ray settings for long simulations (memory sampled by ``experiments/bench/soak.py``)."""

from __future__ import annotations

from fedrec_flwr.launch import flwr_env


def test_flwr_env_caps_malloc_arenas_unless_the_user_set_them(monkeypatch, tmp_path):
    """``MALLOC_ARENA_MAX=2`` reaches every process of the run (SuperLink, simulation, Ray actors inherit it), and a
    value the user set is kept."""
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert flwr_env(tmp_path / "home")["MALLOC_ARENA_MAX"] == "2"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert flwr_env(tmp_path / "home")["MALLOC_ARENA_MAX"] == "8"


def test_flwr_env_raises_rays_inline_object_limit_unless_the_user_set_it(monkeypatch, tmp_path):
    """Ray inlines objects up to ``RAY_max_direct_call_object_size`` (100 KiB by default) in its RPC messages; the
    launcher raises it so the ML-100K model (0.44 MB) and a one-user train reply (104-116 KB) skip Ray's object store
    (1.22 -> 0.64 s per round for the bare app with the model, experiments/bench/results/measurements.md). A value
    the user set is kept."""
    from fedrec_flwr.launch import RAY_INLINE_BYTES, RAY_INLINE_ENV

    assert RAY_INLINE_ENV == "RAY_max_direct_call_object_size" and RAY_INLINE_BYTES >= 470_000
    monkeypatch.delenv(RAY_INLINE_ENV, raising=False)
    assert flwr_env(tmp_path / "home")[RAY_INLINE_ENV] == str(RAY_INLINE_BYTES)
    monkeypatch.setenv(RAY_INLINE_ENV, "102400")
    assert flwr_env(tmp_path / "home")[RAY_INLINE_ENV] == "102400"
