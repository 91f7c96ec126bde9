"""`/documents/source/{file}`: a cited source's file, opened in the browser from the link under a reply (a PDF at
its page: the link ends `#page=N`, which the browser's viewer reads). Only files of a collection, each by a link
this app signed (`Library.link`), so the route opens nothing else on the machine. A document's HTML is sent as
text: its scripts never run on the app's own address."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import FileResponse, PlainTextResponse, Response

from pipeline.errors import UserError
from pipeline.service.studio import StudioService

SHOWN_AS = {".pdf": "application/pdf"}  # else text, but for Word files, which the browser downloads
DOWNLOADED = {".docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document"}


def mount_documents(app: FastAPI, service: StudioService) -> None:
    @app.get("/documents/source/{file}")
    def source(file: int, key: str = "") -> Response:
        if service.documents is None:
            return PlainTextResponse("this app has no document collections", status_code=404)
        try:
            path = service.documents.source_file(file, key)
        except UserError as e:
            return PlainTextResponse(str(e), status_code=404)
        suffix = path.suffix.lower()
        if suffix in DOWNLOADED:
            return FileResponse(path, media_type=DOWNLOADED[suffix], filename=path.name)
        return FileResponse(path, media_type=SHOWN_AS.get(suffix, "text/plain; charset=utf-8"),
                            content_disposition_type="inline", filename=path.name,
                            headers={"X-Content-Type-Options": "nosniff"})
