"""Example third-party DeepInfer model (see README.md)."""
