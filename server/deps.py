"""Dependencies shared by the routers: the store, the workers, the settings, the data directory,
the principal an API key stands for, its Idempotency-Key, and the services (services/)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .auth import ANONYMOUS, Keyring, Principal
from .datadir import DataDir
from .errors import Unauthorized
from .links import LinkSigner
from .protocol import WorkerClient
from .services.adapters import Adapters
from .services.files import Files
from .services.fine_tuning import FineTuning
from .services.idempotency import IdempotencyKey
from .services.videos import Videos
from .services.webhooks import Webhooks
from .settings import Settings
from .store import AsyncStore

# The dependencies are coroutines, though none awaits: FastAPI runs a plain function in its
# thread pool, one hop per dependency per request, which is most of a status poll's cost.


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_store(request: Request) -> AsyncStore:
    return request.app.state.store


async def get_workers(request: Request) -> WorkerClient:
    return request.app.state.workers


async def get_data(request: Request) -> DataDir:
    return request.app.state.data


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[AsyncStore, Depends(get_store)]
WorkersDep = Annotated[WorkerClient, Depends(get_workers)]
DataDep = Annotated[DataDir, Depends(get_data)]


# Declares the bearer scheme in the OpenAPI schema; the header is read below, so that a missing
# or wrong key gets the envelope 401 (and no key is needed when none are configured).
bearer = HTTPBearer(
    auto_error=False,
    description="an API key, when the server has keys (`--api-keys`, `--api-keys-file`)",
)


async def require_api_key(
    request: Request, _declared: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    """With keys configured, every request must carry `Authorization: Bearer <key>`; the key's
    principal (auth.py) is what the request acts for."""
    keyring: Keyring = request.app.state.keyring
    request.state.principal = ANONYMOUS
    if not keyring.enabled:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("Missing bearer authentication in header (Authorization: Bearer <key>)")
    principal = keyring.principal(token.strip())
    if principal is None:
        raise Unauthorized("Incorrect API key provided")
    request.state.principal = principal


async def require_key_or_link(
    request: Request, declared: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    """A video's content: a key, as everywhere, or a signed link to it (links.py), which a
    `<video src>` can follow."""
    query = request.query_params
    if "signature" not in query:
        await require_api_key(request, declared)
        return
    links: LinkSigner = request.app.state.links
    video_id = request.path_params["video_id"]
    if not links.valid(
        video_id, query.get("variant", "video"), query.get("expires", ""), query["signature"]
    ):
        raise Unauthorized("The link is not valid for this content or has expired")
    request.state.principal = ANONYMOUS  # the link stands for the key that asked for it


def principal_of(request: Request) -> Principal:
    return getattr(request.state, "principal", ANONYMOUS)


async def get_principal(request: Request) -> Principal:
    return principal_of(request)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def get_idempotency_key(request: Request) -> IdempotencyKey | None:
    """The request's `Idempotency-Key`, scoped to its principal and route; None without one."""
    key = request.headers.get("idempotency-key")
    if not key:
        return None
    return IdempotencyKey(principal_of(request).scope, f"{request.method} {request.url.path}:{key}")


IdempotencyKeyDep = Annotated[IdempotencyKey | None, Depends(get_idempotency_key)]


# Each request gets its own service objects, over what the app holds now (the store and the
# validator exist once the lifespan has started).


async def get_videos(request: Request) -> Videos:
    state = request.app.state
    return Videos(state.store, state.workers, state.settings, state.data)


async def get_files(request: Request) -> Files:
    state = request.app.state
    return Files(state.store, state.data, state.validator)


async def get_fine_tuning(request: Request) -> FineTuning:
    state = request.app.state
    return FineTuning(state.store, state.workers, state.settings, state.data)


async def get_adapters(request: Request) -> Adapters:
    state = request.app.state
    return Adapters(state.store, state.workers, state.settings, state.data)


async def get_webhooks(request: Request) -> Webhooks:
    state = request.app.state
    return Webhooks(state.store, state.settings)


VideosDep = Annotated[Videos, Depends(get_videos)]
FilesDep = Annotated[Files, Depends(get_files)]
FineTuningDep = Annotated[FineTuning, Depends(get_fine_tuning)]
AdaptersDep = Annotated[Adapters, Depends(get_adapters)]
WebhooksDep = Annotated[Webhooks, Depends(get_webhooks)]
