"""kubemoe: serve Mixture-of-Experts language models on Kubernetes."""

# The components live in top-level folders (proto/, expert_fn/, frontend/, operator/); the links
# kubemoe/<name> -> ../<folder> make them subpackages here in a source checkout, as they are in a wheel.

__version__ = "0.1.0"
