"""Everything that runs the models, by layer, each layer importing only those below it:

- shared helpers: `errors`, `files`, `images`, `weights_io`, `cuda_graphs`, `random_weights`;
- model code and its engines, one package per family: `llm` (the decoder, its checkpoints,
  tokenizers, and the batching engine: scheduler, cache rows, model runner), `sam`, `minigpt4`;
  and `models`, which finds their weights (the hub cache, folders, the built-in demos);
- `pipelines`: a tool's work from request to answer over an engine;
- `service`: the tools under a memory budget, and the one way a request is served.

Nothing here imports the front ends (`app/`), the engine builders (`engine_builder/`) or the
composition root (`studio/`); `tests/test_layers.py` checks it.
"""
