"""Fine-tuning jobs: create (the training file and hyperparameters checked against the model),
list, retrieve, cancel, and a job's events and checkpoints."""

from __future__ import annotations

import secrets
from pathlib import Path

from megaslide.engine.request import (
    RANDOM_SEED_BITS,
    RequestError,
    VideoRequest,
    parse_size,
    resolve,
)
from megaslide.engine.training.finetune_spec import OptimizerSpec

from ..auth import Principal
from ..datadir import DataDir
from ..errors import InvalidRequest, NotFound
from ..protocol import ModelCard, WorkerClient
from ..records import FineTuneRecord
from ..schemas import (
    FineTuningJob,
    FineTuningJobCreate,
    Hyperparameters,
    ValidationPrompt,
    checkpoint_object,
    event_object,
    finetune_object,
    page,
)
from ..settings import Settings
from ..store import AsyncStore
from .idempotency import IdempotencyKey, answer_once, create_once
from .jobs import admit, event_seq, new_id, wait_for
from .models import find_model


def resolve_hyperparameters(h: Hyperparameters, card: ModelCard, settings: Settings) -> dict:
    """'auto' becomes the server's default; a training clip shape is checked against the model's
    limits like a video's."""
    width = height = None
    if h.size is not None:
        width, height = parse_size(h.size, "hyperparameters.size")
    limits, defaults = card.limits, card.defaults
    try:
        limits.check_clip(
            h.num_frames or defaults.frames,
            width or defaults.width,
            height or defaults.height,
            param="hyperparameters.size",
        )
    except RequestError as e:
        param = "hyperparameters.num_frames" if e.param == "num_frames" else e.param
        raise RequestError(f"training clips: {e}", param=param) from None
    if limits.experts == 1 and h.expert is not None:
        raise RequestError(
            f"model {card.name} has one denoiser: expert {h.expert!r} names an expert of a "
            "two-expert model (Wan2.2-A14B)",
            param="hyperparameters.expert",
        )
    # A two-expert model trains both unless one is named: the job records which.
    expert = (h.expert or "both") if limits.experts > 1 else None
    return {
        "n_epochs": settings.finetune_epochs if h.n_epochs == "auto" else h.n_epochs,
        "batch_size": 1 if h.batch_size == "auto" else h.batch_size,
        "learning_rate_multiplier": 1.0
        if h.learning_rate_multiplier == "auto"
        else h.learning_rate_multiplier,
        "num_frames": h.num_frames,
        "width": width,
        "height": height,
        "buckets": h.buckets,
        "token_budget": h.token_budget,
        "expert": expert,
        "optimizer_state": OptimizerSpec.state
        if h.optimizer_state == "auto"
        else h.optimizer_state,
        "optimizer_state_tier": OptimizerSpec.state_tier
        if h.optimizer_state_tier == "auto"
        else h.optimizer_state_tier,
        "validation_split": h.validation_split,
    }


def resolve_validation(
    prompts: list[ValidationPrompt], card: ModelCard, settings: Settings
) -> list[dict]:
    """Each validation prompt checked against the model like a video request and resolved to
    what every checkpoint samples (the spec's names: `ValidationPrompt` in finetune_spec.py);
    a RequestError names the field as `validation[i].<param>`."""
    resolved = []
    for i, p in enumerate(prompts):
        try:
            width = height = None
            if p.size is not None:
                width, height = parse_size(p.size, "size")
            video = resolve(
                VideoRequest(
                    prompt=p.prompt,
                    seed=p.seed,
                    width=width,
                    height=height,
                    frames=p.num_frames,
                    steps=p.num_inference_steps,
                    guidance=p.guidance_scale,
                ),
                card.limits,
                card.defaults,
                model=card.name,
                max_steps=settings.max_steps,
                max_prompt_chars=settings.max_prompt_chars,
            )
        except RequestError as e:
            raise RequestError(
                f"validation[{i}]: {e}", param=f"validation[{i}].{e.param}"
            ) from None
        resolved.append(
            {
                "prompt": video.prompt,
                "seed": video.seed,
                "width": video.width,
                "height": video.height,
                "frames": video.frames,
                "steps": video.steps,
                "guidance": video.guidance,
            }
        )
    return resolved


