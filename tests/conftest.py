"""Shared fixtures: small generated checkpoints, made once per test session."""

from __future__ import annotations

import pytest

from kubemoe.adapters import arch_names
from kubemoe.presets import get_preset
from kubemoe.synth import make_checkpoint

ARCHS = arch_names()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(arch) -> path of that architecture's tiny checkpoint (seed 0), made once."""
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = make_checkpoint(get_preset(arch, "tiny"), tmp_path_factory.mktemp(arch) / "ckpt", progress=False)
        return made[arch]

    return get
