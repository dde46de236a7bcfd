"""Sampling: the one sampler loop every model family runs, a step at a time over a batch.

`pipeline.py` is the interface a server drives (`prepare_batch` -> `denoise_step` ... ->
`finish_batch`); `loop.py` is the step shared by every family: guidance pairs, per-row step-cache
decisions, LoRA rows and experts as groups of rows, around the family's hooks (its model inputs
and its update rule). `flow.py` holds rectified flow (our DiT's Euler update and training loss),
`step_cache.py` the policies that let a request skip a pass.
"""
