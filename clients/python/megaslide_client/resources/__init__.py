"""Resources of the API, each a sync class and its async twin."""

from .adapters import Adapters, AsyncAdapters
from .files import AsyncFiles, Files
from .fine_tuning import AsyncFineTuning, AsyncJobs, FineTuning, Jobs
from .models import AsyncModels, Models
from .videos import AsyncVideos, Videos
from .webhooks import AsyncEndpoints, AsyncWebhooks, Endpoints, Webhooks

__all__ = [
    "Videos",
    "AsyncVideos",
    "Files",
    "AsyncFiles",
    "FineTuning",
    "AsyncFineTuning",
    "Jobs",
    "AsyncJobs",
    "Models",
    "AsyncModels",
    "Adapters",
    "AsyncAdapters",
    "Webhooks",
    "AsyncWebhooks",
    "Endpoints",
    "AsyncEndpoints",
]
