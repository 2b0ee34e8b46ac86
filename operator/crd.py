"""The CRDs kubemoe installs, written out as YAML for the chart and manifests/, and the spec's field
reference in the chart's README.

    python -m kubemoe.operator.crd          # rewrite the YAML copies and the README's field reference
    python -m kubemoe.operator.crd --check  # exit 1 if one is stale (tests/operator checks it too)

The spec's schema comes from the field declarations in `fields.py` (which the parser reads too): every
field carries a description with its unit and default, and constraints that need a message telling the
user what to write are CEL rules (`x-kubernetes-validations`), so the API server's rejection says what
to fix. The status schema is declared here: the operator writes it, nothing parses it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from kubemoe.operator.conditions import READY
from kubemoe.operator.fields import SPEC
from kubemoe.operator.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION

REPO = Path(__file__).resolve().parents[1]
# The same bytes in both places: the chart reads its copy with .Files.Get (templates/crds.yaml).
OUTPUTS = {
    "moedeployments": [REPO / "manifests" / "crd.yaml", REPO / "charts/kubemoe/files/crds/moedeployments.yaml"],
    "peerings": [REPO / "manifests" / "kopf-peering-crds.yaml", REPO / "charts/kubemoe/files/crds/kopf-peerings.yaml"],
}
SHORT_NAME = "moed"

Schema = dict[str, Any]


def obj(text: str, properties: dict[str, Schema], *, required: tuple[str, ...] = ()) -> Schema:
    schema: Schema = {"type": "object", "description": text, "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


def _status_schema() -> Schema:
    number = lambda text: {"type": "number", "description": text}  # noqa: E731
    count = lambda text: {"type": "integer", "description": text}  # noqa: E731
    condition = obj("A condition in the Kubernetes convention (see kubemoe.operator.conditions).", {
        "type": {"type": "string", "description": "Ready, FrontendReady, ExpertsReady or PlanApplied."},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"], "description": "True, False or Unknown."},
        "reason": {"type": "string", "description": "CamelCase cause, for machines."},
        "message": {"type": "string", "description": "What happened and what to do, for people."},
        "lastTransitionTime": {"type": "string", "format": "date-time",
                               "description": "When status last changed."},
        "observedGeneration": {"type": "integer", "description": "metadata.generation the condition is about."},
    }, required=("type", "status"))
    return obj("What the operator observed and did.", {
        "observedGeneration": count("metadata.generation of the last spec the operator acted on."),
        "mode": {"type": "string", "description": "The mode in effect (auto resolved): distributed or offload."},
        "modeReason": {"type": "string", "description": "Why that mode: what mode auto saw of the nodes' GPUs "
                                                        "and the model, and where the offload GPU budget comes from."},
        "offload": obj("The offload path as the frontends run it (mode offload).", {
            "gpuMemoryBudget": count("GPU memory the frontend gives expert weights: spec.offload.gpuMemoryBudget, "
                                     "or derived by mode auto from the nodes' GPUs. Unit: bytes."),
        }),
        "conditions": {"type": "array", "description": "Ready <- FrontendReady, ExpertsReady, PlanApplied.",
                       "items": condition, "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        "plan": obj("Summary of the plan in effect.", {
            "replicas": count("Expert-function replicas planned (pods)."),
            "hostedInPlace": count("Scaled-out replicas loaded in place into running functions: no service of their own."),
            "functions": count("Expert services planned: one per (bundle, node)."),
            "bundles": count("Expert bundles of the model."),
            "nodes": count("Nodes the expert replicas are placed on."),
            "retired": count("Services out of the plan but kept warm until their keep-alive ends."),
            "unplaced": count("Scaled-out replicas no node had room for (PlanApplied says which)."),
            "cv": number("Largest coefficient of variation of per-replica loads in a layer, as placed."),
            "cvBefore": number("The same with one replica per bundle: what scaling out improved on."),
            "version": count("Routing-table version; grows with every change of placement."),
            "layers": {"type": "array", "description": "One entry per MoE layer, in layer order.",
                       "items": obj("Replicas of one MoE layer and how even their loads are.", {
                           "layer": count("Index of the layer in the model."),
                           "replicas": count("Expert-function replicas of the layer's bundles."),
                           "cvBefore": number("CV of the bundles' loads with one replica each."),
                           "cvAfter": number("CV of the per-replica loads as placed."),
                       })},
        }),
        "loads": obj("The last expert loads pulled from the frontends.", {
            "frontends": count("Frontends that answered /loads."),
            "tokensPerSecond": number("Tokens per second through the model, all frontends together."),
        }),
        "cost": obj("What the plan costs at spec.cost.gpuHourPrice.", {
            "gpuHoursPerHour": number("GPUs held (frontends, expert replicas, warm retired replicas). Unit: GPU-hours per hour."),
            "usdPerHour": number("gpuHoursPerHour * gpuHourPrice. Unit: USD per hour."),
            "usdPerMillionTokens": number("usdPerHour over the observed token rate. Unit: USD per 10^6 tokens."),
        }),
    })


def moedeployment_crd() -> dict[str, Any]:
    columns = [
        ("Mode", "string", ".status.mode", "Mode in effect."),
        ("Ready", "string", f'.status.conditions[?(@.type=="{READY}")].status', "Ready condition."),
        ("Replicas", "integer", ".status.plan.replicas", "Expert-function replicas planned."),
        ("Functions", "integer", ".status.plan.functions", "Expert services planned."),
        ("CV", "number", ".status.plan.cv", "Largest per-layer CV of per-replica loads (spec cvThreshold)."),
        ("Unplaced", "integer", ".status.plan.unplaced", "Scaled-out replicas that fit on no node."),
        ("Cost", "number", ".status.cost.usdPerHour", "USD per hour at spec.cost.gpuHourPrice."),
        ("Age", "date", ".metadata.creationTimestamp", ""),
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "kubemoe"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": KIND.lower(),
                      "shortNames": [SHORT_NAME], "categories": ["kubemoe"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": n, "type": t, "jsonPath": p, **({"description": d} if d else {})}
                    for n, t, p, d in columns],
                "schema": {"openAPIV3Schema": obj(
                    f"A Mixture-of-Experts model served by kubemoe ({API_VERSION}).", {
                        "apiVersion": {"type": "string", "description": "kubemoe.io/v1alpha1."},
                        "kind": {"type": "string", "description": "MoEDeployment."},
                        "metadata": {"type": "object"},
                        "spec": SPEC.schema("spec"),
                        "status": _status_schema(),
                    }, required=("spec",))},
            }],
        },
    }


def kopf_peering_crds() -> list[dict[str, Any]]:
    """Kopf's peering resources: operator replicas see each other here, so only one acts at a time."""
    def crd(kind: str, scope: str) -> dict[str, Any]:
        plural = kind.lower() + "s"
        return {
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.kopf.dev"},
            "spec": {
                "group": "kopf.dev", "scope": scope,
                "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                    "type": "object", "properties": {
                        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}],
            },
        }
    return [crd("ClusterKopfPeering", "Cluster"), crd("KopfPeering", "Namespaced")]


