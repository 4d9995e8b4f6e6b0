"""The concurrency benchmark's replay arms end to end (scripts/bench_concurrency.py): real
servers, the plain run recorded, the replay file written, replay arms that emit exactly the
plain run's tokens (float64), and a summary with the figures docs/benchmarks.md describes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from scripts import bench_concurrency  # noqa: E402


def test_replay_arms_give_the_plain_tokens(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    assert bench_concurrency.main([
        "--proposer", "replay", "--arms", "adaptive@2,off", "--pairs", "1",
        "--essay-tokens", "16", "--coding-tokens", "6", "--file-bytes", "200,300",
        "--set", 'model.dtype="float64"', "--dram-gbs", "80.5",
        "--out-dir", str(out), "--work-dir", str(work)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arms"] == ["off", "adaptive@2"]  # off first: it records
    assert (summary["dram_gbs"], summary["dram_source"]) == (80.5, "--dram-gbs")
    assert summary["model"] == "tandem-tiny" and summary["gpu_budget_gb"] is None
    assert summary["machine"]["cores"] >= 1 and summary["runs"] == 4
    assert summary["skipped"] == [] and "summarized_on" not in summary
    for name, turns in (("essay", 4), ("coding", 24)):
        replay = json.loads((work / f"replay_{name}.json").read_text())
        assert replay["workload"] == name and replay["source"] == "mtp"
        assert len(replay["records"]) == turns + 4  # and the four warm-up requests
        for arm in ("off", "adaptive@2"):
            run = json.loads((out / f"{name}_{arm}_1.json").read_text())
            assert run["exact"] == {"requests": turns + 4, "equal": turns + 4, "differ": 0,
                                    "unknown": 0}, (name, arm)
            assert run["turns"] == turns and run["steps"]["steps"] > 0
            assert run["steps"]["dram_gbs"] == 80.5  # the CPU floor's rate as given
            assert run["server_start_s"] > 0 and run["run_s"] > 0 and run["server_stop_s"] >= 0
            if arm != "off":
                assert run["drafts"]["mtp"]["accepted_per_verify"] > 0, (name, arm)
                budget = run["budget"]  # the adaptive budget's estimates and choices
                assert budget["figures"]["fixed_ms"] > 0 and budget["figures"]["persistence"] >= 0
                assert budget["figures"]["effective_experts"] >= 0, budget  # (no CPU experts)
                # what its choices predicted for the plain lengths, over the chosen one's
                assert 0 < budget["figures"]["uniform_1"] <= 1 / 0.995 + 1e-9, budget
                assert sum(budget["drafts_chosen"].values()) > 0
                assert set(budget["drafts_chosen"]) <= {"0", "1", "2"}, budget  # adaptive@2
            else:
                assert run["budget"] is None
            if run["four_stream_decode_tps"]:  # the decode windows' own steps were counted
                four = run["steps"]["four_stream"]
                assert four["steps"] > 0 and four["tokens_per_step"] >= 4, (name, arm, four)
                # the step's parts: the daemon's share, the worker's round trip and passes
                assert four["step_ms"] > four["worker_ms"] >= four["forward_ms"] > 0, four
                assert four["daemon_ms"] == pytest.approx(four["step_ms"] - four["worker_ms"])
            hits = run["prefix_cache_hits"]  # no host tier here
            assert hits["host"] == 0 and (hits["gpu"] > 0) == (run["prompt_cached_tokens"] > 0)
            if name == "coding":  # later turns start from their history's checkpoint
                assert hits["gpu"] > 0, (arm, hits)
        entry = summary["by_workload"][name]
        assert entry["tokens_equal_plain"] == {"off": [True], "adaptive@2": [True]}
        assert set(entry["four_stream_decode_tps_pair_ratios"]) == {"adaptive@2"}


def _synthetic(tmp_path, max_context: int) -> list[str]:
    """A tiny synthetic Qwen3-Next (16 experts, top-4) on NumPy in float64, under a GPU
    budget that mode off alone would spend on 6 experts per layer: the bench's options."""
    from gpu_worker.memory_plan import plan_memory  # noqa: PLC0415
    from gpu_worker.model_config import ModelConfig  # noqa: PLC0415
    from scripts.tiny_model import DEFAULT_SIZES, build_config  # noqa: PLC0415

    raw = build_config("qwen3_next", {**DEFAULT_SIZES, "experts": 16, "topk": 4,
                                      "vocab": 1024}, "bfloat16", [1023])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    plan = plan_memory(ModelConfig.from_dict({**raw, "mtp_num_hidden_layers": 1}),
                       dtype="float64", backend="numpy", max_context=max_context,
                       prefix_cache_mb=1024, placement="split", cpu_workers=1,
                       host_available_bytes=None)
    per_n = len(plan.moe_layers) * plan.gpu_bytes_per_expert
    budget = (plan.gpu_fixed_bytes + 6.5 * per_n) / 2**30  # 6 per layer with mode off
    return ["--model", str(tmp_path / "config.json"), "--gpu-budget", f"{budget:.6f}",
            "--max-context", str(max_context), "--set", 'model.backend="numpy"',
            "--set", 'model.dtype="float64"', "--set", "experts.cpu_workers=1",
            "--proposer", "replay", "--pairs", "1", "--time-budget", "600",
            "--out-dir", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]


