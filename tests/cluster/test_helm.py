import json
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

pytestmark = pytest.mark.cluster

CHART = Path(__file__).parent / "charts" / "trivial"


def test_helm_install_upgrade_uninstall(cluster, api, namespace):
    core = client.CoreV1Api(api)

    cluster.helm("install", "demo", str(CHART), f"--namespace={namespace}", "--wait", "--timeout=60s")
    assert core.read_namespaced_config_map("demo-trivial", namespace).data == {"greeting": "hello"}

    cluster.helm("upgrade", "demo", str(CHART), f"--namespace={namespace}", "--set=greeting=bonjour")
    assert core.read_namespaced_config_map("demo-trivial", namespace).data == {"greeting": "bonjour"}
    releases = json.loads(cluster.helm("list", f"--namespace={namespace}", "--output=json").stdout)
    assert [(r["name"], r["revision"], r["status"]) for r in releases] == [("demo", "2", "deployed")]

    cluster.helm("uninstall", "demo", f"--namespace={namespace}", "--wait")
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_config_map("demo-trivial", namespace)
    assert gone.value.status == 404
    assert json.loads(cluster.helm("list", f"--namespace={namespace}", "--output=json").stdout) == []
