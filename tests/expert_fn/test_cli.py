"""`kubemoe expert-fn` as Knative runs it: a process that serves, and drains on SIGTERM."""

from __future__ import annotations

import asyncio
import re
import signal
import sys

import grpc
import torch
from click.testing import CliRunner

from kubemoe.expert_fn.cli import command

LAUNCH = "from kubemoe.expert_fn.cli import command; import sys; command.main(sys.argv[1:], standalone_mode=False)"


async def test_sigterm_lets_an_open_call_finish_then_exits_0(tiny_checkpoint, serving):
    checkpoint = tiny_checkpoint("deepseek_v3")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LAUNCH, "--checkpoint", str(checkpoint), "--bundle", "1:0-3", "--port", "0",
        "--host", "127.0.0.1", "--metrics-port", "-1", "--model", "moonlight-tiny", "--device", "cpu",
        stderr=asyncio.subprocess.PIPE,
    )
    log = []
    try:
        while not (port := re.search(r"on port (\d+)", log[-1] if log else "")):
            line = await asyncio.wait_for(process.stderr.readline(), 60)
            assert line, "the server exited before listening:\n" + "".join(log)
            log.append(line.decode())
        address = f"127.0.0.1:{port.group(1)}"
        await serving(address)

        from kubemoe.expert_fn.client import ExpertClient

        client = ExpertClient(address, model="moonlight-tiny", streaming=True)
        x = torch.randn(4, 128)
        before = await client.forward(1, [2], [4], x)  # the stream is now an in-flight call
        process.send_signal(signal.SIGTERM)
        probe = ExpertClient(address, model="moonlight-tiny", streaming=False)
        for _ in range(100):  # new calls are refused once the server drains
            try:
                await probe.describe()
                await asyncio.sleep(0.05)
            except grpc.aio.AioRpcError as e:  # grpc refuses calls on a shutting-down server as CANCELLED
                assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), e
                break
        else:
            raise AssertionError("the server still takes new calls after SIGTERM")
        await probe.close()
        assert torch.equal(await client.forward(1, [2], [4], x), before)  # the open call still works
        await client.close()  # ends the call: nothing is left in flight
        assert await asyncio.wait_for(process.wait(), 20) == 0
        rest = (await process.stderr.read()).decode()
        assert "stopped" in rest, rest
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def test_bad_flags_say_what_to_do(tmp_path, tiny_checkpoint):
    result = CliRunner().invoke(command, ["--checkpoint", str(tiny_checkpoint("mixtral")), "--bundle", "5:0"])
    assert result.exit_code != 0
    assert "bad --bundle: layer 5" in str(result.exception) and "MoE layers: [0, 1]" in str(result.exception)
    result = CliRunner().invoke(command, ["--checkpoint", str(tmp_path)])
    assert result.exit_code != 0 and "kubemoe checkpoint make" in str(result.exception)
