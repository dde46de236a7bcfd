"""Full fine-tuning through the streamer: master weights and optimizer state in host RAM (or
the optimizer's own state on local disk, through a ring of a few blocks: `optim_disk.py`).

`finetune.py` is the run (`Trainer`, `open_trainer`), `finetune_spec.py` what it is asked to do.
`blockwise.py` is the step: forward block by block, backward block by block, each block's
gradients handed to the CPU optimizer (`optim.py`) while the device computes the next;
`group.py` who else trains the same batch (one process, or a rank of a data-parallel group).
`group.py` is the part of the step that data parallel changes (which rows, how gradients reach
the optimizer), `model.py` what the step needs of a family's model (prologue, blocks, epilogue),
`data.py` the data sets of captioned clips.
"""
