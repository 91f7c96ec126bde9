"""The model manager's seam: what the service and the Models tab need of the composition root's
`studio.model_catalog.ModelCatalog`, as a protocol (the service layer imports nothing above it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from pipeline.models import ModelEntry
from pipeline.service.tools import Tool, ToolSpec


class Catalog(Protocol):
    """The model manager (`studio.model_catalog.ModelCatalog`, made by the composition root): what each
    tool runs, the models found, switching, downloading and deleting. The Models tab uses only these."""

    budget: int | None  # the tools' memory budget in bytes (None: no limit)

    def current(self, tool: Tool) -> str | None: ...

    def servable(self) -> list[str]: ...

    def models(self) -> list[ModelEntry]: ...

    def refresh(self) -> list[ModelEntry]: ...

    def specs_for(self, tool: Tool, model_id: str) -> list[ToolSpec]: ...

    def download(self, repo_id: str, say: Callable[[str], None], cancel: threading.Event) -> Path: ...

    def cancel_first_use(self) -> bool: ...

    def delete_plan(self, model_id: str) -> tuple[ModelEntry, str]: ...

    def delete(self, model_id: str) -> str: ...
