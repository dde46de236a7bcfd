"""The event feed behind SSE streams: one poll of the store for every stream of a process, each
stream told its own job's events and its new queue position, a limit of streams per key."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import pytest

from megaslide.server.errors import TooManyStreams
from megaslide.server.feed import EventFeed
from megaslide.server.store import JobStore

INTERVAL_S = 0.02


class CountingVideos:
    """The feed's store calls, counted."""

    def __init__(self, store: JobStore):
        self.store, self.calls = store, Counter()

    async def last_event_seq(self):
        self.calls["last_event_seq"] += 1
        return self.store.videos.last_event_seq()

    async def events_since(self, after_seq, limit):
        self.calls["events_since"] += 1
        return self.store.videos.events_since(after_seq, limit)

    async def queue_positions(self):
        self.calls["queue_positions"] += 1
        return self.store.videos.queue_positions()


class CountingStore:
    """What the feed reads of an `AsyncStore`: its videos' calls, counted."""

    def __init__(self, store: JobStore, videos: type[CountingVideos] = CountingVideos):
        self.videos = videos(store)
        self.calls = self.videos.calls


def drain(sub) -> list:
    out = []
    while not sub.inbox.empty():
        out.append(sub.inbox.get_nowait())
    return out


def test_one_poll_feeds_every_stream_its_own_news(tmp_path):
    store = JobStore(f"sqlite:///{tmp_path / 'db'}")
    ids = [f"video_{i}" for i in range(200)]
    for i, video_id in enumerate(ids):
        store.videos.insert(video_id, {"model": "m", "seed": i})
    counting = CountingStore(store)
    feed = EventFeed(counting, INTERVAL_S, max_streams=1000)

    async def scenario():
        with contextlib.ExitStack() as stack:
            subs = [stack.enter_context(feed.subscribe(v, "-")) for v in ids]
            await asyncio.sleep(5 * INTERVAL_S)
            first = [drain(s) for s in subs]
            [claimed] = store.videos.claim("w", ["m"], 1, lambda r: 0, lease_s=60)
            start = time.monotonic()
            await asyncio.sleep(10 * INTERVAL_S)
            polls = counting.calls["events_since"]
            return first, [drain(s) for s in subs], claimed, polls, time.monotonic() - start

    first, later, claimed, polls, seconds = asyncio.run(scenario())
    assert all(news == [("position", n)] for n, news in enumerate(first, start=1))
    assert claimed.id == ids[0]
    [(kind, row)] = later[0]  # the started video: its own event, nothing else
    assert kind == "event" and row.type == "video.in_progress" and row.job_id == ids[0]
    # Everyone behind it moved up one place; nobody got another video's events.
    assert all(news == [("position", n)] for n, news in enumerate(later[1:], start=1))
    # A poll per interval for all 200 streams, not one per stream.
    assert polls <= (5 + 10) * 2 + 2 and polls <= seconds / INTERVAL_S + 12
    assert counting.calls["queue_positions"] <= 3  # once at the start, once after the claim
    assert feed.streams == 0
    store.close()


def test_each_key_may_hold_so_many_streams(tmp_path):
    store = JobStore(f"sqlite:///{tmp_path / 'db'}")
    feed = EventFeed(CountingStore(store), INTERVAL_S, max_streams=2)

    async def scenario():
        with feed.subscribe("a", "alice"), feed.subscribe("b", "alice"):
            with pytest.raises(TooManyStreams, match="2 event streams open"):
                feed.admit("alice")
            feed.admit("bob")  # another key is not held back
            with feed.subscribe("c", "bob"):
                assert feed.streams == 3
        feed.admit("alice")  # closed streams free their places
        with feed.subscribe("c", "alice"):
            return feed.streams

    assert asyncio.run(scenario()) == 1
    store.close()


def test_the_streams_of_all_keys_together_are_capped(tmp_path):
    """Many keys each within its own limit still meet the process's cap, checked as a stream
    takes its place (no await between check and count)."""
    store = JobStore(f"sqlite:///{tmp_path / 'db'}")
    feed = EventFeed(CountingStore(store), INTERVAL_S, max_streams=2, max_total=3)

    async def scenario():
        with feed.subscribe("a", "alice"), feed.subscribe("b", "alice"):
            with feed.subscribe("c", "bob"):
                with pytest.raises(TooManyStreams, match="this server holds 3 event streams"):
                    with feed.subscribe("d", "carol"):
                        pass
                assert feed.streams == 3
            with feed.subscribe("d", "carol"):  # a place freed
                return feed.streams

    assert asyncio.run(scenario()) == 3
    store.close()


def test_an_event_written_before_the_feed_first_looks_still_reaches_the_stream(tmp_path):
    """A stream replays the store, then takes what the feed hands it; the feed starts from where
    the log ends at its first poll. An event written after a replay's read but before that poll
    (the worker claiming the video, say) reached neither, unless the replay waits for the feed
    to be watching."""
    from megaslide.server.routers.videos import _sse
    from megaslide.server.store import AsyncStore
    from megaslide.server.store.async_store import AsyncVideoStore

    store = JobStore(f"sqlite:///{tmp_path / 'db'}")
    store.videos.insert("video_1", {"model": "m", "seed": 0})

    class ClaimAfterTheReplay(AsyncVideoStore):
        async def events_after(self, *args, **kwargs):
            rows = store.videos.events_after(*args, **kwargs)
            store.videos.claim("w", ["m"], 1, lambda r: 0, lease_s=60)  # just after the read
            return rows

    class SlowFirstLook(CountingVideos):
        async def last_event_seq(self):
            await asyncio.sleep(5 * INTERVAL_S)  # the feed's first look comes late (a busy store)
            return await super().last_event_seq()

    feed = EventFeed(CountingStore(store, SlowFirstLook), INTERVAL_S, max_streams=10)
    replaying = AsyncStore(store)
    replaying.videos = ClaimAfterTheReplay(store.videos, inline_reads=True)

    async def scenario():
        seen = []
        with feed.subscribe("video_1", "-") as sub:
            stream = _sse(replaying, "video_1", 0, sub)
            with contextlib.suppress(TimeoutError):
                while len(seen) < 2:
                    chunk = await asyncio.wait_for(anext(stream), 20 * INTERVAL_S)
                    seen += [line[7:] for line in chunk.splitlines() if line.startswith("event:")]
            await stream.aclose()
        return seen

    assert asyncio.run(scenario()) == ["video.queued", "video.in_progress"]
