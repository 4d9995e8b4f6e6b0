"""daemon.config: TOML -> validated frozen dataclasses, errors naming the key; the shipped
configs; `tandem check-config` and `serve` argument handling (daemon.cli, daemon.commands)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from daemon import cli, commands, lifecycle
from daemon.config import (
    DEFAULT_MODEL,
    REPO_ROOT,
    Config,
    ConfigError,
    ServerSection,
    load_config,
    summary,
)
from scripts.tiny_model import DEFAULT_SIZES, build_config
from tests.qwen3_next_80b import QWEN3_NEXT_80B

CONFIGS = REPO_ROOT / "configs"


def _write(tmp_path: Path, text: str) -> Path:
    file = tmp_path / "tandem.toml"
    file.write_text(text)
    return file


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    config = build_config("qwen3_next", DEFAULT_SIZES, "float32", [1, 2])
    (model / "config.json").write_text(json.dumps(config))
    return model


def _error(tmp_path: Path, text: str, overrides: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text), overrides)
    return str(info.value)


# ---- defaults and the shipped files -------------------------------------------------------------
def test_defaults_serve_the_tiny_model_on_numpy_and_loopback():
    config = load_config(None)
    assert config.model.path == DEFAULT_MODEL
    assert config.model.served_name == "tandem-tiny"
    assert (config.model.backend, config.model.dtype) == ("numpy", "float32")
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8000)
    assert config.server.is_loopback
    assert config.scheduler.max_slots == 4
    assert config.max_prompt_tokens == config.scheduler.max_context - 1
    assert config.server.zmq_endpoint == f"ipc://{config.server.run_dir}/client.sock"


def test_tiny_toml_equals_the_built_in_defaults():
    config = load_config(CONFIGS / "tiny.toml")
    assert config.source == (CONFIGS / "tiny.toml").resolve()
    assert dataclasses.replace(config, source=None) == load_config(None)


def test_qwen3_next_example_is_valid_given_its_model_and_key_file(tmp_path):
    keys = tmp_path / "api_keys"
    keys.write_text("# operators\nsk-0123456789abcdef\n\nsk-fedcba9876543210\n")
    config = load_config(CONFIGS / "qwen3-next-80b.toml",
                         {"model.path": tmp_path, "server.api_keys_file": keys})
    assert config.server.api_keys == ("sk-0123456789abcdef", "sk-fedcba9876543210")
    assert config.model.backend == "cupy"
    assert config.experts.placement == "split" and config.experts.num_cpu_workers == 2
    assert config.model.served_name == "qwen3-next-80b-a3b-instruct"
    assert config.max_prompt_tokens == 30000
    assert (config.experts.gpu_memory_gb, config.experts.cpu_experts_per_layer) == (32.0, 0)


def test_split_without_a_cpu_count_is_the_memory_plans_choice_given_a_budget(tmp_path):
    config = load_config(_write(tmp_path, '[experts]\nplacement = "split"\n'
                                          'gpu_memory_gb = 24\n'))
    assert config.experts.gpu_memory_gb == 24.0 and isinstance(config.experts.gpu_memory_gb, float)
    assert "experts per layer chosen by the memory plan; GPU budget 24 GiB" in \
        "\n".join(summary(config))
    assert lifecycle.worker_config(config).gpu_budget_bytes == 24 * 2**30


def test_qwen3_next_example_names_its_missing_model(tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.path: must be an existing model directory"):
        load_config(CONFIGS / "qwen3-next-80b.toml")


# ---- errors name the key ------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("[scheduler]\nmax_slots = 0\n", "scheduler.max_slots: must be >= 1, got 0"),
    ("[scheduler]\nmax_slots = true\n", "scheduler.max_slots: must be an integer, got True"),
    ("[scheduler]\nmax_slots = 2\nslots = 3\n", "scheduler.slots: unknown key"),
    ("[scheduler]\nkv_block_size = 48\n", "scheduler.kv_block_size: must be a power of two"),
    ("[scheduler]\npreemption = \"kill\"\n", "scheduler.preemption: must be one of 'swap', "
     "'recompute', got 'kill'"),
    ("[schedular]\nmax_slots = 2\n", "schedular: unknown section"),
    ("scheduler = 3\n", "scheduler: must be a table"),
    ("[model]\ndtype = \"float16\"\n", "model.dtype: must be one of 'float32', 'float64', "
     "'bfloat16'"),
    ("[model]\nbackend = \"torch\"\n", "model.backend: must be one of"),
    ("[model]\npath = \"nowhere\"\n", "model.path: must be an existing model directory"),
    ("[server]\nport = 70000\n", "server.port: must be <= 65535, got 70000"),
    ("[server]\nport = \"80\"\n", "server.port: must be an integer"),
    ("[server]\napi_keys = \"k\"\n", "server.api_keys: must be a list of non-empty strings"),
    ("[server]\napi_keys = [\"short\"]\n", "server.api_keys: each key must be >= 8"),
    ("[server]\nmax_body_bytes = 10\n", "server.max_body_bytes: must be >= 1024"),
    ("[server]\nshutdown_grace_s = -1\n", "server.shutdown_grace_s: must be >= 0"),
    ("[server]\nzmq_endpoint = \"udp://x\"\n", "server.zmq_endpoint: must start with ipc://"),
    ("[server]\nzmq_endpoint = \"tcp://0.0.0.0:5555\"\n", "server.zmq_curve_public_key: a "
     "tcp:// endpoint needs CURVE keys"),
    ("[server]\nzmq_endpoint = \"ipc:///" + "x" * 120 + "\"\n",
     "server.zmq_endpoint: ipc path must be <= 107 bytes"),
    ("[server]\napi_keys_file = \"missing-keys\"\n", "server.api_keys_file: cannot read"),
    ("[limits]\nmax_prompt_tokens = 0\n", "limits.max_prompt_tokens: must be >= 1, got 0"),
    ("[limits]\nmax_prompt_tokens = 4096\n", "limits.max_prompt_tokens: must be < "
     "scheduler.max_context (4096), got 4096"),
    ("[limits]\nrequest_timeout_s = -1\n", "limits.request_timeout_s: must be >= 0"),
    ("[limits]\nrequest_timeout_s = nan\n", "limits.request_timeout_s: must be a finite number"),
    ("[experts]\nplacement = \"split\"\n", "experts.cpu_experts_per_layer: must be >= 1 with "
     "placement = 'split'"),
    ("[experts]\nplacement = \"disk\"\n", "experts.placement: must be one of"),
    ("[experts]\ngpu_memory_gb = 0\n", "experts.gpu_memory_gb: must be > 0 (leave it out for "
     "the whole device), got 0"),
    ("[experts]\ngpu_memory_gb = -8.5\n", "experts.gpu_memory_gb: must be > 0"),
    ("[experts]\ngpu_memory_gb = \"32\"\n", "experts.gpu_memory_gb: must be a finite number"),
    ("[experts]\ngpu_memory_gb = inf\n", "experts.gpu_memory_gb: must be a finite number"),
    ("[experts]\ncpu_isa = \"sse9\"\n", "experts.cpu_isa: must be one of"),
    ("[experts]\ncpu_workers = 2\ncpu_cores = [[0, 1]]\n", "experts.cpu_cores: must have one "
     "list per worker (2)"),
    ("[experts]\ncpu_cores = [[0, 1], [1, 2]]\n", "experts.cpu_cores: a core must belong to one "
     "worker only"),
    ("[experts]\ncpu_cores = [[0, -1]]\n", "experts.cpu_cores: must be a list of non-empty"),
    ("[experts]\ncpu_cores = [[]]\n", "experts.cpu_cores: must be a list of non-empty"),
    ("[speculation]\nproposer = \"ngram\"\n", "speculation.proposer: must be one of"),
    ("[speculation]\nnum_drafts = 0\n", "speculation.num_drafts: must be >= 1"),
    ("[speculation]\nnum_drafts = 16\n", "speculation.num_drafts: must be <= 15"),
    ("[speculation]\nmin_match = 4\nmax_match = 3\n", "speculation.max_match: must be >= 4"),
    ("[speculation]\nmode = \"fast\"\n", "speculation.mode: must be one of 'off', 'narrow', "
     "'wide'"),
    ("[logging]\nlevel = \"verbose\"\n", "logging.level: must be one of"),
    ("[logging]\njson = \"yes\"\n", "logging.json: must be true or false"),
    ("[systemd]\nwatchdog = 1\n", "systemd.watchdog: must be true or false"),
    ("[model\n", "invalid TOML"),
])
def test_bad_values_name_the_key(tmp_path, text, message):
    assert message in _error(tmp_path, text)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.toml")


# ---- public addresses need keys -----------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.org"])
def test_public_host_without_keys_is_refused(tmp_path, host):
    message = _error(tmp_path, f'[server]\nhost = "{host}"\n')
    assert message.startswith("server.host:")
    assert "api_keys" in message and "allow_insecure_public" in message


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_hosts_need_no_keys(tmp_path, host):
    assert load_config(_write(tmp_path, f'[server]\nhost = "{host}"\n')).server.is_loopback


def test_public_host_with_keys_or_explicit_permission(tmp_path):
    keyed = load_config(_write(tmp_path, '[server]\nhost = "0.0.0.0"\n'
                                          'api_keys = ["sk-0123456789"]\n'))
    assert keyed.server.api_keys == ("sk-0123456789",)
    open_ = load_config(_write(tmp_path, '[server]\nhost = "0.0.0.0"\n'
                                         'allow_insecure_public = true\n'))
    assert not open_.server.is_loopback


def test_cli_host_override_is_checked_too(tmp_path):
    message = _error(tmp_path, "[server]\nport = 9000\n", {"server.host": "0.0.0.0"})
    assert message.startswith("server.host:")


# ---- overrides and paths ------------------------------------------------------------------------
def test_overrides_win_and_none_is_ignored(tmp_path):
    model = _model_dir(tmp_path)
    config = load_config(_write(tmp_path, "[server]\nport = 9000\n"),
                         {"server.port": 9100, "server.host": None, "model.path": model})
    assert config.server.port == 9100
    assert config.server.host == "127.0.0.1"
    assert config.model.path == model and config.model.served_name == "model"


def test_unknown_override_is_refused():
    with pytest.raises(ConfigError, match="^nope: unknown override"):
        load_config(None, {"nope": 1})
    with pytest.raises(ConfigError, match=r"^server\.nope: unknown key"):
        load_config(None, {"server.nope": 1})


def test_relative_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    _model_dir(tmp_path)
    (tmp_path / "keys").write_text("sk-0123456789\n")
    sub = tmp_path / "elsewhere"
    sub.mkdir()
    monkeypatch.chdir(sub)
    config = load_config(_write(tmp_path, '[model]\npath = "model"\n'
                                          '[server]\napi_keys_file = "keys"\n'
                                          'run_dir = "run"\n'))
    assert config.model.path == tmp_path / "model"
    assert config.server.run_dir == tmp_path / "run"
    assert config.server.zmq_endpoint == f"ipc://{tmp_path}/run/client.sock"


def test_run_dir_follows_systemd_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "sd"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert load_config(None).server.run_dir == tmp_path / "sd"
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    assert load_config(None).server.run_dir == tmp_path / "xdg" / "tandem"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert str(load_config(None).server.run_dir).startswith("/tmp/tandem-")


def test_sections_are_frozen_and_validate_directly():
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.server.port = 1  # type: ignore[misc]
    with pytest.raises(ConfigError, match="server.port"):
        ServerSection(port=-1)


# ---- commands -----------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    return cli.build_parser()


def test_check_config_ok_prints_a_summary(tmp_path, capsys):
    model = _model_dir(tmp_path)
    file = _write(tmp_path, f'[model]\npath = "{model}"\n[scheduler]\nmax_slots = 2\n')
    args = _parser().parse_args(["check-config", str(file)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK: {file}")
    assert "2 slots x 4096 tokens" in out and "http://127.0.0.1:8000" in out


def test_check_config_prints_the_memory_plan(tmp_path, capsys):
    model = _model_dir(tmp_path)
    file = _write(tmp_path, f'[model]\npath = "{model}"\n[experts]\nplacement = "split"\n'
                            'cpu_experts_per_layer = 3\n')
    args = _parser().parse_args(["check-config", str(file)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "memory plan (before any weight is read):" in out
    assert re.search(r"routed experts per layer: 5 of 8 on the GPU .*, 3 on the CPU", out)
    assert re.search(r"KV cache: [\d.]+ MiB, \d+ blocks of", out) and "host RAM:" in out


def _real_size_model(tmp_path: Path) -> Path:
    """A directory holding only the 80B's config.json: check-config reads nothing else."""
    model = tmp_path / "qwen3-next-80b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_NEXT_80B))
    return model


