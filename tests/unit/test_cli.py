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
