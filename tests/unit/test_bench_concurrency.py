"""The coding workload's tool harness (scripts/bench_concurrency.py) and its summary: what
the benchmark's agents see back must be right, or the workload measures nothing."""

from __future__ import annotations

import json

import pytest

bench = pytest.importorskip("scripts.bench_concurrency")

from scripts import bench_concurrency_workloads as workloads  # noqa: E402
from scripts.bench_concurrency_report import summarize  # noqa: E402
from scripts.bench_concurrency_tools import TOOLS, run_tool  # noqa: E402


def _call(tmp_path, name: str, **args) -> str:
    return run_tool(tmp_path, name, json.dumps(args))


def test_write_read_and_check_a_module(tmp_path):
    assert _call(tmp_path, "read_file", path="m.py") == "error: m.py does not exist"
    assert _call(tmp_path, "write_file", path="m.py", content="X = 1\n") == \
        "wrote 6 characters to m.py"
    assert _call(tmp_path, "read_file", path="m.py") == "X = 1\n"
    assert _call(tmp_path, "run_check", path="m.py") == "ok"
    _call(tmp_path, "write_file", path="m.py", content="def f(:\n")
    assert "SyntaxError" in _call(tmp_path, "run_check", path="m.py")
    _call(tmp_path, "write_file", path="m.py", content="raise ValueError('nope')\n")
    assert "ValueError: nope" in _call(tmp_path, "run_check", path="m.py")


def test_paths_stay_in_the_scratch_directory_and_bad_calls_answer_errors(tmp_path):
    (tmp_path / "inner").mkdir()
    _call(tmp_path / "inner", "write_file", path="../../escape.py", content="x")
    assert (tmp_path / "inner" / "escape.py").exists() and not (tmp_path / "escape.py").exists()
    assert run_tool(tmp_path, "read_file", "{not json").startswith("error: bad arguments")
    assert _call(tmp_path, "read_file").startswith("error: bad arguments")
    assert _call(tmp_path, "delete", path="m.py") == "error: no tool named 'delete'"


def test_summary_pairs_runs_by_pair_and_takes_medians():
    runs = [{"workload": "essay", "arm": arm, "pair": pair, "four_stream_decode_tps": tps,
             "whole_run_tps": (tps or 0.0) / 2}
            for arm, pair, tps in (("narrow", 1, 10.0), ("wide", 1, 15.0), ("narrow", 2, 20.0),
                                   ("wide", 2, 20.0), ("narrow", 3, 30.0), ("wide", 3, None))]
    s = summarize(runs, ["narrow", "wide"])["essay"]
    assert s["four_stream_decode_tps"] == {"narrow": 20.0, "wide": 17.5}
    assert s["four_stream_decode_tps_pair_ratios"] == {"wide": [1.5, 1.0]}
    assert s["whole_run_tps"]["narrow"] == 10.0


def test_project_files_are_deterministic_python_of_two_to_eight_kb():
    from scripts.bench_concurrency_tools import project_file

    sizes = []
    for seed in range(12):
        name, text = project_file(seed)
        assert (name, text) == project_file(seed)
        sizes.append(len(text.encode()))
        compile(text.rsplit("\ndef ", 1)[0], name, "exec")  # whole functions are valid Python
    assert min(sizes) >= 2048 and max(sizes) <= 8192 and len(set(sizes)) > 6


def test_scripted_agent_loop_calls_tools_and_grows_its_context():
    import asyncio

    seen: list[int] = []

    async def fake_chat(session, url, model, messages, max_tokens, seed, tools, user):
        seen.append(sum(len(m["content"]) for m in messages))
        assert tools == TOOLS and user == "agent-1"  # the stream's routing key, every turn
        return {"text": f"X_{seed} = {len(messages)}\n", "tool_calls": [], "tokens": 5,
                "prompt": (10 * len(messages), len(messages) - 2)}

    res = asyncio.run(workloads.agent_loop(None, "", "m", 1, 32, chat_fn=fake_chat))
    assert res["turns"] == res["tool_calls"] == 6 and res["tokens"] == 30
    assert res["turn_prompts"] == [[10 * n, n - 2] for n in range(2, 14, 2)]
    assert len(seen) == 6 and all(b > a for a, b in zip(seen, seen[1:], strict=False))
    assert seen[1] - seen[0] >= 2048  # the first tool result is a 2-8 kB file
    assert res["tool_chars"] >= 2 * 2048  # two reads, plus "wrote ..." and "ok"


