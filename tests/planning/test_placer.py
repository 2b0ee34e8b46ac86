from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from kubemoe.planning.latency import MIXTRAL_EXPERT_BYTES, MIXTRAL_FLOPS_PER_TOKEN, ExpertCurve, LatencyModel
from kubemoe.planning.placer import GPU, place

MIB = 2**20


def gpus(count, experts_each=100, node_size=8):
    return [GPU(f"g{i}", f"n{i // node_size}", experts_each * MIB) for i in range(count)]


def test_hand_worked_placement():
    p = place([[2, 1]], [[4.0, 1.0]], gpus(2), MIB)
    assert {p.gpu_of[(0, 0, 0)], p.gpu_of[(0, 0, 1)]} == {"g0", "g1"}  # one expert's replicas apart
    assert p.gpu_of[(0, 1, 0)] == "g0" and p.gpu_load == {"g0": 3.0, "g1": 2.0}
    assert p.gpu_memory == {"g0": 2 * MIB, "g1": MIB} and p.unplaced == ()


def test_warm_replicas_are_reused():
    p = place([[2, 1]], [[4.0, 1.0]], gpus(2), MIB, warm_previous={(0, 1): ("g1",)})
    assert p.gpu_of[(0, 1, 0)] == "g1" and p.warm_reused == 1
    again = place([[2, 1]], [[4.0, 1.0]], gpus(3), MIB, warm_previous=p.locations())
    assert again.locations() == p.locations() and again.warm_reused == 3


def test_warm_slack_bounds_what_a_warm_start_may_cost():
    # Expert 0 (load 4) is warm on g0 only; expert 1 (load 4) too: always reusing stacks both on g0.
    warm = {(0, 0): ("g0",), (0, 1): ("g0",)}
    always = place([[1, 1]], [[4.0, 4.0]], gpus(2), MIB, warm)
    assert set(always.gpu_of.values()) == {"g0"} and always.warm_reused == 2
    bounded = place([[1, 1]], [[4.0, 4.0]], gpus(2), MIB, warm, warm_slack=0.5)
    assert set(bounded.gpu_of.values()) == {"g0", "g1"} and bounded.warm_reused == 1


def test_a_serving_warm_replica_stays_unless_another_warm_gpu_is_clearly_better():
    # Expert 0 (load 4, placed first) is warm on g0; expert 1 (load 4) serves on g0 and is kept warm
    # (retired) on g1, where the queue is 4 shorter.
    warm = {(0, 0): ("g0",), (0, 1): ("g0", "g1")}
    hops = place([[1, 1]], [[4.0, 4.0]], gpus(2), MIB, warm, warm_slack=1.5, warm_held=True)
    assert hops.gpu_of[(0, 1, 0)] == "g1"  # the service would move there and g0's copy retire
    stays = place([[1, 1]], [[4.0, 4.0]], gpus(2), MIB, warm, warm_slack=1.5, warm_held=True,
                  warm_serving={(0, 1): ("g0",)})
    assert stays.gpu_of[(0, 1, 0)] == "g0" and stays.warm_reused == 2  # 4 <= 1.5 x 4: not worth a move
    moves = place([[1, 1]], [[4.0, 4.0]], gpus(2), MIB, warm, warm_slack=0.5, warm_held=True,
                  warm_serving={(0, 1): ("g0",)})
    assert moves.gpu_of[(0, 1, 0)] == "g1" and moves.warm_reused == 2  # 4 > 0.5 x 4: clearly better


def test_lightly_loaded_replicas_count_as_a_weight_read_each():
    # Decode-sized loads under a knee of 64 tokens: every replica costs one weight read. By tokens
    # alone the three light experts would join expert 0's partner on g1 (3 reads there, 1 on g0).
    loads = [[40.0, 10.0, 10.0, 10.0]]
    by_tokens = place([[1, 1, 1, 1]], loads, gpus(2), MIB)
    assert sorted(list(by_tokens.gpu_of.values()).count(g) for g in ("g0", "g1")) == [1, 3]
    by_reads = place([[1, 1, 1, 1]], loads, gpus(2), MIB, min_replica_load=64)
    assert sorted(list(by_reads.gpu_of.values()).count(g) for g in ("g0", "g1")) == [2, 2]
    assert by_reads.replica_load[(0, 1, 0)] == 10.0 and by_reads.gpu_load == {"g0": 128.0, "g1": 128.0}


