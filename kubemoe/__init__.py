"""kubemoe: serve Mixture-of-Experts language models on Kubernetes."""

__version__ = "0.1.0"
