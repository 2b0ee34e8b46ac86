"""What a reconcile writes (operator/diff.py), as a pure function: the expert pods' rules."""

from kubemoe.operator.diff import diff, key_of
from kubemoe.operator.render import FINGERPRINT_ANNOTATION, FUNCTION_LABEL


def pod(name, function="fn-a", fingerprint="f1", phase=None, ready=False, **meta):
    status = {"conditions": [{"type": "Ready", "status": "True"}]} if ready else {}
    if phase:
        status["phase"] = phase
    return {"apiVersion": "v1", "kind": "Pod", "status": status,
            "metadata": {"name": name, "labels": {"app.kubernetes.io/component": "expert", FUNCTION_LABEL: function},
                         "annotations": {FINGERPRINT_ANNOTATION: fingerprint}, **meta}}


def live(*pods):
    return {key_of(p): p for p in pods}


def names(objects):
    return [o["metadata"]["name"] for o in objects]


def test_new_pods_are_made_and_unchanged_ones_left_alone():
    todo = diff([pod("a-0"), pod("a-1")], live(pod("a-0", ready=True)), set())
    assert names(todo.made) == ["a-1"] and todo.unchanged == 1 and not todo.annotate and not todo.gone


def test_a_pod_that_ended_is_deleted_not_patched_and_made_again_only_once_gone():
    todo = diff([pod("a-0")], live(pod("a-0", phase="Failed")), set())
    assert todo.gone == [("v1", "Pod", "a-0")] and not todo.made and not todo.annotate
    going = pod("a-0", deletionTimestamp="2026-12-03T00:00:00Z")
    assert diff([pod("a-0")], live(going), set()).gone == []  # already going: nothing to send


def test_an_expected_pod_is_not_sent_again():
    assert diff([pod("a-0")], {}, {("v1", "Pod", "a-0")}).made == []


def test_a_running_pods_new_annotations_are_patched_after_the_status():
    todo = diff([pod("a-0", fingerprint="f2")], live(pod("a-0", ready=True)), set())
    assert names(todo.annotate) == ["a-0"] and not todo.made


def test_the_old_specs_pods_stay_until_every_new_one_of_the_function_is_ready():
    old = pod("a-old-0", ready=True)
    starting = diff([pod("a-new-0"), pod("a-new-1")], live(old, pod("a-new-0", ready=True)), set())
    assert starting.gone == [] and names(starting.made) == ["a-new-1"]
    ready = diff([pod("a-new-0"), pod("a-new-1")], live(old, pod("a-new-0", ready=True), pod("a-new-1", ready=True)), set())
    assert ready.gone == [key_of(old)]
    # Another function's leftovers do not wait for this one's start.
    other = pod("b-0", function="fn-b")
    assert diff([pod("a-new-0")], live(old, other), set()).gone == [key_of(other)]
