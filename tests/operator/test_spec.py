import pytest

from kubemoe.operator.spec import MoESpec, ModelSource, SpecError, parse_bytes, parse_duration


def test_minimal_spec_gets_the_documented_defaults(f):
    spec = MoESpec.parse({"model": {"uri": "pvc://models/m", "layout": {
        "moeLayers": [0], "expertsPerLayer": 8, "expertBytes": 1024}}})
    assert spec.mode == "distributed" and spec.dtype == "bfloat16"
    assert spec.experts.runtime == "knative" and spec.experts.bundle_bytes == 256 * 2**20
    assert spec.experts.scaling.keep_alive_s == 600 and spec.experts.scaling.max_replicas_per_expert == 8
    assert spec.frontend.replicas == 1 and spec.offload is None and spec.gpu_hour_price == 0.0


@pytest.mark.parametrize("uri, expected", [
    ("pvc://models/mixtral-8x7b", ModelSource("pvc", "models", "mixtral-8x7b")),
    ("pvc://models", ModelSource("pvc", "models", "")),
    ("hostpath:///data/ckpt/", ModelSource("hostpath", "/data/ckpt", "")),
    ("s3://bucket/mixtral", ModelSource("s3", "s3://bucket/mixtral", "")),
    ("gs://bucket/qwen", ModelSource("gs", "gs://bucket/qwen", "")),
])
def test_model_uris(uri, expected):
    assert ModelSource.parse(uri) == expected


@pytest.mark.parametrize("uri", ["hf://mistralai/Mixtral", "models/mixtral", "pvc://", "hostpath://relative"])
def test_model_uris_that_cannot_be_served_say_what_to_write(uri):
    with pytest.raises(SpecError, match="pvc://|absolute"):
        ModelSource.parse(uri)


def test_units():
    assert parse_duration("1h30m", "x") == 5400 and parse_duration("90s", "x") == 90
    assert parse_bytes("1Gi", "x") == 2**30 and parse_bytes(352321536, "x") == 352321536
    with pytest.raises(SpecError, match="duration"):
        parse_duration("10 minutes", "keepAlive")
    for bad in ("lots", "500m", "0.5"):
        with pytest.raises(SpecError, match="positive whole number of bytes"):
            parse_bytes(bad, "bundleBytes")
    assert parse_bytes("1.5Gi", "x") == 3 * 2**29  # a fraction of a unit that is whole bytes
    with pytest.raises(SpecError, match="whole seconds"):
        parse_duration("1500ms", "keepAlive")


def test_offload_mode_needs_its_section(f):
    with pytest.raises(SpecError, match="gpuMemoryBudget"):
        MoESpec.parse(f.moed_body(mode="offload")["spec"])


@pytest.mark.parametrize("name", ["mixtral-8x7b", "phi-3.5-moe", "llama-4-scout", "deepseek-v2-lite", "qwen3-30b-a3b",
                                  "moonlight-16b-a3b"])
def test_samples_parse_with_their_real_layouts(f, name):
    spec = MoESpec.parse(f.sample(name)["spec"])
    expected = {"mixtral-8x7b": (32, 8, 3 * 4096 * 14336 * 2), "phi-3.5-moe": (32, 16, 3 * 4096 * 6400 * 2),
                "llama-4-scout": (48, 16, 3 * 5120 * 8192 * 2), "deepseek-v2-lite": (26, 64, 3 * 2048 * 1408 * 2),
                "qwen3-30b-a3b": (48, 128, 3 * 2048 * 768 * 2), "moonlight-16b-a3b": (26, 64, 3 * 2048 * 1408 * 2)}
    layout = spec.layout
    assert (len(layout.moe_layers), layout.experts_per_layer, layout.expert_bytes) == expected[name]
    covered = sorted(key for b in spec.bundles() for key in b.experts)
    assert covered == [(l, e) for l in layout.moe_layers for e in range(layout.experts_per_layer)]
