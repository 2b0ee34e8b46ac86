"""`kubemoe predictor collect`: drive a checkpoint over a text file and write its routing records.

It runs the frontend's own model shell and dispatcher with every expert in process, so the records
are exactly what a serving frontend with `--record-routing` writes; the text is cut into requests
of `seq_len` tokens and prefilled `batch` at a time (teacher forcing: no sampling involved).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kubemoe.bundles import bundles_by_count
from kubemoe.errors import KubemoeError
from kubemoe.frontend.records import ForwardRows


@dataclass(frozen=True)
class CollectReport:
    requests: int
    rows: int
    shards: int
    megabytes: float
    seconds: float


def read_token_ids(tokenizer, text_file: Path, max_tokens: int) -> list[int]:
    text = Path(text_file).read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise KubemoeError(f"{text_file} holds no text: give a text file with some prose or code to drive the model over")
    return tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]


def collect_records(checkpoint: Path, text_file: Path, out: Path, max_tokens: int = 200_000, seq_len: int = 256,
                    batch: int = 8, device: str = "auto", dtype: str | None = None, max_mb: int = 1024) -> CollectReport:
    from kubemoe.frontend.app import Frontend, FrontendConfig
    from kubemoe.routing_table import LOCAL, table_for_bundles

    if seq_len < 1 or batch < 1 or max_tokens < 1:
        raise KubemoeError("--seq-len, --batch and --max-tokens must be positive")
    frontend = Frontend(FrontendConfig(checkpoint=checkpoint, predictor="none", record_routing=out,
                                       record_max_mb=max_mb, device=device, dtype=dtype))
    try:
        recorder = frontend.recorder
        if recorder is None:  # record_routing above makes one; without it nothing would be written
            raise RuntimeError("the frontend built for collecting has no routing recorder")
        ids = read_token_ids(frontend.tokenizer, text_file, max_tokens)
        seq_len = min(seq_len, frontend.max_context)
        sequences = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)] or [ids]
        bundles = bundles_by_count(frontend.adapter.moe_layers, frontend.adapter.num_experts, 1)
        frontend.set_routing_table(table_for_bundles(frontend.model_id, bundles, {b.name: [LOCAL] for b in bundles}))
        start = time.perf_counter()
        with torch.inference_mode():
            for first in range(0, len(sequences), batch):
                group = sequences[first:first + batch]
                recorder.start_forward(ForwardRows(tuple(f"text-{first + i}" for i in range(len(group))),
                                                   (0,) * len(group), tuple(map(len, group))))
                frontend.model(input_ids=torch.tensor(group, device=frontend.device), use_cache=False)
                if recorder.full:
                    break
        recorder.close()
        return CollectReport(recorder.requests_seen, recorder.rows_written, recorder.shards,
                             recorder.written_bytes / 2**20,
                             time.perf_counter() - start)
    finally:
        frontend.close()
