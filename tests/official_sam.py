"""Import the official `segment_anything` model code without its package __init__.

The package's __init__ pulls in the automatic mask generator, which needs torchvision (not
installable beside the CPU torch build used here); the model code itself needs only torch.
"""

import importlib.util
import sys
import types

import pytest


def official_sam_modules():
    if "segment_anything" not in sys.modules:
        spec = importlib.util.find_spec("segment_anything")
        if spec is None:
            pytest.skip("segment-anything is not installed (requirements-dev.txt)")
        package = types.ModuleType("segment_anything")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["segment_anything"] = package
    from segment_anything import modeling

    return modeling