def test_an_agent_loop_of_fewer_turns_takes_the_scripts_first_ones():
    import asyncio

    names: list[str] = []

    async def fake_chat(session, url, model, messages, max_tokens, seed, tools, user):
        if messages[-1]["role"] == "tool":
            names.append(messages[-2]["tool_calls"][0]["function"]["name"])
        return {"text": "X = 1\n", "tool_calls": [], "tokens": 3}

    res = asyncio.run(workloads.agent_loop(None, "", "m", 0, 8, chat_fn=fake_chat, turns=3))
    assert (res["turns"], res["tool_calls"], res["tokens"]) == (3, 3, 9)
    assert names == list(workloads.SCRIPT[:2])  # the third call's result: no turn left


def test_time_budget_skips_the_run_that_would_end_late_and_every_later_one():
    import argparse
    import time

    def run(seconds: float, workload: str = "essay", cached: bool = True) -> dict:
        return {"workload": workload, "seconds": seconds, "cached": cached}

    args = argparse.Namespace(time_budget=100.0)
    ctx = {"t0": time.monotonic() - 50, "durations": [], "skipped": []}
    assert bench.fits(args, ctx, "essay_off_1", "essay")  # nothing measured yet: it starts
    ctx["durations"] = [run(40.0)]
    assert bench.fits(args, ctx, "essay_narrow_1", "essay")  # 50 + 40 <= 100
    ctx["durations"] = [run(40.0), run(60.0)]
    assert not bench.fits(args, ctx, "essay_wide_1", "essay")  # 50 + 60 > 100
    ctx["durations"] = [run(1.0)]
    assert not bench.fits(args, ctx, "coding_off_1", "coding")  # later runs follow it
    assert ctx["skipped"] == ["essay_wide_1", "coding_off_1"]
    assert bench.fits(argparse.Namespace(time_budget=None), {"skipped": []}, "x")


def test_the_next_run_is_expected_to_last_as_its_workloads_cached_runs_did():
    import argparse
    import time

    def run(seconds: float, workload: str = "essay", cached: bool = True) -> dict:
        return {"workload": workload, "seconds": seconds, "cached": cached}

    quantized = [run(128.0, cached=False), run(31.0), run(35.0)]  # a fresh machine's first
    ctx = {"durations": quantized}
    assert bench.expected_seconds(ctx, "essay") == 35.0  # the quantizing start left out
    assert bench.expected_seconds(ctx, "coding") == 128.0  # no coding run yet: the longest
    ctx["durations"] = [*quantized, run(80.0, "coding")]
    assert bench.expected_seconds(ctx, "coding") == 80.0
    assert bench.expected_seconds({"durations": [run(50.0, cached=False)]}, "essay") == 50.0
    # a machine's first run quantized the shards, its server starting in 120 of its 160 s:
    # the next is taken to start as a kept-shards server does (CACHED_START_S until one did)
    first = {**run(160.0, cached=False), "start_s": 120.0}
    assert bench.expected_seconds({"durations": [first]}, "essay") == 40.0 + bench.CACHED_START_S
    kept = {**run(30.0, "coding"), "start_s": 20.0}
    assert bench.expected_seconds({"durations": [first, kept]}, "essay") == 60.0  # 40 + 20
    args = argparse.Namespace(time_budget=100.0)
    ctx = {"t0": time.monotonic() - 60, "durations": quantized, "skipped": []}
    assert bench.fits(args, ctx, "essay_wide_2", "essay")  # 60 + 35 <= 100 (not 60 + 128)


