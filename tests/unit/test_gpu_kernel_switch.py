"""The switch that keeps unverified GPU kernels out of the model (gpu_worker/kernels/enabled.py)."""

from __future__ import annotations

import pytest

from gpu_worker.kernels.enabled import DEFAULT, ENV, KERNELS, enabled


def test_default_takes_only_the_verified_kernels(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert [k for k in KERNELS if enabled(k)] == [k for k in KERNELS if k in DEFAULT]


@pytest.mark.parametrize("raw, want", [("all", set(KERNELS)), ("none", set()),
                                       ("gdn, rowtile", {"gdn", "rowtile"}), ("", set())])
def test_the_environment_chooses(monkeypatch, raw, want):
    monkeypatch.setenv(ENV, raw)
    assert {k for k in KERNELS if enabled(k)} == want


def test_the_verified_kernels_are_on_by_default_and_each_can_be_taken_alone(monkeypatch):
    """All eight passed on the H200 and are on; each stays switchable on its own (to compare
    paths)."""
    monkeypatch.delenv(ENV, raising=False)
    assert [k for k in KERNELS if not enabled(k)] == []
    for name in KERNELS:
        monkeypatch.setenv(ENV, name)
        assert [k for k in KERNELS if enabled(k)] == [name]


def test_an_unknown_name_is_refused():
    with pytest.raises(KeyError, match="unknown GPU kernel"):
        enabled("flash")
