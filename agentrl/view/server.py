"""The viewer's HTTP side: a FastAPI app (already an agentrl dependency, for `agentrl serve`) with a
small JSON API over `Folder` and the page itself from `static/` (no CDN: it works offline).

Routes: /api/overview, /api/metrics, /api/facets, /api/trajectories (filters, offset, limit),
/api/trajectory/{episode_id}, /api/group/{group_id}?iteration=, /api/results (evaluations). A trajectory comes
with its sequences (spans, why each began, later prompts as context) and its turns' step groups.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.middleware.trustedhost import TrustedHostMiddleware

from agentrl.view.data import MAX_PAGE, Filters, Folder, Unreadable

STATIC = Path(__file__).parent / "static"


def create_app(folder: str | Path) -> FastAPI:
    data = Folder(Path(folder))
    app = FastAPI(title=f"agentrl view {folder}", docs_url=None, redoc_url=None)
    # on loopback, without a key: a web page this machine's browser opens could reach it under a name of its own
    # that resolves to 127.0.0.1 (DNS rebinding) and read the run; only the Host it names tells the two apart
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=["localhost", "127.0.0.1", "[::1]"])

    @app.get("/")
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/api/overview")
    def overview() -> dict[str, Any]:
        return data.overview()

    @app.get("/api/metrics")
    def metrics() -> dict[str, Any]:
        return data.metrics()

    @app.get("/api/facets")
    def facets() -> dict[str, Any]:
        return data.facets()

    @app.get("/api/trajectories")
    def trajectories(
        iteration: int | None = None,
        task: str | None = None,
        group: str | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        failure: str | None = None,
        turns: int | None = None,
        partial: bool | None = None,
        multi: bool | None = None,
        offset: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    ) -> dict[str, Any]:
        f = Filters(
            iteration, task or None, group or None, min_reward, max_reward, failure or None, turns, partial, multi
        )
        return data.trajectories(f, offset, limit)

    @app.get("/api/trajectory/{episode_id}")
    def trajectory(episode_id: str) -> dict[str, Any]:
        try:
            return data.trajectory(episode_id)
        except KeyError:
            raise HTTPException(404, f"no saved trajectory {episode_id}") from None
        except Unreadable as e:  # listed, but its data is gone or torn: said, not a 500
            raise HTTPException(410, str(e)) from None

    @app.get("/api/group/{group_id}")
    def group(group_id: str, iteration: int | None = None) -> dict[str, Any]:
        return data.group(group_id, iteration)

    @app.get("/api/results")
    def results(
        offset: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
        passed: bool | None = None,
    ) -> dict[str, Any]:
        return data.results(offset, limit, passed)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