def test_summary_after_each_run_names_the_machine_the_runs_ran_on(tmp_path):
    from scripts.bench_concurrency_report import write_summary

    device = {"host": "h200", "cpu": "Xeon", "gpu": "NVIDIA H200", "git": "abc"}
    here = {"host": "vm", "cpu": "EPYC", "gpu": None, "git": "def"}
    for arm, tps in (("narrow", 10.0), ("wide", 16.0)):
        (tmp_path / f"essay_{arm}_1.json").write_text(json.dumps(
            {"workload": "essay", "arm": arm, "pair": 1, "four_stream_decode_tps": tps,
             "whole_run_tps": tps, "machine": device}))
    head = {"command": "c", "machine": here, "model": "m", "skipped": []}
    s = write_summary(tmp_path, head, ["essay", "coding"], ["narrow", "wide"], "narrow")
    assert json.loads((tmp_path / "summary.json").read_text()) == s
    assert s["machine"] == device and s["summarized_on"] == here and s["runs"] == 2
    assert s["by_workload"]["essay"]["four_stream_decode_tps_pair_ratios"] == {"wide": [1.6]}
    s = write_summary(tmp_path, {**head, "machine": device}, ["essay"], ["narrow", "wide"],
                      "narrow")
    assert s["machine"] == device and "summarized_on" not in s


def test_summary_gives_the_four_stream_steps_parts_where_runs_have_them():
    from scripts.bench_concurrency_report import summarize

    def run(arm: str, pair: int, four: dict) -> dict:
        return {"workload": "essay", "arm": arm, "pair": pair, "four_stream_decode_tps": 50.0,
                "whole_run_tps": 40.0, "steps": {"step_ms": 100.0, "four_stream": four}}

    parts = lambda d, w: {"step_ms": 100.0, "daemon_ms": d, "worker_ms": w,  # noqa: E731
                          "forward_ms": w - 2, "slot_routing_ms": 0.5}
    runs = [run("adaptive", 1, parts(6.0, 94.0)), run("adaptive", 2, parts(4.0, 96.0)),
            run("adaptive", 3, parts(5.0, 95.0)), run("wide@2", 1, {"step_ms": 90.0})]
    e = summarize(runs, ["adaptive", "wide@2"])["essay"]
    assert e["four_stream_daemon_ms"] == {"adaptive": 5.0, "wide@2": None}  # an older run
    assert e["four_stream_worker_ms"]["adaptive"] == 95.0
    assert e["four_stream_forward_ms"]["adaptive"] == 93.0
    assert e["four_stream_slot_routing_ms"]["adaptive"] == 0.5
    assert "daemon_ms" not in e and e["four_stream_step_ms"] == {"adaptive": 100.0,
                                                                 "wide@2": 90.0}


def test_streams_are_admitted_in_order_each_after_the_first_token_of_the_one_before():
    import asyncio

    log: list[str] = []

    async def stream(i: int, started: asyncio.Event) -> int:
        log.append(f"start {i}")
        await asyncio.sleep(0.01 * (4 - i))  # the prompt read: later streams read faster
        log.append(f"token {i}")
        started.set()
        await asyncio.sleep(0.3)
        log.append(f"end {i}")
        return i

    async def fails(started: asyncio.Event) -> int:  # no token at all: the next still starts
        log.append("start x")
        return -1

    starts = [lambda started, i=i: stream(i, started) for i in range(3)] + [fails]
    assert asyncio.run(workloads.in_order(starts)) == [0, 1, 2, -1]
    assert log[:6] == ["start 0", "token 0", "start 1", "token 1", "start 2", "token 2"]
    assert log.index("start x") < log.index("end 0")  # concurrent, not one after another


def test_a_stopped_servers_shared_files_are_removed_and_no_others():
    from pathlib import Path

    from cpu_experts.rings import shm_dir
    from scripts.bench_concurrency_serve import drop_shared_files

    mine = Path(shm_dir()) / "tandem-experts0-999999991-ab12cd34"
    other = Path(shm_dir()) / "tandem-experts0-9999999910-ab12cd34"  # another pid
    try:
        mine.write_bytes(b"x")
        other.write_bytes(b"x")
        drop_shared_files([999999991])
        assert not mine.exists() and other.exists()
    finally:
        mine.unlink(missing_ok=True)
        other.unlink(missing_ok=True)


