"""kubemoe: serve Mixture-of-Experts language models on Kubernetes."""

import os as _os

__version__ = "0.1.0"

# The components live in top-level folders named like their subpackages (proto/, expert_fn/,
# frontend/, operator/; see pyproject.toml). Installed from a wheel they sit inside this package;
# imported from a source checkout (an editable install, or a shell in the repository root) the
# checkout's root is searched for them too. Only kubemoe.* names are looked up there: the root
# never goes on sys.path, so operator/ cannot shadow the standard library's `operator`.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "proto", "kubemoe", "v1", "kubemoe.proto")):
    __path__.append(_checkout)