@pytest.mark.parametrize("gib, status, needle", [
    (512, 0, r"GPU total: 3\d\.\d GiB of 32\.0 GiB"), (16, 2, r"GiB of host RAM .* over the 16\.0"),
])
def test_check_config_plans_the_80b_from_its_config_alone(tmp_path, capsys, monkeypatch, gib,
                                                          status, needle):
    monkeypatch.setattr("gpu_worker.memory_parts.mem_available", lambda: gib * 2**30)
    text = (CONFIGS / "qwen3-next-80b.toml").read_text()
    text = text.replace('path = "/srv/models/Qwen3-Next-80B-A3B-Instruct"',
                        f'path = "{_real_size_model(tmp_path)}"')
    text = text.replace('api_keys_file = "/etc/tandem/api_keys"', "")
    args = _parser().parse_args(["check-config", str(_write(tmp_path, text))])
    assert args.func(args) == status
    captured = capsys.readouterr()
    out = captured.out
    assert re.search(needle, out if status == 0 else captured.err)
    assert re.search(r"routed experts per layer: \d\d of 512 on the GPU", out)
    assert "GPU budget 32.0 GiB" in out and "weights: bfloat16 on the GPU" in out


def test_check_config_refuses_a_plan_over_the_budget(tmp_path, capsys):
    file = _write(tmp_path, f'[model]\npath = "{_real_size_model(tmp_path)}"\n'
                            'backend = "cupy"\n[experts]\ngpu_memory_gb = 8\n')
    args = _parser().parse_args(["check-config", str(file)])
    assert args.func(args) == 2
    captured = capsys.readouterr()
    assert re.match(r"tandem: memory plan refused: needs 1\d\d\.\d GiB of GPU memory, "
                    r"1\d\d\.\d GiB over the 8\.0 GiB budget .*placement 'gpu' keeps all 512 "
                    r"experts of 48 layers", captured.err)
    assert "routed experts per layer: 512 of 512 on the GPU" in captured.out


