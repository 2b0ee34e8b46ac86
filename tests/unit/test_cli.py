import subprocess
import sys
from pathlib import Path

KUBEMOE = Path(sys.executable).parent / "kubemoe"  # the console script installed beside this Python


def kubemoe(*args):
    return subprocess.run([KUBEMOE, *args], capture_output=True, text=True)


def test_help_lists_the_subcommands():
    result = kubemoe("--help")
    assert result.returncode == 0
    assert "checkpoint" in result.stdout


def test_make_inspect_verify(tmp_path):
    out = tmp_path / "ckpt"
    made = kubemoe("checkpoint", "make", "--arch", "deepseek_v3", "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert "wrote deepseek_v3/tiny checkpoint" in made.stdout
    inspected = kubemoe("checkpoint", "inspect", str(out))
    assert "moe layers: 1,2" in inspected.stdout and "experts per layer: 16" in inspected.stdout
    verified = kubemoe("checkpoint", "verify", str(out))
    assert verified.returncode == 0 and verified.stdout.rstrip().endswith("OK"), verified.stdout + verified.stderr


def test_errors_are_one_line_not_a_traceback(tmp_path):
    for args in (["checkpoint", "inspect", str(tmp_path)], ["checkpoint", "make", "--arch", "mixtral", "--preset", "huge", "--out", str(tmp_path)]):
        result = kubemoe(*args)
        assert result.returncode != 0
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "kubemoe checkpoint make" in kubemoe("checkpoint", "inspect", str(tmp_path)).stderr
    assert "mixtral-4l" in kubemoe("checkpoint", "make", "--arch", "mixtral", "--preset", "huge", "--out", str(tmp_path)).stderr


def test_every_frontend_option_reaches_the_config_under_its_own_name(tmp_path):
    """The options are handed over by name (frontend/cli.config_fields): a flag that changed nothing
    would show here."""
    from kubemoe.frontend.cli import frontend_command, frontend_config

    (tmp_path / "routing.json").write_text("{}")
    args = ["--checkpoint", str(tmp_path), "--routing-table", str(tmp_path / "routing.json"), "--no-lookahead",
            "--no-cuda-graphs", "--max-batch", "7", "--kv-cache-bytes", "1Mi", "--split-min-tokens", "5",
            "--busy-poll-us", "3", "--device", "cpu", "--compile"]
    params = frontend_command.make_context("frontend", list(args)).params  # click empties the list it parses
    config = frontend_config(**{k: v for k, v in params.items() if k not in ("host", "port", "grpc_port")})
    assert (config.lookahead, config.cuda_graphs, config.max_batch, config.kv_cache_bytes) == (False, False, 7, 1 << 20)
    assert (config.split_min_tokens, config.busy_poll_us, config.device, config.offload) == (5, 3.0, "cpu", None)
    assert config.compile
    defaults = frontend_config(**{k: v for k, v in frontend_command.make_context(
        "frontend", args[:4]).params.items() if k not in ("host", "port", "grpc_port")})
    assert defaults.lookahead and defaults.cuda_graphs and not defaults.compile


def test_the_frontend_commands_load_no_torch_before_their_body():
    """Offload mode sets OpenMP's idle policy in the command's body (OpenMP reads it once, when torch loads):
    a torch import at the top of the command line's modules would make that setting do nothing."""
    loaded = subprocess.run([sys.executable, "-c", "import sys, kubemoe.cli, kubemoe.frontend.cli; "
                             "print('torch' in sys.modules)"], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False"


def test_offload_mode_puts_idle_openmp_threads_to_sleep_unless_the_environment_chose(monkeypatch):
    import os

    from click.testing import CliRunner

    from kubemoe.frontend.cli import frontend_command, serve_command

    def policy_after(command, args, environ):
        for name in ("OMP_WAIT_POLICY", "KUBEMOE_MODE"):
            monkeypatch.setenv(name, "")  # recorded, so the test's end restores what was there (or nothing)
            monkeypatch.delenv(name)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        result = CliRunner().invoke(command, args)  # stops at a usage error after setting it: no model is served
        assert result.exit_code == 2, result.output
        return os.environ.get("OMP_WAIT_POLICY")

    assert policy_after(frontend_command, ["--offload"], {}) == "PASSIVE"  # no --checkpoint
    assert policy_after(serve_command, ["--offload"], {}) == "PASSIVE"  # no --gpu-budget
    assert policy_after(frontend_command, ["--offload"], {"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
    assert policy_after(frontend_command, [], {}) is None  # distributed: no CPU experts beside the launches
    assert policy_after(frontend_command, [], {"KUBEMOE_MODE": "offload"}) == "PASSIVE"  # as the operator renders it
