"""The command lines the operator renders are the ones `kubemoe expert-fn` and `kubemoe frontend` parse:
every field of kubemoe/pod_args.py arrives, with its value, in the command's parameter of the same name."""

from dataclasses import fields

import pytest

from kubemoe import ports
from kubemoe.expert_fn.cli import command as expert_fn_command
from kubemoe.frontend.cli import frontend_command
from kubemoe.pod_args import FRONTEND_NAME_ENV, ExpertFnArgs, FrontendArgs


def parsed(command, args: list[str]) -> dict:
    assert args[0] == command.name
    return command.make_context(command.name, args[1:]).params


@pytest.mark.parametrize("make, command", [
    (lambda ckpt: ExpertFnArgs(checkpoint=ckpt, bundle="0:0-1;1:3", model="m", dtype="float32", data_host="10.1.2.3",
                               routing_configmap="ns/m-routing", address="m-l0.ns.svc.cluster.local:80",
                               drop_after=600, working_memory_mib=768, shm_dir=""), expert_fn_command),
    (lambda ckpt: FrontendArgs(checkpoint=ckpt, routing_configmap="ns/m-routing", model="m", dtype="bfloat16",
                               prediction_distance=2, shm_dir="/var/run/kubemoe/node-shm/kubemoe-uid-1"),
     frontend_command),
])
def test_every_rendered_argument_reaches_the_commands_parameter_of_that_name(tmp_path, make, command):
    args = make(str(tmp_path))
    params = parsed(command, args.args())
    for f in fields(args):
        value = params[f.name]
        if f.name in ("checkpoint", "shm_dir"):  # parsed as a Path; --shm-dir '' as None (no shared folder)
            value = "" if value is None else str(value)
        assert value == getattr(args, f.name), f.name


def test_the_rendered_ports_are_the_commands_defaults_and_none_is_knatives():
    expert = ExpertFnArgs(checkpoint="/m", bundle="*", model="m", dtype="float32", routing_configmap="a/b",
                          address="a:80", drop_after=1, working_memory_mib=0, shm_dir="")
    frontend = FrontendArgs(checkpoint="/m", routing_configmap="a/b", model="m", dtype="float32", prediction_distance=1,
                            shm_dir="")
    expert_defaults = {p.name: p.default for p in expert_fn_command.params}
    frontend_defaults = {p.name: p.default for p in frontend_command.params}
    assert (expert.port, expert.metrics_port) == (expert_defaults["port"], expert_defaults["metrics_port"])
    assert (frontend.port, frontend.grpc_port) == (frontend_defaults["port"], frontend_defaults["grpc_port"])
    rendered = {expert.port, expert.metrics_port, expert.data_port, frontend.port, frontend.grpc_port}
    assert len(rendered) == 5 and not rendered & ports.KNATIVE_RESERVED


def test_the_frontends_name_comes_from_the_rendered_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(FRONTEND_NAME_ENV, "tiny-frontend-5d4f-x2")
    args = FrontendArgs(checkpoint=str(tmp_path), routing_configmap="a/b", model="m", dtype="float32",
                        prediction_distance=1, shm_dir="")
    assert [e["name"] for e in args.env()] == [FRONTEND_NAME_ENV]
    assert parsed(frontend_command, args.args())["name"] == "tiny-frontend-5d4f-x2"
