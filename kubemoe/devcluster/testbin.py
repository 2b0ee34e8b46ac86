"""Build the control-plane binaries from the Go module proxy, once per set of versions.

Everything lands in ``~/.cache/kubemoe/testbin/<key>/``:

    bin/           etcd kube-apiserver kube-scheduler kube-controller-manager kubectl kwok helm
    knative-crds/  Knative Serving's CRDs (serving + the networking/caching files it symlinks)
    kwok/          kwok's default stages (node init + lease heartbeat, pod fast)
    src/           the generated wrapper module (go.mod written from hack/testbin/versions.env)
    BUILT          marker with the versions and the build time; present = nothing to do

<key> hashes versions.env, the wrapper sources, this file (the recipe) and the Go version, so
changing any of them builds into a new folder. A file lock makes parallel test runs wait for one builder.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIR = Path(os.environ.get("KUBEMOE_TESTBIN_SRC", REPO_ROOT / "hack" / "testbin"))
CACHE_ROOT = Path(os.environ.get("KUBEMOE_TESTBIN_CACHE", Path.home() / ".cache" / "kubemoe" / "testbin"))

BINARIES = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl", "kwok", "helm")
WRAPPER_MODULE = "kubemoe.local/testbin"


@dataclasses.dataclass(frozen=True)
class Testbin:
    """A finished build: where the binaries and CRDs are."""

    root: Path
    versions: dict[str, str]

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def knative_crds(self) -> Path:
        return self.root / "knative-crds"

    @property
    def kwok_manifests(self) -> Path:
        return self.root / "kwok"

    def path(self, name: str) -> str:
        return str(self.bin_dir / name)


def read_versions(source_dir: Path = SOURCE_DIR) -> dict[str, str]:
    versions = {}
    for line in (source_dir / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip()
    return versions


def _go(*args: str, cwd: Path, env: dict[str, str] | None = None, capture: bool = False) -> str:
    result = subprocess.run(["go", *args], cwd=cwd, env=env, check=True, text=True,
                            stdout=subprocess.PIPE if capture else None)
    return result.stdout if capture else ""


def cache_key(source_dir: Path = SOURCE_DIR) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in source_dir.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(source_dir)).encode() + b"\0" + path.read_bytes())
    digest.update(Path(__file__).read_bytes())
    if shutil.which("go"):  # without Go only a prebuilt KUBEMOE_TESTBIN_DIR can be used
        go_version = subprocess.run(["go", "env", "GOVERSION"], check=True, text=True, capture_output=True).stdout
        digest.update(go_version.strip().encode())
    return f"k8s-{read_versions(source_dir)['KUBERNETES_VERSION']}-{digest.hexdigest()[:12]}"


def find_testbin() -> Testbin | None:
    """The finished build for the current versions, or None (no Go needed when it exists)."""
    if "KUBEMOE_TESTBIN_DIR" in os.environ:  # a prebuilt folder, e.g. unpacked by CI
        root = Path(os.environ["KUBEMOE_TESTBIN_DIR"])
    else:
        root = CACHE_ROOT / cache_key()
    marker = root / "BUILT"
    if not marker.exists():
        return None
    return Testbin(root, json.loads(marker.read_text())["versions"])


def ensure_testbin(log=print) -> Testbin:
    """Return the build for the current versions, building it first if it is missing."""
    found = find_testbin()
    if found:
        return found
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    root = CACHE_ROOT / cache_key()
    with open(CACHE_ROOT / ".lock", "w") as lock:
        # One builder at a time; the others wait here and then find its marker.
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = find_testbin()
        if found:
            return found
        started = time.monotonic()
        _build(root, read_versions(), log)
        elapsed = time.monotonic() - started
        versions = read_versions()
        (root / "BUILT").write_text(json.dumps({"versions": versions, "build_seconds": round(elapsed, 1)}, indent=1))
        log(f"testbin: built {root} in {elapsed:.0f}s")
        return Testbin(root, versions)


def _download(module: str, version: str, cwd: Path) -> dict:
    """Fetch one module into the module cache; returns `go mod download -json` info (Dir, GoMod)."""
    return json.loads(_go("mod", "download", "-json", f"{module}@{version}", cwd=cwd, capture=True))


def _staging_modules(kubernetes_gomod: Path) -> list[str]:
    """k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with ./staging;
    a module that depends on it must replace each one with the published v0.X.Y itself."""
    return re.findall(r"^\s*(k8s\.io/[\w.-]+) => \./staging/", kubernetes_gomod.read_text(), re.M)


def _gomod_require(gomod: Path, module: str) -> str:
    match = re.search(rf"^\s*{re.escape(module)} (v\S+)", gomod.read_text(), re.M)
    if not match:
        raise RuntimeError(f"{gomod} does not require {module}")
    return match.group(1)


def _build(root: Path, v: dict[str, str], log) -> None:
    if shutil.which("go") is None:
        raise RuntimeError("testbin: `go` is not on PATH; install Go >= 1.26 to build the test control plane")
    if root.exists():  # a build that died half-way: start clean
        shutil.rmtree(root)
    src = root / "src"
    shutil.copytree(SOURCE_DIR, src)
    k8s = v["KUBERNETES_VERSION"]
    staging = "v0." + k8s.removeprefix("v1.")  # k8s v1.37.2 <-> k8s.io/api v0.37.2

    # Outside any module: `go mod download` just fills the module cache.
    k8s_info = _download("k8s.io/kubernetes", k8s, cwd=root)
    replaces = "\n".join(f"\t{m} => {m} {staging}" for m in _staging_modules(Path(k8s_info["GoMod"])))
    commands = ["kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl"]
    tools = [f"k8s.io/kubernetes/cmd/{c}" for c in commands] + ["sigs.k8s.io/kwok/cmd/kwok", _helm_package(v)]
    (src / "go.mod").write_text(
        f"module {WRAPPER_MODULE}\n\ngo 1.26.0\n\n"
        "require (\n"
        f"\tk8s.io/kubernetes {k8s}\n"
        f"\tgo.etcd.io/etcd/server/v3 {v['ETCD_VERSION']}\n"
        f"\tsigs.k8s.io/kwok {v['KWOK_VERSION']}\n"
        f"\t{_helm_module(v)} {v['HELM_VERSION']}\n"
        ")\n\n"
        f"replace (\n{replaces}\n)\n\n"
        "tool (\n" + "".join(f"\t{t}\n" for t in tools) + ")\n"
    )
    env = {**os.environ, "GOFLAGS": "-trimpath -buildvcs=false", "GOTOOLCHAIN": "local"}
    log("testbin: resolving modules (go mod tidy)")
    _go("mod", "tidy", cwd=src, env=env)

    major, minor = k8s.removeprefix("v").split(".")[:2]
    version_vars = {"gitVersion": k8s, "gitMajor": major, "gitMinor": minor, "gitTreeState": "clean",
                    "gitCommit": "0000000000000000000000000000000000000000", "buildDate": "1970-01-01T00:00:00Z"}
    ldflags = ["-s", "-w"]
    # component-base serves --version of the servers; client-go's copy is kubectl's client version.
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        ldflags += [f"-X {package}.{name}={value}" for name, value in version_vars.items()]
    ldflags.append(f"-X {_helm_module(v)}/internal/version.version={v['HELM_VERSION']}")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    log(f"testbin: go build {', '.join(BINARIES)} (cold: tens of minutes on 2 cores)")
    # One `go build` for all of them: shared packages compile once and the cores stay busy.
    _go("build", "-o", str(bin_dir) + "/", "-ldflags", " ".join(ldflags), "./etcd", *tools, cwd=src, env=env)

    _copy_knative_crds(v["KNATIVE_SERVING_VERSION"], root, log)
    _copy_kwok_stages(v["KWOK_VERSION"], root)


def _helm_module(v: dict[str, str]) -> str:
    return "helm.sh/helm/v" + v["HELM_VERSION"].removeprefix("v").split(".")[0]


def _helm_package(v: dict[str, str]) -> str:
    return _helm_module(v) + "/cmd/helm"


def _copy_knative_crds(serving_version: str, root: Path, log) -> None:
    """Serving's config/core/300-resources holds its CRDs, but some files there are symlinks into
    knative.dev/networking and knative.dev/caching, which module zips drop: take every CRD file from
    those modules' config/ at the versions serving's go.mod pins. The proxy refuses those two
    modules today ("not available"); their CRDs (Ingress, Certificate, ServerlessService, Image) are
    then skipped, which leaves serving.knative.dev's own CRDs, the ones kubemoe writes."""
    out = root / "knative-crds"
    out.mkdir()
    serving = _download("knative.dev/serving", serving_version, cwd=root)
    sources = sorted((Path(serving["Dir"]) / "config" / "core" / "300-resources").glob("*.yaml"))
    for module in ("knative.dev/networking", "knative.dev/caching"):
        version = _gomod_require(Path(serving["GoMod"]), module)
        try:
            info = _download(module, version, cwd=root)
        except subprocess.CalledProcessError:
            log(f"testbin: {module}@{version} is not served by the module proxy; its CRDs are skipped")
            continue
        sources += sorted((Path(info["Dir"]) / "config").glob("*.yaml"))
    for path in sources:
        if "kind: CustomResourceDefinition" in path.read_text():
            shutil.copyfile(path, out / path.name)


def _copy_kwok_stages(kwok_version: str, root: Path) -> None:
    """kwok moves fake nodes and pods through stages and ships none in its binary: copy the ones `kwokctl`
    uses by default (the cluster passes them in kwok's configuration file)."""
    out = root / "kwok"
    out.mkdir()
    kwok = Path(_download("sigs.k8s.io/kwok", kwok_version, cwd=root)["Dir"]) / "kustomize"
    sources = [kwok / "stage" / "node" / "fast" / "node-initialize.yaml",
               kwok / "stage" / "node" / "heartbeat-with-lease" / "node-heartbeat-with-lease.yaml",
               *sorted((kwok / "stage" / "pod" / "fast").glob("pod-*.yaml"))]
    for path in sources:
        shutil.copyfile(path, out / path.name)


def main() -> None:
    started = time.monotonic()
    testbin = ensure_testbin()
    print(f"{testbin.root} ({time.monotonic() - started:.1f}s)", file=sys.stderr)


if __name__ == "__main__":
    main()
