"""The coding workload's tool harness (scripts/bench_concurrency.py) and its summary: what
the benchmark's agents see back must be right, or the workload measures nothing."""

from __future__ import annotations

import json

import pytest

bench = pytest.importorskip("scripts.bench_concurrency")


def _call(tmp_path, name: str, **args) -> str:
    return bench.run_tool(tmp_path, name, json.dumps(args))


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
    assert bench.run_tool(tmp_path, "read_file", "{not json").startswith("error: bad arguments")
    assert _call(tmp_path, "read_file").startswith("error: bad arguments")
    assert _call(tmp_path, "delete", path="m.py") == "error: no tool named 'delete'"


def test_summary_pairs_runs_by_pair_and_takes_medians():
    runs = [{"workload": "essay", "arm": arm, "pair": pair, "four_stream_decode_tps": tps,
             "whole_run_tps": (tps or 0.0) / 2}
            for arm, pair, tps in (("narrow", 1, 10.0), ("wide", 1, 15.0), ("narrow", 2, 20.0),
                                   ("wide", 2, 20.0), ("narrow", 3, 30.0), ("wide", 3, None))]
    s = bench.summarize(runs, ["narrow", "wide"])["essay"]
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

    async def fake_chat(session, url, model, messages, max_tokens, seed, tools):
        seen.append(sum(len(m["content"]) for m in messages))
        assert tools == bench.TOOLS
        return {"text": f"X_{seed} = {len(messages)}\n", "tool_calls": [], "tokens": 5}

    res = asyncio.run(bench.agent_loop(None, "", "m", 1, 32, chat_fn=fake_chat))
    assert res["turns"] == res["tool_calls"] == 6 and res["tokens"] == 30
    assert len(seen) == 6 and all(b > a for a, b in zip(seen, seen[1:], strict=False))
    assert seen[1] - seen[0] >= 2048  # the first tool result is a 2-8 kB file
    assert res["tool_chars"] >= 2 * 2048  # two reads, plus "wrote ..." and "ok"
