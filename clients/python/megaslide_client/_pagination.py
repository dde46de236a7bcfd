"""Cursor pages: `list()` calls return one page that iterates over every item of every page.

The server's list shape is `{"object": "list", "data": [...], "first_id", "last_id", "has_more"}`
and the next page is requested with `after=<last id>`. Lists without `has_more` (models) are a
single page. Which page comes next is decided here once; the sync and async pages only differ in
how they fetch it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Generic, TypeVar

from .types import APIObject

T = TypeVar("T", bound=APIObject)


class CursorPage(Generic[T]):
    """One page of a list: `data`, `has_more`, `first_id`, `last_id`."""

    def __init__(self, body: dict, item_type: type[T]) -> None:
        self.object: str = body.get("object", "list")
        self.data: list[T] = [item_type.from_dict(item) for item in body.get("data", [])]
        self.has_more: bool = bool(body.get("has_more", False))
        self.first_id: str | None = body.get("first_id")
        self.last_id: str | None = body.get("last_id")

    def next_cursor(self) -> str | None:
        """The `after` value for the next page, or None on the last page."""
        if not self.has_more or not self.data:
            return None
        return self.last_id or getattr(self.data[-1], "id", None)

    def has_next_page(self) -> bool:
        return self.next_cursor() is not None

    def _require_next_cursor(self) -> str:
        cursor = self.next_cursor()
        if cursor is None:
            raise RuntimeError("no next page; check has_next_page() first")
        return cursor

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(data={self.data!r}, has_more={self.has_more})"


class SyncCursorPage(CursorPage[T]):
    """A page that fetches the following pages while you iterate over it."""

    def __init__(
        self, body: dict, item_type: type[T], fetch: Callable[[str], SyncCursorPage[T]]
    ) -> None:
        super().__init__(body, item_type)
        self._fetch = fetch

    def next_page(self) -> SyncCursorPage[T]:
        return self._fetch(self._require_next_cursor())

    def iter_pages(self) -> Iterator[SyncCursorPage[T]]:
        page: SyncCursorPage[T] = self
        while True:
            yield page
            if not page.has_next_page():
                return
            page = page.next_page()

    def __iter__(self) -> Iterator[T]:  # type: ignore[override]
        for page in self.iter_pages():
            yield from page.data


class AsyncCursorPage(CursorPage[T]):
    """Async twin of SyncCursorPage: `async for item in page` walks every page."""

    def __init__(
        self,
        body: dict,
        item_type: type[T],
        fetch: Callable[[str], Awaitable[AsyncCursorPage[T]]],
    ) -> None:
        super().__init__(body, item_type)
        self._fetch = fetch

    async def next_page(self) -> AsyncCursorPage[T]:
        return await self._fetch(self._require_next_cursor())

    async def iter_pages(self) -> AsyncIterator[AsyncCursorPage[T]]:
        page: AsyncCursorPage[T] = self
        while True:
            yield page
            if not page.has_next_page():
                return
            page = await page.next_page()

    async def __aiter__(self) -> AsyncIterator[T]:
        async for page in self.iter_pages():
            for item in page.data:
                yield item


class AsyncPaginator(Generic[T]):
    """What async `list()` returns: `await` it for the first page, or `async for` over all items."""

    def __init__(self, first: Callable[[], Awaitable[AsyncCursorPage[T]]]) -> None:
        self._first = first

    def __await__(self):
        return self._first().__await__()

    async def __aiter__(self) -> AsyncIterator[T]:
        page = await self._first()
        async for item in page:
            yield item
