"""The Helm chart, the CRD copies and the Dockerfile, checked statically (helm lint/template, no cluster)."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from kubemoe.devcluster import find_testbin
from kubemoe.operator import crd
from kubemoe.operator.fields import SPEC

TESTBIN = find_testbin()
needs_helm = pytest.mark.skipif(TESTBIN is None, reason="helm not built: python -m kubemoe.devcluster testbin build")


def helm(*args: str) -> str:
    result = subprocess.run([TESTBIN.path("helm"), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout


def template(f, *sets: str) -> list[dict]:
    out = helm("template", "kubemoe", str(f.chart), "--namespace=kubemoe-system", *(f"--set={s}" for s in sets))
    return [d for d in yaml.safe_load_all(out) if d]


def test_crd_copies_are_generated_from_operator_crd_py():
    assert crd.stale_outputs() == [], "run: python -m kubemoe.operator.crd"


def test_every_crd_field_is_documented_with_defaults_in_the_description():
    def walk(schema, path):
        if path.count(".") > 1 and path.split(".")[-1] not in ("metadata",):
            assert schema.get("description"), f"{path} has no description"
        if "default" in schema and schema["default"] != {}:
            assert f"Default: {schema['default']}" in schema["description"], path
        for name, child in schema.get("properties", {}).items():
            walk(child, f"{path}.{name}")
        if "items" in schema and "properties" in schema["items"]:
            walk(schema["items"], f"{path}[]")
    schema = crd.moedeployment_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    walk(schema["properties"]["spec"], ".spec")
    walk(schema["properties"]["status"], ".status")
    described = yaml.safe_dump(schema)
    defaults = [default for _, _, default, _ in SPEC.rows("spec") if default not in ("", "required")]
    assert len(defaults) >= 15 and all(d.strip("`") in described for d in defaults)


@needs_helm
def test_helm_lint_passes(f):
    assert "0 chart(s) failed" in helm("lint", "--strict", str(f.chart))


@needs_helm
def test_chart_ships_the_generated_crds_kept_on_uninstall(f):
    docs = template(f)
    crds = {d["metadata"]["name"]: d for d in docs if d["kind"] == "CustomResourceDefinition"}
    generated = [crd.moedeployment_crd(), *crd.kopf_peering_crds()]
    assert set(crds) == {g["metadata"]["name"] for g in generated}
    for g in generated:
        shipped = crds[g["metadata"]["name"]]
        assert shipped["spec"] == g["spec"]
        assert shipped["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert not [d for d in template(f, "crds.enabled=false") if d["kind"] == "CustomResourceDefinition"]
    unkept = [d for d in template(f, "crds.keep=false") if d["kind"] == "CustomResourceDefinition"]
    assert all("annotations" not in d["metadata"] for d in unkept)


@needs_helm
def test_rbac_is_least_privilege(f):
    docs = template(f)
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule.get("apiGroups", [])
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    for needed in [("kubemoe.io", "moedeployments", "watch"), ("kubemoe.io", "moedeployments/status", "patch"),
                   ("serving.knative.dev", "services", "patch"), ("apps", "deployments", "delete"),
                   ("", "pods", "list"), ("", "pods", "delete"),  # runtime pods: the functions' pods are its own ("", "nodes", "list"), ("", "events", "create"),
                   ("kopf.dev", "clusterkopfpeerings", "patch"), ("kopf.dev", "kopfpeerings", "patch"),
                   ("resource.k8s.io", "resourceclaims", "delete")]:
        assert needed in granted, needed
    assert ("", "secrets", "get") not in granted and not {r for _, r, _ in granted if r.startswith("pods/")}  # no exec
    scoped = template(f, "operator.watchNamespaces={a,b}")
    assert [d["metadata"]["namespace"] for d in scoped if d["kind"] == "Role"] == ["a", "b"]
    cluster_role = next(d for d in scoped if d["kind"] == "ClusterRole")
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "nodes", "pods", "resourceslices", "customresourcedefinitions", "namespaces", "clusterkopfpeerings"}
    operator = next(d for d in scoped if d["kind"] == "Deployment")
    assert "--namespace=a" in operator["spec"]["template"]["spec"]["containers"][0]["args"]


@needs_helm
def test_operator_pod_security_is_strict(f):
    deployment = next(d for d in template(f) if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"] == {"drop": ["ALL"]}
    assert container["image"] == "ghcr.io/kubemoe/operator:0.1.0"
    names = [d["metadata"]["name"] for d in template(f, "fullnameOverride=" + "x" * 80)]
    assert all(len(n) <= 63 for n in names)


def test_every_value_is_documented(f):
    """Each key has a comment right above it, or sits inside a value documented as a whole: a key whose
    comment starts with `# --` (helm-docs' mark of a value) documents everything below it."""
    value_docs: dict[int, bool] = {}  # indentation -> the open key there documents its whole value
    lines = (f.chart / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if not re.match(r"^\s*[A-Za-z][\w.]*:", line):
            continue
        indent = len(line) - len(line.lstrip())
        inherited = any(ok for depth, ok in value_docs.items() if depth < indent)
        comment = lines[i - 1].strip() if i else ""
        value_docs = {depth: ok for depth, ok in value_docs.items() if depth < indent}
        value_docs[indent] = comment.startswith("# --")
        assert comment.startswith("#") or inherited, f"values.yaml line {i + 1} ({line.strip()}) has no comment above it"


def test_chart_images_are_dockerfile_targets(f):
    dockerfile = (f.repo / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.M))
    assert {"operator", "frontend", "expert-fn", "frontend-cpu", "expert-fn-cpu"} <= targets
    values = yaml.safe_load((f.chart / "values.yaml").read_text())
    for image in (values["operator"]["image"]["repository"], values["images"]["frontend"], values["images"]["expertFn"]):
        assert image.split("/")[-1].split(":")[0] in targets


def test_dockerfile_copies_and_entrypoints_exist(f):
    dockerfile = (f.repo / "Dockerfile").read_text()
    for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile, re.M):
        for source in sources.split():
            assert (f.repo / source.rstrip("/")).exists(), f"COPY {source}: not in the repository"
    assert "kubemoe.operator.cli" in dockerfile and (f.repo / "operator" / "cli.py").exists()
    pyproject = (f.repo / "pyproject.toml").read_text()
    assert re.search(r'^kubemoe = "kubemoe.cli:main"', pyproject, re.M)  # ENTRYPOINT ["kubemoe"]
    for command in re.findall(r'^CMD \["([\w-]+)"', dockerfile, re.M):
        assert command in {"frontend", "expert-fn"}
    assert all("USER 65532:65532" in stage for stage in dockerfile.split("\nFROM ")
               if re.search(r"^ENTRYPOINT", stage, re.M))


