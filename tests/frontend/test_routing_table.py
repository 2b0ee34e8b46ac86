import asyncio

import pytest

from kubemoe.bundles import bundles_by_count
from kubemoe.frontend.dispatch import Replica, pick_replica
from kubemoe.frontend.loads import LoadRecorder
from kubemoe.routing_watch import watch_file
from kubemoe.routing_table import LOCAL, RoutingTableError, build_route_map, parse_table, table_for_bundles, to_json

LAYERS, EXPERTS = (1, 3), 8


def table(version=1, count=2):
    bundles = bundles_by_count(LAYERS, EXPERTS, count)
    return table_for_bundles("m", bundles, {b.name: [f"10.0.0.{i}:80", LOCAL] for i, b in enumerate(bundles)}, version)


def test_json_round_trip_and_route_map():
    t = parse_table(to_json(table()))
    routes = build_route_map(t, "m", LAYERS, EXPERTS)
    assert routes.routes[(3, 7)].bundle == "part1-of-2"
    assert routes.routes[(1, 0)].addresses == ("10.0.0.0:80", LOCAL)


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.routes.pop(), "serves no endpoint for experts"),
    (lambda t: t.routes[0].experts.add(layer=3, expert=7), "in two bundles"),
    (lambda t: t.routes[0].experts.add(layer=2, expert=0), "not an expert of this model"),
    (lambda t: t.routes[0].ClearField("endpoints"), "no endpoint"),
    (lambda t: setattr(t, "model", "other"), "for model 'other'"),
])
def test_bad_tables_are_refused_with_a_reason(mutate, message):
    t = table()
    mutate(t)
    with pytest.raises(RoutingTableError, match=message):
        build_route_map(t, "m", LAYERS, EXPERTS)


def test_unparseable_table():
    with pytest.raises(RoutingTableError, match="RoutingTable"):
        parse_table('{"routes": 3}')


async def test_file_watch_reports_each_new_version(tmp_path):
    path = tmp_path / "routing.json"
    path.write_text(to_json(table(1)))
    seen = []

    async def on_table(t):
        seen.append(t.version)

    task = asyncio.create_task(watch_file(path, on_table, interval=0.02))
    await asyncio.sleep(0.1)
    path.write_text("not json")  # ignored, logged
    await asyncio.sleep(0.1)
    path.write_text(to_json(table(2)))
    await asyncio.sleep(0.1)
    task.cancel()
    assert seen == [1, 2]


def test_join_the_shortest_queue_skips_failed_replicas():
    a, b, c = Replica("a", inflight_tokens=5), Replica("b", inflight_tokens=1), Replica("c", inflight_tokens=3)
    assert pick_replica([a, b, c], set(), now=0).address == "b"
    b.failed_until = 10
    assert pick_replica([a, b, c], set(), now=1).address == "c"
    assert pick_replica([a, b, c], {"c"}, now=1).address == "a"
    assert pick_replica([b], set(), now=1).address == "b"  # the only replica is still tried


def test_load_windows_roll_over():
    now = [100.0]
    rec = LoadRecorder("m", "fe", window_seconds=10, clock=lambda: now[0])
    rec.record(1, [(0, 6), (3, 2)])
    rec.record_tokens(4)
    rec.record_tokens(1)  # a second pass
    report = rec.report()
    assert [(l.layer, l.expert, l.tokens) for l in report.loads] == [(1, 0, 6), (1, 3, 2)]
    now[0] = 112.0
    rec.record(1, [(0, 1)])
    last = rec.report()  # the completed window, not the one in progress
    assert last.window_seconds == 10 and last.tokens == 5 and last.passes == 2
    now[0] = 123.0
    assert rec.report().passes == 0  # the window after it: no pass ran
    assert last.loads[0].tokens_per_second == pytest.approx(0.6)