def test_check_config_names_the_bad_key_and_exits_2(tmp_path, capsys):
    file = _write(tmp_path, "[scheduler]\nmax_slots = 0\n")
    args = _parser().parse_args(["check-config", str(file)])
    assert args.func(args) == 2
    assert "scheduler.max_slots: must be >= 1, got 0" in capsys.readouterr().err


def test_check_config_checks_the_model_config(tmp_path, capsys):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    file = _write(tmp_path, f'[model]\npath = "{empty}"\n')
    args = _parser().parse_args(["check-config", str(file)])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: config error: model.path:") and "config.json" in err


@pytest.mark.parametrize("text, message", [
    ("[scheduler]\nmax_context = 8192\n", "scheduler.max_context: must be <= the model's "
     "max_position_embeddings (4096), got 8192"),
    ("[experts]\nplacement = \"split\"\ncpu_experts_per_layer = 8\n",
     "experts.cpu_experts_per_layer: must be < the model's 8 experts per layer"),
])
def test_check_config_checks_the_config_against_the_model(tmp_path, capsys, text, message):
    model = _model_dir(tmp_path)
    file = _write(tmp_path, f'[model]\npath = "{model}"\n{text}')
    args = _parser().parse_args(["check-config", str(file)])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


def test_serve_flags_override_the_file(tmp_path):
    model = _model_dir(tmp_path)
    file = _write(tmp_path, '[server]\nport = 9000\nhost = "127.0.0.1"\n')
    args = _parser().parse_args(["serve", "--config", str(file), "--port", "9200",
                                 "--model", str(model), "--host", "::1"])
    config = commands.config_from_args(args)
    assert (config.server.host, config.server.port, config.model.path) == ("::1", 9200, model)
    assert args.func is commands.run_serve
    assert config.speculation.mode == "off"
    file = _write(tmp_path, '[speculation]\nmode = "narrow"\nnum_drafts = 6\nmin_match = 3\n')
    args = _parser().parse_args(["serve", "--config", str(file), "--model", str(model),
                                 "--speculation", "wide", "--proposer", "mtp"])
    spec = commands.config_from_args(args).speculation
    assert (spec.mode, spec.proposer, spec.num_drafts, spec.min_match, spec.max_match) == (
        "wide", "mtp", 6, 3, 8)


