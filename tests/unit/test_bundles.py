import pytest

from kubemoe.bundles import bundles_by_bytes, bundles_by_count, format_bundle_spec, parse_bundle_spec


def test_bundles_by_bytes_group_small_experts_and_isolate_large_ones():
    small = bundles_by_bytes([1, 2], num_experts=8, expert_bytes=9, bundle_bytes=30)
    assert [b.name for b in small[:3]] == ["l1-e0-2", "l1-e3-5", "l1-e6-7"]
    assert sum(len(b.experts) for b in small) == 16
    large = bundles_by_bytes([0], num_experts=4, expert_bytes=336, bundle_bytes=256)
    assert [b.experts for b in large] == [((0, e),) for e in range(4)]


def test_bundles_by_count_cover_every_expert_once():
    bundles = bundles_by_count([1, 3], num_experts=8, count=3)
    keys = [k for b in bundles for k in b.experts]
    assert sorted(keys) == [(l, e) for l in (1, 3) for e in range(8)]
    with pytest.raises(ValueError):
        bundles_by_count([1], 4, 5)


def test_spec_round_trip():
    keys = parse_bundle_spec("1:0-3,6;3:*", moe_layers=(1, 3), num_experts=8)
    assert keys[:5] == ((1, 0), (1, 1), (1, 2), (1, 3), (1, 6))
    assert format_bundle_spec(keys) == "1:0-3,6;3:0-7"
    assert parse_bundle_spec(format_bundle_spec(keys), (1, 3), 8) == keys
    assert len(parse_bundle_spec("*", (1, 3), 8)) == 16


@pytest.mark.parametrize("spec, message", [
    ("0:1", "not an MoE layer"), ("1:9", "out of range"), ("1", "LAYER:EXPERTS"), ("1:a", "ids and ranges"),
    ("1:0;1:0", "twice"), (";", "no expert"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_bundle_spec(spec, (1, 3), 8)
