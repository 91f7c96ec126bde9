"""Import the official MobileSAM model code (`mobilesam-mirror`, package `mobile_sam`) for the parity tests.

Two things stand in the way on a CPU torch wheel, and both are side issues of the model code:
- the package's __init__ pulls in the predictor and mask generator, which need torchvision (no wheel of it
  runs beside the CPU torch build used here); the model code itself needs only torch, so it is imported
  without that __init__, as `official_sam.py` does for segment_anything;
- `tiny_vit_sam.py` imports three helpers from timm (which needs torchvision too): `DropPath`, `to_2tuple`
  and `trunc_normal_`, plus the `register_model` decorator. Where timm imports, its own are used; elsewhere
  small stand-ins are registered only while that one module is imported, then removed again, so no other
  test sees a fake `timm`. None of them takes part in an eval-mode forward: the model is built with a
  drop-path rate of 0 (so no `DropPath` exists), `trunc_normal_` only initialises weights (which the tests
  overwrite), `to_2tuple` turns the image size into a pair.
"""

import importlib.util
import sys
import types

import pytest
import torch
from torch import nn


def _timm_stand_ins() -> dict[str, types.ModuleType]:
    class DropPath(nn.Module):
        """Stochastic depth; identity outside training (the only mode the parity tests use)."""

        def __init__(self, drop_prob: float | None = None):
            super().__init__()
            self.drop_prob = drop_prob

        def forward(self, x):
            if self.training and self.drop_prob:
                raise NotImplementedError("the stand-in DropPath is for eval mode only")
            return x

    layers = types.ModuleType("timm.models.layers")
    layers.DropPath = DropPath
    layers.to_2tuple = lambda x: tuple(x) if isinstance(x, (tuple, list)) else (x, x)
    layers.trunc_normal_ = torch.nn.init.trunc_normal_
    registry = types.ModuleType("timm.models.registry")
    registry.register_model = lambda fn: fn
    models = types.ModuleType("timm.models")
    models.layers, models.registry = layers, registry
    timm = types.ModuleType("timm")
    timm.models = models
    return {"timm": timm, "timm.models": models, "timm.models.layers": layers, "timm.models.registry": registry}


def _timm_imports() -> bool:
    try:
        import timm.models.layers  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or installed without a working torchvision
        for name in [n for n in sys.modules if n == "timm" or n.startswith("timm.")]:
            del sys.modules[name]  # a half-imported timm must not shadow the stand-ins
        return False
    return True


def official_mobile_sam():
    """The official `mobile_sam.build_sam` module (its `build_sam_vit_t` builds MobileSAM); skips the calling
    test module without it."""
    if "mobile_sam.build_sam" in sys.modules:
        return sys.modules["mobile_sam.build_sam"]
    spec = importlib.util.find_spec("mobile_sam")
    if spec is None:
        pytest.skip("mobilesam-mirror is not installed (requirements-dev.txt)", allow_module_level=True)
    package = types.ModuleType("mobile_sam")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["mobile_sam"] = package
    stand_ins = {} if _timm_imports() else _timm_stand_ins()
    sys.modules.update(stand_ins)
    try:
        from mobile_sam import build_sam
    finally:
        for name in stand_ins:
            sys.modules.pop(name, None)
    return build_sam
