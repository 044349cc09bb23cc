"""GET /: the built-in page (kvserve/server/page/, shipped as package data): a chat playground
and a live view of the engine's /metrics. Static files only, served by this app: no build
step, nothing fetched from a CDN, so it works on a machine with no internet."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

PAGE_DIR = Path(__file__).resolve().parent / "page"


def install_page(app: FastAPI) -> None:
    """``/`` answers the page; its script and style come from ``/page/``."""
    index = PAGE_DIR / "index.html"

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        # Revalidated on each load: a browser keeps no stale page across server upgrades.
        return FileResponse(index, media_type="text/html", headers={"Cache-Control": "no-cache"})

    app.mount("/page", StaticFiles(directory=PAGE_DIR), name="page")
