"""The composition root: turns options into a running studio (`compose.build`), the backend factory
(`backends`: which engine runs each tool, and its loaders), the cached quantized weights and the engines'
self-test. Above `pipeline/` and `engine_builder/`, below `app/` and `launch.py`."""
