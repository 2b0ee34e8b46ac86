"""The offload path's pure decision parts (LayerScope): cost figures, hot-expert table, PreSched and the
baseline policies behind one interface, and a step-time model. No GPU code: executors come later."""