HEADER = ("# Generated by `python -m kubemoe.operator.crd` from operator/crd.py and operator/fields.py: edit those, "
          "not this file.\n")
# The field reference: a section of the chart's README between these lines, the rest written by people.
REFERENCE = REPO / "charts/kubemoe/README.md"
REFERENCE_BEGIN = "<!-- spec fields: generated by `python -m kubemoe.operator.crd` from operator/fields.py -->\n"
REFERENCE_END = "<!-- end of spec fields -->\n"


def render_yaml() -> dict[str, str]:
    docs = {"moedeployments": [moedeployment_crd()], "peerings": kopf_peering_crds()}
    return {key: HEADER + "---\n".join(yaml.safe_dump(d, sort_keys=False, width=120) for d in items)
            for key, items in docs.items()}


def field_reference() -> str:
    """Every spec field as a Markdown table row: path, type, default, description."""
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for path, kind, default, doc in SPEC.rows("spec"):
        if path != "spec":
            rows.append(f"| `{path}` | {kind} | {default} | {doc.replace('|', '&#124;')} |")
    return "\n".join(rows) + "\n"


def readme_with_reference(readme: str) -> str:
    before, begin, rest = readme.partition(REFERENCE_BEGIN)
    _, end, after = rest.partition(REFERENCE_END)
    if not (begin and end):
        raise ValueError(f"{REFERENCE} lacks the lines {REFERENCE_BEGIN.strip()} and {REFERENCE_END.strip()}")
    return before + begin + field_reference() + end + after


def outputs() -> dict[Path, str]:
    """Every generated file (or file with a generated section) and the text it should have."""
    texts = render_yaml()
    out = {path: texts[key] for key, paths in OUTPUTS.items() for path in paths}
    out[REFERENCE] = readme_with_reference(REFERENCE.read_text())
    return out


def stale_outputs() -> list[Path]:
    return [path for path, text in outputs().items() if not path.exists() or path.read_text() != text]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stale = stale_outputs()
        for path in stale:
            print(f"stale: {path.relative_to(REPO)} (run python -m kubemoe.operator.crd)", file=sys.stderr)
        return 1 if stale else 0
    for path, text in outputs().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
