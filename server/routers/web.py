"""The playground: one page at `/`, its scripts and styles under `/assets`, all from the package.

The page is plain HTML, CSS and JavaScript modules (server/playground/): nothing is built at install
time and nothing is fetched from elsewhere at run time. It is open like `/healthz`: it holds no
data, and with API keys configured it asks for one before it calls `/v1`.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

PLAYGROUND = Path(__file__).resolve().parents[1] / "playground"

router = APIRouter(include_in_schema=False)


@router.api_route("/", methods=["GET", "HEAD"])
async def index():
    # no-cache: the browser revalidates (ETag) so a new version of the page is seen at once.
    return FileResponse(PLAYGROUND / "index.html", headers={"Cache-Control": "no-cache"})


class Revalidated(StaticFiles):
    """Static files the browser revalidates (ETag) before each use, so that after an upgrade a page
    never runs old modules beside new ones."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


def assets() -> StaticFiles:
    """The page's scripts, styles and icon, for `app.mount("/assets", ...)`."""
    return Revalidated(directory=PLAYGROUND / "assets")