def test_under_the_knee_a_replicas_tokens_still_count_through_the_wire():
    # Three nearly-knee-sized experts and three light ones on 3 GPUs, a knee of 221 tokens (Mixtral
    # on the H200). Every replica weighs one weight read, so without the wire the light ones go by
    # GPU id and the heaviest gets the heaviest partner; the copies put each light one beside the
    # lighter heavy one, which is the shorter GPU in time.
    model = LatencyModel(ExpertCurve(MIXTRAL_EXPERT_BYTES, MIXTRAL_FLOPS_PER_TOKEN), token_bytes=4096 * 2)
    knee, tokens = model.curve.knee_tokens, [200.0, 190.0, 180.0, 10.0, 5.0, 1.0]
    reads_only = place([[1] * 6], [tokens], gpus(3), MIB, min_replica_load=knee)
    with_wire = place([[1] * 6], [tokens], gpus(3), MIB, min_replica_load=knee, wire_cost=model.wire_cost)
    assert reads_only.gpu_of[(0, 3, 0)] == reads_only.gpu_of[(0, 0, 0)]  # 10 tokens beside 200
    pairs = {with_wire.gpu_of[(0, light, 0)]: with_wire.gpu_of[(0, heavy, 0)] for light, heavy in ((3, 2), (4, 1), (5, 0))}
    assert all(a == b for a, b in pairs.items())

    def layer_seconds(p):
        on = [int(p.gpu_of[(0, e, 0)][1:]) for e in range(6)]
        return model.layer_seconds(on, [tokens])[0]

    assert layer_seconds(with_wire) < layer_seconds(reads_only)
    with pytest.raises(ValueError, match="wire_cost"):
        place([[1]], [[1.0]], gpus(1), MIB, wire_cost=-1)


def test_what_does_not_fit_is_reported_and_scale_out_gives_way_to_every_experts_first_replica():
    p = place([[2, 1]], [[4.0, 1.0]], gpus(2, experts_each=1), MIB)
    assert p.unplaced == ((0, 0, 1),) and set(p.gpu_memory.values()) == {MIB}
    # Across layers too: layer 0's hot expert does not take the memory layer 1's experts need.
    p = place([[3, 1], [1, 1]], [[9.0, 1.0], [1.0, 1.0]], gpus(4, experts_each=1), MIB)
    assert p.unplaced == ((0, 0, 1), (0, 0, 2)) and {(l, e) for l, e, _ in p.gpu_of} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    p = place([[1, 1, 1]], [[3.0, 2.0, 1.0]], gpus(2, experts_each=1), MIB)
    assert p.unplaced == ((0, 2, 0),)  # too little for every expert: the least loaded waits


def test_held_warm_replicas_keep_their_memory_and_are_reused_without_more():
    # The operator's warm pool: services kept for keepAlive hold their GPU whether reused or not.
    warm = {(0, 0): ("g0",), (0, 1): ("g1",)}
    p = place([[1, 0]], [[4.0, 0.0]], gpus(2, experts_each=1), MIB, warm, warm_held=True)
    assert p.gpu_of == {(0, 0, 0): "g0"} and p.warm_reused == 1 and p.gpu_memory == {"g0": MIB, "g1": MIB}
    # Expert 1's warm replica still holds g1: expert 0's scale-out replica finds no room.
    p = place([[2, 0]], [[4.0, 0.0]], gpus(2, experts_each=1), MIB, warm, warm_held=True)
    assert p.unplaced == ((0, 0, 1),)
    # Two warm replicas of one expert on one GPU (nothing else had room) both stay where they are.
    p = place([[2]], [[4.0]], gpus(2, experts_each=2), MIB, {(0, 0): ("g0", "g0"), (0, 1): ("g1", "g1")},
              warm_held=True)
    assert sorted(p.gpu_of.values()) == ["g0", "g0"] and p.warm_reused == 2 and p.unplaced == ()


