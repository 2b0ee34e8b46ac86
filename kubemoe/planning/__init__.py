"""Planning: from per-expert loads to replicas, their GPUs and what that costs. Pure: no I/O, no torch.

Used by the operator (warm pool per window), the frontend's dispatcher (split per iteration), the
simulator (`benchmarks/moeless_sim.py`) and `kubemoe plan`. One module per concept:

- `scaler`: MoEless Algorithm 1, replicas per expert until a layer's per-replica loads are even enough.
- `placer`: MoEless Algorithm 2, replicas onto GPUs: warm first, then join-the-shortest-queue.
- `split`: per iteration, which of an expert's warm replicas its tokens go to.
- `baselines`: static expert parallelism, DeepSeek's EPLB, the oracle.
- `latency`: MoEless's latency and cost model with the H200's measured expert curve.

Notation: L = MoE layers, E = experts per layer, R = replicas, G = GPUs.
"""
