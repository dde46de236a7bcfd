"""One router per resource: videos, files, fine-tuning jobs, models, and health/metrics."""