def test_a_faster_gpu_takes_more_load():
    fast = [GPU("big", "n0", 100 * MIB, capacity=3.0), GPU("small", "n0", 100 * MIB)]
    p = place([[1, 1, 1, 1]], [[1.0, 1.0, 1.0, 1.0]], fast, MIB)
    assert sum(g == "big" for g in p.gpu_of.values()) == 3


shapes = st.tuples(st.integers(1, 3), st.integers(1, 8)).flatmap(lambda s: st.tuples(
    st.lists(st.lists(st.integers(1, 4), min_size=s[1], max_size=s[1]), min_size=s[0], max_size=s[0]),
    st.lists(st.lists(st.floats(0, 100), min_size=s[1], max_size=s[1]), min_size=s[0], max_size=s[0])))


@settings(max_examples=200, deadline=None)
@given(shape=shapes, gpu_count=st.integers(1, 6), experts_each=st.integers(1, 8),
       warm_seed=st.lists(st.integers(0, 5), max_size=20))
def test_placer_never_exceeds_memory_and_loses_nothing(shape, gpu_count, experts_each, warm_seed):
    replicas, loads = shape
    pool = gpus(gpu_count, experts_each)
    warm = {}
    for i, g in enumerate(warm_seed):
        layer, expert = i % len(replicas), (i * 7) % len(replicas[0])
        warm.setdefault((layer, expert), []).append(f"g{g}")  # some name GPUs that no longer exist
    p = place(replicas, loads, pool, MIB, warm)
    used = {g.id: 0 for g in pool}
    for gpu in p.gpu_of.values():
        used[gpu] += MIB
    assert used == dict(p.gpu_memory) and all(used[g.id] <= g.memory_bytes for g in pool)
    wanted = {(l, e, i) for l, row in enumerate(replicas) for e, c in enumerate(row) for i in range(c)}
    assert set(p.gpu_of) | set(p.unplaced) == wanted and not set(p.gpu_of) & set(p.unplaced)
    if p.unplaced:  # only when memory ran out
        assert sum(used.values()) > (sum(g.memory_bytes for g in pool) - MIB)


@settings(max_examples=200, deadline=None)
@given(shape=shapes, gpu_count=st.integers(4, 8), warm_gpus=st.lists(st.integers(0, 7), min_size=1, max_size=3))
def test_with_room_warm_replicas_are_reused_and_replicas_of_an_expert_spread(shape, gpu_count, warm_gpus):
    replicas, loads = shape
    pool = gpus(gpu_count)
    warm_ids = tuple(dict.fromkeys(f"g{g % gpu_count}" for g in warm_gpus))
    p = place(replicas, loads, pool, MIB, {(0, 0): warm_ids})
    on = [p.gpu_of[(0, 0, i)] for i in range(replicas[0][0])]
    assert len(set(on)) == len(on)  # never two replicas of one expert on one GPU while others have room
    assert len(set(on) & set(warm_ids)) == min(len(on), len(warm_ids)) == p.warm_reused


@settings(max_examples=200, deadline=None)
@given(shape=shapes, gpu_count=st.integers(1, 6), experts_each=st.integers(1, 8), held=st.booleans(),
       warm_seed=st.lists(st.integers(0, 5), max_size=6))
def test_every_expert_keeps_a_replica_while_memory_holds_one_each(shape, gpu_count, experts_each, held, warm_seed):
    replicas, loads = shape
    pool = gpus(gpu_count, experts_each)
    warm = {}
    for i, g in enumerate(warm_seed):
        warm.setdefault((i % len(replicas), (i * 3) % len(replicas[0])), []).append(f"g{g}")
    p = place(replicas, loads, pool, MIB, warm, warm_held=held)
    experts = {(l, e) for l, row in enumerate(replicas) for e in range(len(row))}
    held_slots = sum(1 for ids in warm.values() for g in ids if int(g[1:]) < gpu_count) if held else 0
    if len(experts) <= gpu_count * experts_each - held_slots:
        assert {(l, e) for l, e, _ in p.gpu_of} == experts
    assert all(used <= g.memory_bytes or held for g, used in zip(pool, p.gpu_memory.values()))
