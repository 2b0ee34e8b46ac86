"""On a GPU (-m gpu, the lent H200): a frontend on CUDA records and predicts what one on the CPU does."""

from __future__ import annotations

import pytest
import torch

from kubemoe.frontend.predictor import LoadPredictor
from kubemoe.frontend.model_shape import ModelShape
from kubemoe.frontend.records import RoutingRecords
from kubemoe.frontend.sampling import SamplingParams

pytestmark = pytest.mark.gpu


async def test_predictions_and_records_on_cuda_match_the_cpu(make_frontend, tmp_path):
    frontends = {d: make_frontend(device=d, record_routing=tmp_path / d, predictor_refresh=False) for d in ("cpu", "cuda")}
    prompt = frontends["cpu"].tokenizer("import torch\nx = torch.ones(3)")["input_ids"]
    for frontend in frontends.values():
        async for _ in frontend.engine.generate("r", prompt, SamplingParams(max_tokens=4, temperature=0.0)):
            pass
        frontend.recorder.close()
    records = {d: RoutingRecords.load(tmp_path / d, ModelShape.of(f.adapter)) for d, f in frontends.items()}
    assert torch.equal(records["cpu"].experts, records["cuda"].experts)
    assert torch.allclose(records["cpu"].hidden, records["cuda"].hidden, rtol=1e-3, atol=1e-4)
    reports = {d: f.loads.report() for d, f in frontends.items()}
    predicted = {d: [(l.layer, l.expert, l.predicted_tokens) for l in r.loads] for d, r in reports.items()}
    assert predicted["cpu"] == predicted["cuda"] and reports["cuda"].predictions[0].tokens > 0
    online = frontends["cuda"].online_predictor.predictor
    assert next(online.heads[1].parameters()).is_cuda
    assert isinstance(online, LoadPredictor)