def test_a_runs_start_facts_come_from_the_workers_log_lines(tmp_path, capsys):
    """The worker's own log lines (gpu_worker/server.py _log) among the daemon's: the CUDA
    graphs captured at start-up and whether the CPU experts came from the shard cache."""
    from gpu_worker.server import _log  # noqa: PLC0415
    from scripts.bench_concurrency_serve import start_facts  # noqa: PLC0415

    _log("load plan", bytes=10, cpu_shards_cached=True)
    _log("cuda graphs", enabled=True, active=True, reason="decode and verify passes",
         warm_up="all", buckets=True, graphs=25, refused=0, layouts=25, seconds=12.5,
         device_free_gib=9.1)
    log = tmp_path / "run.log"
    log.write_text("loading weights 40%\n" + capsys.readouterr().err
                   + '{"event": "server ready", "logger": "tandem"}\n{broken\n')
    assert start_facts(log) == {"cpu_shards_cached": True, "graph_warm_up": {
        "active": True, "warm_up": "all", "buckets": True, "layouts": 25, "graphs": 25,
        "refused": 0, "seconds": 12.5, "device_free_gib": 9.1}}
    assert start_facts(tmp_path / "missing.log") == {}


def test_summary_gives_the_four_stream_figure_at_a_common_cost_per_cpu_expert():
    from scripts.bench_concurrency_report import best_fixed, summarize

    def run(arm: str, pair: int, tokens: float, experts: float, rest: float, per_expert: float,
            ) -> dict:
        kernel = experts * per_expert
        step = rest + kernel
        return {"workload": "essay", "arm": arm, "pair": pair, "whole_run_tps": 40.0,
                "four_stream_decode_tps": 1e3 * tokens / step,
                "steps": {"step_ms": step, "four_stream": {
                    "tokens_per_step": tokens, "cpu_experts_per_step": experts,
                    "step_ms": step, "cpu_kernel_ms": kernel}}}

    # the same two arms on a machine whose memory speed moves from run to run: measured,
    # adaptive looks 1.25x wide@2 (its runs had the fast memory); at a common cost per
    # expert, what the arms chose: adaptive 3 % fewer tokens per CPU expert, 2 ms more
    runs = [run("adaptive", p, 13.0, 4500, 19.0, c) for p, c in ((1, 0.032), (2, 0.034))]
    runs += [run("wide@2", p, 10.9, 3660, 17.0, c) for p, c in ((1, 0.046), (2, 0.048))]
    e = summarize(runs, ["adaptive", "wide@2"])["essay"]
    assert e["common_expert_ms"] == pytest.approx(0.04)
    at = e["four_stream_tps_at_common_expert_cost"]
    assert at["adaptive"] == pytest.approx(1e3 * 13.0 / (19.0 + 4500 * 0.04))
    assert at["wide@2"] == pytest.approx(1e3 * 10.9 / (17.0 + 3660 * 0.04))
    got = best_fixed(e, ["adaptive", "wide@2"])
    assert got["adaptive"]["adaptive"] > 1.2
    assert got["at_common_expert_cost"]["adaptive"]["adaptive"] == pytest.approx(
        at["adaptive"] / at["wide@2"], abs=1e-3)
    assert got["at_common_expert_cost"]["adaptive"]["adaptive"] < 1.0
    assert "four_stream_tps_at_common_cost_expected_acceptance" not in e  # no run traced
    # the replay's luck: wide@2's draws accepted 3 % more than the rate, adaptive's 1 %:
    # at the expected acceptance adaptive's choices are ahead
    for r in runs:
        r["acceptance_luck"] = {"luck": 1.01 if r["arm"] == "adaptive" else 1.03}
    old = [dict(run("wide@3", 1, 13.2, 4560, 17.5, 0.04))]  # an arm run before the traces
    e = summarize(runs + old, ["adaptive", "wide@2", "wide@3"])["essay"]
    even = e["four_stream_tps_at_common_cost_expected_acceptance"]
    assert even["adaptive"] == pytest.approx(e["four_stream_tps_at_common_expert_cost"][
        "adaptive"] / 1.01)
    assert even["wide@2"] == pytest.approx(e["four_stream_tps_at_common_expert_cost"][
        "wide@2"] / 1.03)
    assert even["wide@3"] is None and e["acceptance_luck"]["wide@3"] is None
    got = best_fixed(e, ["adaptive", "wide@2", "wide@3"])
    assert got["at_common_cost_expected_acceptance"]["best_fixed_arm"] == "wide@2"
    # an arm's variant (other config keys) is not among the arms compared
    twin = {**e["four_stream_decode_tps"], "wide@2+nopin": 1e6, "adaptive+nopin": 1e-6}
    twins = best_fixed({**e, "four_stream_decode_tps": twin},
                       ["adaptive", "wide@2", "wide@3", "adaptive+nopin", "wide@2+nopin"])
    assert twins["best_fixed_arm"] == got["best_fixed_arm"] != "wide@2+nopin"
    assert set(twins["adaptive"]) == {"adaptive"}
    assert got["at_common_cost_expected_acceptance"]["adaptive"]["adaptive"] == pytest.approx(
        even["adaptive"] / even["wide@2"], abs=1e-3)


