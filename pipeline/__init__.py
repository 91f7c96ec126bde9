"""Pipelines: what the UI calls. Each pipeline = pre/post-processing + one backend."""
