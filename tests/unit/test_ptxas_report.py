"""scripts/ptxas_report.py reads ptxas's log into one line per kernel."""

from __future__ import annotations

from scripts.ptxas_report import parse

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'paged_attn_f32_m8' for 'sm_90'
ptxas info    : Function properties for paged_attn_f32_m8
    504 bytes stack frame, 652 bytes spill stores, 644 bytes spill loads
ptxas info    : Used 255 registers, used 0 barriers, 504 bytes cumulative stack size
ptxas info    : Compiling entry function 'rms_norm_rows' for 'sm_90'
ptxas info    : Function properties for rms_norm_rows
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 0 barriers
"""


def test_each_kernel_gets_its_registers_and_spills():
    got = parse(LOG)
    assert list(got) == ["paged_attn_f32_m8", "rms_norm_rows"]
    assert "652 bytes spill stores" in got["paged_attn_f32_m8"]
    assert "Used 255 registers" in got["paged_attn_f32_m8"]
    assert got["rms_norm_rows"].startswith("0 bytes stack frame") and "Used 96" in got[
        "rms_norm_rows"]