def _replay(path, split):
    data = {"workload": "essay", "source": "mtp", "profile": {}, "records": []}
    if split is not None:
        data["recorded_with"] = {"cpu_experts_per_layer": split}
    path.write_text(json.dumps(data))
    return path


def test_a_replay_files_split_is_kept_where_the_arms_fit_and_refused_otherwise(tmp_path, capsys):
    from scripts.bench_concurrency_arms import replay_split  # noqa: PLC0415

    a, b = _replay(tmp_path / "a.json", 467), _replay(tmp_path / "b.json", 467)
    cfg = {"experts": {"cpu_experts_per_layer": 465}}  # the arms' plans pinned 465
    assert replay_split(cfg, [a, b, tmp_path / "absent.json"], 465) == 467
    assert cfg["experts"]["cpu_experts_per_layer"] == 467
    cfg = {"experts": {"cpu_experts_per_layer": 469}}  # the arms need more on the CPU
    with pytest.raises(SystemExit, match="recorded with 467 .* need at least 469"):
        replay_split(cfg, [a], 469)
    assert cfg["experts"]["cpu_experts_per_layer"] == 469
    with pytest.raises(SystemExit, match="different splits"):
        replay_split({"experts": {}}, [a, _replay(tmp_path / "c.json", 465)], 465)
    cfg = {"experts": {"cpu_experts_per_layer": 460}}  # fixed by the config (no pin)
    with pytest.raises(SystemExit, match=r"have 460 \(fixed by the config\)"):
        replay_split(cfg, [a], None)
    assert replay_split({"experts": {"cpu_experts_per_layer": 467}}, [a], None) == 467
    # an older file without it: the split as it is, and a line saying what that assumes
    old = _replay(tmp_path / "old.json", None)
    assert replay_split({"experts": {"cpu_experts_per_layer": 465}}, [old], 465) == 465
    assert "no recorded split" in capsys.readouterr().out
    assert replay_split({"experts": {}}, [old], None) is None  # neither has a split: silent
    assert capsys.readouterr().out == ""
    with pytest.raises(SystemExit, match=r"have no split \(no GPU budget\)"):
        replay_split({"experts": {}}, [a], None)


def test_a_replay_file_keeps_what_it_was_recorded_with(tmp_path):
    from daemon.proposers.replay import ReplayProposer, write_replay_file  # noqa: PLC0415

    records = [{"prompt_ids": [1, 2, 3], "continuation": [4, 5]}]
    path = tmp_path / "r.json"
    write_replay_file(path, records, workload="essay", source="mtp",
                      profile={"workloads": {"essay": {"mtp": {"p": 0.5}}}},
                      recorded_with={"cpu_experts_per_layer": 7})
    assert json.loads(path.read_text())["recorded_with"] == {"cpu_experts_per_layer": 7}
    assert ReplayProposer.load(path).records  # the proposer reads it as before
    write_replay_file(path, records, workload="essay", source="mtp", profile={})
    assert "recorded_with" not in json.loads(path.read_text())


