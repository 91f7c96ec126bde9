"""Building a TensorRT-LLM engine from a checkpoint folder (`checkpoint.py` writes it).

The settings are plain data (tested without TensorRT-LLM); `build_engine` hands them to TensorRT-LLM
1.2's Python builder, the path `trtllm-build` takes: `PretrainedConfig.from_json_file` → the
architecture's `from_checkpoint` (which quantizes int8 itself and lays out our grouped int4) →
`tensorrt_llm.builder.build` → `Engine.save`, the folder the C++ executor loads. `BuildConfig` is a
pydantic model in 1.2 (a dataclass before): it is made from keywords and its plugin settings set by
attribute, which both kinds take. Not run here: TensorRT-LLM cannot be installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLUGINS = {  # the executor's in-flight batching needs the attention plugin, a paged KV cache and packed inputs
    "gpt_attention_plugin": "auto", "gemm_plugin": "auto", "paged_kv_cache": True, "remove_input_padding": True,
    "context_fmha": True, "use_paged_context_fmha": True,
}


def build_settings(max_batch: int, context: int, image_queries: int = 0) -> dict[str, Any]:
    """`BuildConfig` fields: `max_batch` sequences of up to `context` positions (a prompt may use all but
    one); image chat adds a prompt-table row for each of `image_queries` per sequence in the batch."""
    return {
        "max_batch_size": max_batch,
        "max_input_len": context - 1,
        "max_seq_len": context,
        "max_num_tokens": max(context, 8192),
        "max_beam_width": 1,
        "max_prompt_embedding_table_size": max_batch * image_queries,
        "plugin_config": dict(PLUGINS),
    }


def build_engine(checkpoint_dir: Path, engine_dir: Path, settings: dict[str, Any]) -> None:
    from tensorrt_llm.builder import BuildConfig, build
    from tensorrt_llm.models import MODEL_MAP, PretrainedConfig

    config = PretrainedConfig.from_json_file(str(Path(checkpoint_dir) / "config.json"))
    model = MODEL_MAP[config.architecture].from_checkpoint(str(checkpoint_dir), config=config)
    fields = {k: v for k, v in settings.items() if k != "plugin_config"}
    build_config = BuildConfig(**fields)
    for name, value in settings["plugin_config"].items():
        setattr(build_config.plugin_config, name, value)
    build(model, build_config).save(str(engine_dir))
