"""`kubemoe serve`, the README's main command, as a user runs it: start, ask, Ctrl-C."""

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

KUBEMOE = Path(sys.executable).parent / "kubemoe"


def test_serve_answers_and_stops_cleanly_on_ctrl_c(tiny_checkpoint, tmp_path):
    proc = subprocess.Popen([KUBEMOE, "serve", "--checkpoint", str(tiny_checkpoint("qwen3_moe")), "--experts", "2",
                             "--port", "0", "--grpc-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    try:
        banner = proc.stdout.readline()
        match = re.search(r"serving (\S+) at (http://127\.0\.0\.1:\d+/v1)", banner)
        assert match, banner + proc.stderr.read()
        model, url = match.groups()
        assert proc.stdout.readline().startswith("try: curl ")
        # greedy: sampled at temperature 1, a random model's first token is its end token now and then
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8,
                           "temperature": 0})
        request = urllib.request.Request(f"{url}/chat/completions", body.encode(), {"Content-Type": "application/json"})
        answer = json.load(urllib.request.urlopen(request, timeout=60))
        assert answer["usage"]["completion_tokens"] >= 1
        loads = json.load(urllib.request.urlopen(url.removesuffix("/v1") + "/loads", timeout=10))
        assert int(loads["tokens"]) > 0 and loads["loads"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"kubemoe serve did not stop within 60 s of Ctrl-C: {err[-2000:]}") from None
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    leftover = subprocess.run(["pgrep", "-f", f"expert-fn --checkpoint {tiny_checkpoint('qwen3_moe')}"],
                              capture_output=True, text=True).stdout
    assert not leftover, f"expert functions left running: {leftover}"


def test_serve_offload_answers_with_a_budget_smaller_than_the_experts(tiny_checkpoint, tmp_path):
    # qwen3_moe tiny: 32 experts of 96 KiB; 1.5Mi holds the working set (10 experts) and 6 resident ones.
    proc = subprocess.Popen([KUBEMOE, "serve", "--checkpoint", str(tiny_checkpoint("qwen3_moe")), "--offload",
                             "--gpu-budget", "1.5Mi", "--offload-predictor", "router", "--port", "0",
                             "--grpc-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        banner = proc.stdout.readline()
        match = re.search(r"serving (\S+) at (http://127\.0\.0\.1:\d+/v1).*offloaded", banner)
        assert match, banner + proc.stderr.read()
        model, url = match.groups()
        body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8})
        request = urllib.request.Request(f"{url}/completions", body.encode(), {"Content-Type": "application/json"})
        assert json.load(urllib.request.urlopen(request, timeout=60))["usage"]["completion_tokens"] >= 1
        offload = json.load(urllib.request.urlopen(url.removesuffix("/v1") + "/loads", timeout=10))["offload"]
        assert offload["policy"] == "kubemoe" and int(offload["activated"]) > int(offload["hits"])
        metrics = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
        assert "kubemoe_offload_experts_total" in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_serve_offload_refuses_a_budget_below_the_working_set(tiny_checkpoint):
    done = subprocess.run([KUBEMOE, "serve", "--checkpoint", str(tiny_checkpoint("qwen3_moe")), "--offload",
                           "--gpu-budget", "100Ki", "--port", "0", "--grpc-port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "cannot hold one layer's working set: at least 983,040 bytes" in done.stderr, done.stderr
    done = subprocess.run([KUBEMOE, "serve", "--offload"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "offload mode needs --gpu-budget" in done.stderr
