"""scripts/profile_step.py --summarize: Nsight Compute's CSV into per-layout kernel totals."""

from __future__ import annotations

import pytest

from scripts.profile_step import main, summarize

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
        '"Metric Value"')


def _row(i: int, kernel: str, metric: str, unit: str, value: str) -> str:
    return (f'"{i}","1","python3","h","{kernel}","1","7","(256, 1, 1)","(4, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def _csv(tmp_path, rows: list[str]):
    path = tmp_path / "ncu.csv"
    path.write_text("\n".join(["==PROF== Connected to process 1", HEAD, *rows]) + "\n")
    return path


def test_totals_per_layout_with_units_and_read_rates(tmp_path):
    t, b = "gpu__time_duration.sum", "dram__bytes_read.sum"
    path = _csv(tmp_path, [
        _row(0, "layout_1x1()", t, "nsecond", "1,024"),
        _row(1, "rowtile_bf16_r1(const float *, int)", t, "usecond", "12.5"),
        _row(1, "rowtile_bf16_r1(const float *, int)", b, "Mbyte", "25"),
        _row(2, "rowtile_bf16_r1(const float *, int)", t, "nsecond", "2,500"),
        _row(3, "paged_attn_f32(const float *)", t, "msecond", "0.5"),
        _row(4, "layout_4x4()", t, "nsecond", "900"),
        _row(5, "gdn_recurrent", t, "usecond", "3"),
        _row(5, "gdn_recurrent", b, "Kbyte", "300"),
    ])
    got = summarize(path)["layouts"]
    assert list(got) == ["1x1", "4x4"]  # the markers split the layouts and are not counted
    one = got["1x1"]
    assert one["launches"] == 3 and one["kernel_us"] == pytest.approx(515.0)
    by = {k["kernel"]: k for k in one["kernels"]}
    assert [k["kernel"] for k in one["kernels"]] == ["paged_attn_f32", "rowtile_bf16_r1"]
    assert by["rowtile_bf16_r1"]["launches"] == 2 and by["rowtile_bf16_r1"]["us"] == 15.0
    assert by["rowtile_bf16_r1"]["dram_gbs"] == pytest.approx(25e6 / 15.0 / 1e3, rel=1e-3)
    assert by["paged_attn_f32"]["share"] == pytest.approx(500 / 515, abs=1e-4)
    four = got["4x4"]
    assert four["launches"] == 1 and four["kernels"][0]["dram_gbs"] == 100.0


def test_kernels_before_any_marker_go_to_an_unnamed_layout(tmp_path):
    path = _csv(tmp_path, [_row(0, "warm", "gpu__time_duration.sum", "usecond", "2")])
    assert summarize(path)["layouts"]["?"]["kernel_us"] == 2.0


def test_the_command_writes_the_summary(tmp_path, capsys):
    path = _csv(tmp_path, [_row(0, "layout_2x3()", "gpu__time_duration.sum", "usecond", "1"),
                           _row(1, "rms_norm_rows", "gpu__time_duration.sum", "usecond", "4")])
    out = tmp_path / "kernels.json"
    assert main(["--summarize", str(path), "--out", str(out)]) == 0
    assert '"2x3"' in out.read_text() and "rms_norm_rows" in capsys.readouterr().out
