import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.llm.demo import demo_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def studio_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("studio-cache")


@pytest.fixture(scope="session")
def qwen_v1_demo(studio_cache) -> Path:
    return demo_model_dir("demo/qwen-v1-tiny", studio_cache)


@pytest.fixture(scope="session")
def qwen2_demo(studio_cache) -> Path:
    return demo_model_dir("demo/qwen2-tiny", studio_cache)