def test_serve_refuses_a_bad_config_before_starting(tmp_path, capsys):
    args = _parser().parse_args(["serve", "--host", "0.0.0.0"])
    assert args.func(args) == 2
    assert "server.host:" in capsys.readouterr().err


def test_unit_file_command_line_parses():
    unit = (CONFIGS / "tandem.service").read_text()
    exec_start = next(line.split("=", 1)[1] for line in unit.splitlines()
                      if line.startswith("ExecStart="))
    argv = shlex.split(exec_start)
    assert argv[0] == "tandem"
    args = _parser().parse_args(argv[1:])
    assert args.command == "serve" and args.config == Path("/etc/tandem/tandem.toml")


def test_check_config_as_a_process(tmp_path):
    file = _write(tmp_path, "[experts]\nplacement = \"split\"\n")
    code = ("import sys; from daemon import cli; a = cli.build_parser().parse_args(sys.argv[1:]); "
            "sys.exit(a.func(a))")
    proc = subprocess.run([sys.executable, "-c", code, "check-config", str(file)],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert proc.returncode == 2
    assert "experts.cpu_experts_per_layer" in proc.stderr


def test_the_summary_names_the_graph_warm_up_and_the_shard_cache(tmp_path):
    config = load_config(_write(tmp_path, '[model]\nbackend = "cupy"\n'
                                          'cuda_graph_warm_up = "decode"\n[experts]\n'
                                          'placement = "split"\ncpu_experts_per_layer = 2\n'
                                          f'shard_cache = "{tmp_path / "shards"}"\n'))
    text = "\n".join(summary(config))
    assert "CUDA graphs in capacity buckets, decode layouts captured at start-up" in text
    assert f"CPU expert shards kept in {tmp_path / 'shards'}" in text
    with pytest.raises(ConfigError, match="cuda_graph_warm_up"):
        load_config(_write(tmp_path, '[model]\ncuda_graph_warm_up = "some"\n'))
    with pytest.raises(ConfigError, match="cuda_graph_buckets"):
        load_config(_write(tmp_path, '[model]\ncuda_graph_buckets = "yes"\n'))
    with pytest.raises(ConfigError, match="cuda_graph_mtp"):
        load_config(_write(tmp_path, '[model]\ncuda_graph_mtp = 1\n'))
    exact = load_config(_write(tmp_path, '[model]\nbackend = "cupy"\n'
                                         'cuda_graph_buckets = false\n'))
    assert "CUDA graphs, all layouts" in "\n".join(summary(exact))
