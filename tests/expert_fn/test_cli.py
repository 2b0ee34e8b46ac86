"""`kubemoe expert-fn` as Knative runs it: a process that serves, and drains on SIGTERM."""

from __future__ import annotations

import asyncio
import re
import signal
import sys

import grpc
import pytest
import torch
from click.testing import CliRunner

from kubemoe.expert_fn.cli import command

LAUNCH = "from kubemoe.expert_fn.cli import command; import sys; command.main(sys.argv[1:], standalone_mode=False)"


async def test_sigterm_refuses_new_calls_ends_open_streams_and_exits_0_at_once(tiny_checkpoint, serving):
    checkpoint = tiny_checkpoint("deepseek_v3")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LAUNCH, "--checkpoint", str(checkpoint), "--bundle", "1:0-3", "--port", "0",
        "--host", "127.0.0.1", "--metrics-port", "-1", "--model", "moonlight-tiny", "--device", "cpu",
        "--grace-seconds", "25", stderr=asyncio.subprocess.PIPE,
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
        await client.forward(1, [2], [4], x)  # a frontend's stream: open, idle, never closed by the client
        process.send_signal(signal.SIGTERM)
        # Well within the 25 s grace period: the server does not wait for the open stream to end.
        assert await asyncio.wait_for(process.wait(), 10) == 0
        rest = (await process.stderr.read()).decode()
        assert "stopped" in rest and "Traceback" not in rest, rest
        with pytest.raises(grpc.aio.AioRpcError) as gone:  # the client learns the stream ended: retryable
            await client.forward(1, [2], [4], x)
        assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
        await client.close()
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
    result = CliRunner().invoke(command, ["--checkpoint", str(tiny_checkpoint("mixtral")), "--working-memory-mib", "-1"])
    assert result.exit_code == 2 and "--working-memory-mib" in result.output and "-1 is not in the range x>=0" in result.output


def test_a_memory_cap_is_nothing_on_the_cpu(tiny_checkpoint):
    from kubemoe.devices import cap_device_memory
    from kubemoe.errors import KubemoeError
    from kubemoe.expert_fn.config import ExpertFnConfig

    cap_device_memory(torch.device("cpu"), 1 << 30)  # host memory is not what it caps: nothing to do
    config = ExpertFnConfig.build(tiny_checkpoint("mixtral"), device="cpu", working_memory_bytes=1 << 30)
    assert config.working_memory_bytes == 1 << 30
    with pytest.raises(KubemoeError, match="--working-memory-mib must be 0"):
        ExpertFnConfig.build(tiny_checkpoint("mixtral"), device="cpu", working_memory_bytes=-(1 << 20))


def test_working_memory_too_small_for_a_round_is_raised_to_what_one_needs_and_said(tiny_checkpoint, caplog):
    from kubemoe.adapters import MoEAdapter
    from kubemoe.checkpoint import Checkpoint
    from kubemoe.expert_fn.config import ExpertFnConfig
    from kubemoe.expert_fn.server import ROUND_SLACK, working_memory

    adapter = MoEAdapter(Checkpoint(tiny_checkpoint("mixtral")).config)
    build = lambda working: ExpertFnConfig.build(tiny_checkpoint("mixtral"), device="cpu", dtype="float32",  # noqa: E731
                                                 max_batch_tokens=1024, working_memory_bytes=working)
    need = 1024 * (4 * adapter.hidden_size + 3 * adapter.expert_intermediate_size) * 4 + ROUND_SLACK
    assert working_memory(build(0), adapter) == 0 and not caplog.text  # no cap: nothing to raise
    assert working_memory(build(need + 1), adapter) == need + 1
    assert working_memory(build(1), adapter) == need
    assert "less than a round of 1024 tokens needs" in caplog.text and "functionOverhead" in caplog.text