@pytest.mark.slow
def test_a_synthetic_model_under_a_budget_gives_the_plain_tokens_in_every_arm(tmp_path, capsys):
    """The H200 command's path (--model, a GPU budget, split placement, CPU experts) on a
    tiny synthetic Qwen3-Next on NumPy: the arms share one placement (the memory plan of
    mode off alone would keep more experts on the GPU) and every request routes by its
    stream's ``user`` (a synthetic model's routing key), so the replay arms give the plain
    tokens and draft."""
    out, work = tmp_path / "out", tmp_path / "work"
    assert bench_concurrency.main(_synthetic(tmp_path, 1024) + [
        "--arms", "off,narrow,wide", "--workloads", "essay", "--essay-tokens", "48"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    pinned = summary["cpu_experts_per_layer"]
    assert 10 < pinned < 16 and summary["skipped"] == []  # mode off alone: 10 on the CPU
    for arm in ("off", "narrow", "wide"):
        run = json.loads((out / f"essay_{arm}_1.json").read_text())
        assert run["exact"]["equal"] == run["exact"]["requests"] == 8, arm
        assert f"{16 - pinned} of 16 on the GPU" in (work / f"essay_{arm}_1.log").read_text()
        if arm != "off":
            assert run["drafts"]["mtp"]["verifies"] >= 8, arm  # drafts all the way
    # a run whose tokens were not plain decoding's fails the command (exit status 1): the
    # same call resumed, with one request of the wide run's made to differ
    wide = json.loads((out / "essay_wide_1.json").read_text())
    wide["exact"] |= {"equal": 7, "differ": 1}
    (out / "essay_wide_1.json").write_text(json.dumps(wide))
    assert bench_concurrency.main(_synthetic(tmp_path, 1024) + [
        "--arms", "off,narrow,wide", "--workloads", "essay", "--essay-tokens", "48",
        "--resume"]) == 1
    assert "not plain decoding's tokens: essay wide pair 1" in capsys.readouterr().out
    # the replay file says which split its tokens were recorded on, and a later call whose
    # arms alone would pin another (mode off alone: 10 on the CPU, other tokens) runs on it
    replay = json.loads((work / "replay_essay.json").read_text())
    assert replay["recorded_with"] == {"cpu_experts_per_layer": pinned}
    again = tmp_path / "again"
    assert bench_concurrency.main(_synthetic(tmp_path, 1024) + [
        "--arms", "off", "--workloads", "essay", "--essay-tokens", "48",
        "--out-dir", str(again)]) == 0
    run = json.loads((again / "essay_off_1.json").read_text())
    assert run["cpu_experts_per_layer"] == pinned and run["exact"]["equal"] == 8
    assert f"{16 - pinned} of 16 on the GPU" in (work / "essay_off_1.log").read_text()
    # a split fixed otherwise: refused before any server
    with pytest.raises(SystemExit, match=f"recorded with {pinned} CPU experts a layer"):
        bench_concurrency.main(_synthetic(tmp_path, 1024) + [
            "--arms", "off", "--workloads", "essay", "--out-dir", str(tmp_path / "no"),
            "--set", f"experts.cpu_experts_per_layer={pinned - 1}"])
    assert not (tmp_path / "no").exists() or not list((tmp_path / "no").glob("*.json"))


@pytest.mark.slow
def test_a_synthetic_models_coding_turns_give_the_plain_tokens_in_any_slot(tmp_path):
    """The coding workload on the synthetic model: a later turn takes whichever slot is free,
    and routes by its agent's ``user`` all the same, so every turn of the replay arm gives
    the plain run's tokens and takes its drafts (routed by slot, some turns differed and the
    turns after them were unknown: 6 of 28 equal)."""
    out = tmp_path / "out"
    assert bench_concurrency.main(_synthetic(tmp_path, 4096) + [
        "--arms", "off,wide", "--workloads", "coding", "--coding-tokens", "8",
        "--file-bytes", "200,300"]) == 0
    for arm in ("off", "wide"):
        run = json.loads((out / f"coding_{arm}_1.json").read_text())
        assert run["exact"] == {"requests": 28, "equal": 28, "differ": 0, "unknown": 0}, arm
        # each agent's turns: prompt tokens and, from the second turn, its history cached
        turns = run["turn_prompts"]
        assert len(turns) == 4 and all(len(t) == 6 for t in turns), arm
        assert all(t[0][1] == 0 and all(c > 0 for _, c in t[1:]) for t in turns), (arm, turns)
        assert sum(c for t in turns for _, c in t) == run["prompt_cached_tokens"], arm
    assert run["drafts"]["mtp"]["accepted_per_verify"] > 1.2
