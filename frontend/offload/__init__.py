"""The offload path (LayerScope). Pure decisions: cost figures, hot-expert table, PreSched and the baseline
policies behind one interface, LLaPor, and a step-time model. Executors: the expert store (host memory,
device slots, chunked copies), CPU experts, the per-layer executor and its assembly (runtime.py)."""
