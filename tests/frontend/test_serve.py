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
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8})
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