def test_a_pair_split_over_two_machines_is_no_pair_and_the_summary_says_who_ran_what(tmp_path):
    from scripts.bench_common import boot_id
    from scripts.bench_concurrency_report import write_summary

    one, two = ({"host": "vm", "cpu": "Xeon", "gpu": "NVIDIA H100", "boot_id": b}
                for b in ("b-1", "b-2"))
    rows = [("narrow", 1, 10.0, one), ("wide", 1, 15.0, one), ("narrow", 2, 12.0, two),
            ("wide", 2, 13.0, one), ("narrow", 3, 11.0, two), ("wide", 3, 14.3, two)]
    for arm, pair, tps, where in rows:
        (tmp_path / f"essay_{arm}_{pair}.json").write_text(json.dumps(
            {"workload": "essay", "arm": arm, "pair": pair, "four_stream_decode_tps": tps,
             "whole_run_tps": tps / 5, "machine": where}))
    head = {"command": "c", "machine": two, "model": "m", "skipped": []}
    s = write_summary(tmp_path, head, ["essay"], ["narrow", "wide"], "narrow")
    e = s["by_workload"]["essay"]
    assert e["four_stream_decode_tps_pair_ratios"] == {"wide": [1.5, 1.3]}  # pairs 1 and 3
    assert e["whole_run_tps_pair_ratios"] == {"wide": [1.5, 1.3]}
    assert e["pairs_across_machines"] == {"wide": [2]}
    assert s["runs_by_machine"] == [
        {"machine": one, "runs": ["essay_narrow_1", "essay_wide_1", "essay_wide_2"]},
        {"machine": two, "runs": ["essay_narrow_2", "essay_narrow_3", "essay_wide_3"]}]
    assert s["machine"] == two and "summarized_on" not in s
    # a run from before the boot id was recorded (an earlier session's) pairs with no later one
    old = json.loads((tmp_path / "essay_narrow_1.json").read_text())
    old["machine"].pop("boot_id")
    (tmp_path / "essay_narrow_1.json").write_text(json.dumps(old))
    e = write_summary(tmp_path, head, ["essay"], ["narrow", "wide"], "narrow")["by_workload"]
    assert e["essay"]["four_stream_decode_tps_pair_ratios"] == {"wide": [1.3]}
    assert e["essay"]["pairs_across_machines"] == {"wide": [1, 2]}
    # runs all from before the boot id was recorded pair as they did; one machine says no more
    for f in tmp_path.glob("essay_*.json"):
        run = json.loads(f.read_text())
        run["machine"] = {k: v for k, v in run["machine"].items() if k != "boot_id"}
        f.write_text(json.dumps(run))
    s = write_summary(tmp_path, head, ["essay"], ["narrow", "wide"], "narrow")
    e = s["by_workload"]["essay"]
    assert e["four_stream_decode_tps_pair_ratios"] == {"wide": [1.5, 1.083, 1.3]}
    assert "pairs_across_machines" not in e and "runs_by_machine" not in s
    # (they cannot say they ran on this machine: as if summarized elsewhere)
    assert s["machine"] == {"host": "vm", "cpu": "Xeon", "gpu": "NVIDIA H100"}
    assert s["summarized_on"] == two
    # ... and stand for their machines by the tree they ran: two trees, two machines
    for f in tmp_path.glob("essay_*.json"):
        run = json.loads(f.read_text())
        run["machine"]["git"] = "b" if f.stem == "essay_narrow_2" else "a"
        f.write_text(json.dumps(run))
    e = write_summary(tmp_path, head, ["essay"], ["narrow", "wide"], "narrow")["by_workload"]
    assert e["essay"]["pairs_across_machines"] == {"wide": [2]}
    (tmp_path / "boot_id").write_text("1234-abcd\n")
    assert boot_id(tmp_path / "boot_id") == "1234-abcd"
    assert boot_id(tmp_path / "missing") is None