class FineTuning:
    """The fine-tuning jobs of one server, as its API's principals see them."""

    def __init__(
        self, store: AsyncStore, workers: WorkerClient, settings: Settings, data: DataDir
    ) -> None:
        self.store, self.workers, self.settings, self.data = store, workers, settings, data

    async def create(
        self, body: FineTuningJobCreate, principal: Principal, key: IdempotencyKey | None
    ) -> FineTuningJob:
        """Queue a job; a retry with the same key gets the job its first request made."""
        card = find_model(self.workers, body.model, principal)
        await self._check_training_file(body.training_file, principal)
        if body.validation_file is not None:
            raise InvalidRequest(
                "validation_file is not supported",
                param="validation_file",
                code="unsupported_parameter",
            )
        if body.integrations:
            raise InvalidRequest(
                "integrations are not supported",
                param="integrations",
                code="unsupported_parameter",
            )
        if body.hyperparameters is not None and body.method is not None:
            raise InvalidRequest(
                "give hyperparameters either at the top level or in method.supervised, not both",
                param="hyperparameters",
            )
        hyper_in = body.hyperparameters or (
            body.method.supervised.hyperparameters if body.method else Hyperparameters()
        )
        hyper = resolve_hyperparameters(hyper_in, card, self.settings)
        if body.validation:
            hyper["validation"] = resolve_validation(body.validation, card, self.settings)

        async def insert(idempotency) -> FineTuneRecord:
            await admit(self.store, self.workers, self.settings, principal)
            job_id = new_id("ftjob-")
            seed = body.seed if body.seed is not None else secrets.randbelow(2**RANDOM_SEED_BITS)
            return await self.store.fine_tunes.insert(
                {
                    "id": job_id,
                    "model": body.model,
                    "training_file": body.training_file,
                    "hyperparameters": hyper,
                    "seed": seed,
                    "suffix": body.suffix,
                    "output_dir": self.data.relative(self.data.fine_tune(job_id)),
                    "owner": principal.owner,
                },
                idempotency=idempotency,
            )

        payload = body.model_dump(exclude_none=True)
        row, replayed = await create_once(
            self.store, key, payload, self.store.fine_tunes.get, insert
        )
        if not replayed:
            self.workers.wake()
        return finetune_object(row)

    async def _check_training_file(self, file_id: str, principal: Principal) -> None:
        """The training file must be the principal's, validated, and meant for fine-tuning."""
        file = await self.store.files.get(file_id)
        if file is None or not principal.may_see(file.owner):
            raise NotFound(f"No such File object: {file_id}", param="training_file")
        if file.status == "uploaded":
            raise InvalidRequest(
                f"file {file_id} is still being validated; create the job once its "
                "status is processed (GET /v1/files/{id})",
                param="training_file",
                code="file_not_ready",
            )
        if file.status == "error":
            raise InvalidRequest(
                f"file {file_id} failed validation: {file.status_details}",
                param="training_file",
                code="invalid_file",
            )
        if file.purpose != "fine-tune":
            raise InvalidRequest(
                f"file {file_id} was uploaded with purpose {file.purpose!r}, not 'fine-tune'",
                param="training_file",
            )

    async def find(self, job_id: str, principal: Principal) -> FineTuneRecord:
        """The job, if `principal` may see it; another key's answers 404 as if absent."""
        job = await self.store.fine_tunes.get(job_id)
        if job is None or not principal.may_see(job.owner):
            raise NotFound(
                f"No fine-tuning job found with id {job_id!r}", param="fine_tuning_job_id"
            )
        return job

    async def retrieve(self, job_id: str, principal: Principal) -> FineTuningJob:
        return finetune_object(await self.find(job_id, principal))

    async def list(self, principal: Principal, after: str | None, limit: int) -> dict:
        rows, has_more = await self.store.fine_tunes.page(after, limit, owner=principal.sees)
        return page([finetune_object(r) for r in rows], has_more)

    async def cancel(
        self, job_id: str, principal: Principal, key: IdempotencyKey | None
    ) -> FineTuningJob:
        """Cancel a queued job now, or a running one at its next optimizer step (waiting up to
        `cancel_wait_s` for it); a retry with the same key gets the first answer, not
        "already cancelled"."""

        async def work() -> FineTuningJob:
            job = await self.find(job_id, principal)
            if job.status in ("succeeded", "failed", "cancelled"):
                raise InvalidRequest(
                    f"fine-tuning job {job_id} already {job.status}",
                    param="fine_tuning_job_id",
                    code="job_not_cancellable",
                )

            async def cancelled() -> bool:
                return (await self.store.fine_tunes.get(job_id)).status == "cancelled"

            if await self.store.fine_tunes.cancel(job_id) == "running":
                self.workers.wake()
                await wait_for(cancelled, self.settings.cancel_wait_s)
            return finetune_object(await self.store.fine_tunes.get(job_id))

        return await answer_once(self.store, key, {"cancel": job_id}, FineTuningJob, work)

    async def events(
        self, job_id: str, principal: Principal, after: str | None, limit: int
    ) -> dict:
        """A page of the job's events, newest first; `after` is an event id (ftevent-N)."""
        await self.find(job_id, principal)
        if after is not None:
            if not after.startswith("ftevent-"):
                raise InvalidRequest(
                    f"after must be an event id (ftevent-N), got {after[:40]!r}", param="after"
                )
            event_seq(after.removeprefix("ftevent-"), "after")
        rows, has_more = await self.store.fine_tunes.events(job_id, after, limit)
        return page([event_object(r) for r in rows], has_more)

    async def checkpoints(
        self, job_id: str, principal: Principal, after: str | None, limit: int
    ) -> dict:
        job = await self.find(job_id, principal)
        rows, has_more = await self.store.fine_tunes.checkpoints(job_id, after, limit)
        return page([checkpoint_object(r, job) for r in rows], has_more)

    async def validation_video(
        self, job_id: str, checkpoint_id: str, index: int, principal: Principal
    ) -> Path:
        """The MP4 of validation prompt `index` sampled from one of the job's checkpoints."""
        await self.find(job_id, principal)
        checkpoint = await self.store.fine_tunes.checkpoint(job_id, checkpoint_id)
        if checkpoint is None:
            raise NotFound(
                f"fine-tuning job {job_id} has no checkpoint {checkpoint_id!r}",
                param="checkpoint_id",
            )
        videos = checkpoint.validation or []
        if not 0 <= index < len(videos):
            raise NotFound(
                f"checkpoint {checkpoint_id} has {len(videos)} validation video(s); "
                f"no index {index}",
                param="index",
            )
        video = videos[index]
        if video["status"] != "succeeded":
            raise InvalidRequest(
                f"validation video {index} of checkpoint {checkpoint_id} failed: {video['error']}",
                param="index",
                code="validation_video_failed",
            )
        path = self.data.resolve(video["path"])
        if not path.is_file():
            raise NotFound(
                f"the validation videos of checkpoint {checkpoint_id} were removed",
                param="checkpoint_id",
            )
        return path
