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


def test_fused_norm_is_switched_and_off_by_default(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert "fused_norm" in KERNELS and not enabled("fused_norm")
    monkeypatch.setenv(ENV, "fused_norm")
    assert enabled("fused_norm") and not enabled("rowtile")


def test_an_unknown_name_is_refused():
    with pytest.raises(KeyError, match="unknown GPU kernel"):
        enabled("flash")


def test_fused_silu_is_switched_and_off_by_default(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert "fused_silu" in KERNELS and not enabled("fused_silu")
    monkeypatch.setenv(ENV, "fused_silu")
    assert enabled("fused_silu") and not enabled("fused_norm")