def test_every_image_installs_kubemoe_on_a_python_it_supports(f):
    dockerfile = (f.repo / "Dockerfile").read_text()
    minimum = re.search(r'^requires-python = ">=(\d+)\.(\d+)"', (f.repo / "pyproject.toml").read_text(), re.M)
    version = re.search(r"^ARG PYTHON_VERSION=(\d+)\.(\d+)$", dockerfile, re.M)
    assert minimum and version and tuple(map(int, version.groups())) >= tuple(map(int, minimum.groups()))
    stages = [(re.match(r"(\S+) AS (\S+)", part).groups(), part) for part in dockerfile.split("\nFROM ")[1:]]
    base_of = {stage: base for (base, stage), _ in stages}
    for (_, stage), body in stages:
        if "/wheels" in body:  # builds or installs the kubemoe wheel
            root = stage
            while base_of[root] in base_of:  # FROM another stage: look at that one's base
                root = base_of[root]
            assert base_of[root] == "python:${PYTHON_VERSION}-slim", f"stage {stage} installs kubemoe on {base_of[root]}"


def _pyproject(f) -> dict:
    import tomllib
    return tomllib.loads((f.repo / "pyproject.toml").read_text())["project"]


def _dockerfile_requirements(f) -> dict[str, list[str]]:
    """Stage -> the requirements its `pip install` lines name (not wheels, paths or flags)."""
    dockerfile = (f.repo / "Dockerfile").read_text().replace("\\\n", " ")
    out = {}
    for part in dockerfile.split("\nFROM ")[1:]:
        stage = re.match(r"\S+ AS (\S+)", part).group(1)
        words = [w.strip('"') for cmd in re.findall(r"pip install ([^&\n]+)", part) for w in cmd.split()]
        out[stage] = [w for w in words if not w.startswith(("-", "/", "https://")) and "download.pytorch" not in w]
    return out


def test_dockerfile_installs_the_versions_pyproject_requires(f):
    from packaging.requirements import Requirement

    required = {Requirement(r).name: Requirement(r).specifier for r in _pyproject(f)["dependencies"]}
    stages = _dockerfile_requirements(f)
    assert stages["operator"] and stages["serving-cpu"] == ["torch>=2.4"]
    for stage, requirements in stages.items():
        for text in requirements:
            requirement = Requirement(text)
            assert requirement.name in required, f"{stage} installs {text}, which pyproject.toml does not require"
            assert requirement.specifier == required[requirement.name], (
                f"stage {stage} installs {text}; pyproject.toml requires {requirement.name}{required[requirement.name]}")


def test_chart_image_tags_match_the_dockerfile_and_the_package_version(f):
    from kubemoe.operator.config import OperatorConfig

    version = _pyproject(f)["version"]
    chart = yaml.safe_load((f.chart / "Chart.yaml").read_text())
    assert chart["appVersion"] == version  # the operator image's default tag
    values = yaml.safe_load((f.chart / "values.yaml").read_text())
    operator = values["operator"]["image"]
    assert operator["tag"] in ("", version)
    chart_images = {"operator": f"{operator['repository']}:{operator['tag'] or chart['appVersion']}",
                    "frontend": values["images"]["frontend"], "expert-fn": values["images"]["expertFn"]}
    # The Dockerfile's header says how each target is built and tagged.
    built = dict(re.findall(r"^#\s+docker build --target (\S+)\s+-t (\S+) \.", (f.repo / "Dockerfile").read_text(), re.M))
    for target, image in chart_images.items():
        assert built[target] == image, f"Dockerfile tags target {target} {built[target]}; the chart uses {image}"
        if f"{target}-cpu" in built:
            assert built[f"{target}-cpu"] == f"{image}-cpu"
    defaults = OperatorConfig()
    assert (defaults.frontend_image, defaults.expert_image) == (chart_images["frontend"], chart_images["expert-fn"])
