"""Full fine-tuning through the streamer: master weights and optimizer state in host RAM.

`finetune.py` is the run (`Trainer`, `open_trainer`), `finetune_spec.py` what it is asked to do.
`blockwise.py` is the step: forward block by block, backward block by block, each block's
gradients handed to the CPU optimizer (`optim.py`) while the device computes the next.
`model.py` is what the step needs of a family's model (prologue, blocks, epilogue), `data.py`
the data sets of captioned clips.
"""
