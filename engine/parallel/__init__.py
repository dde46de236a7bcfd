"""Several devices, one process each: a video's tokens split over them, or a batch's rows.

`ranks.py` spawns and watches the processes and joins them into a `torch.distributed` group;
`sequence.py` is the sequence-parallel transform of the native DiT (Ulysses all-to-alls around
self-attention); `rank_group.py` keeps a model open on every rank and drives them step by step,
`multidevice.py` samples one video over them; `data_parallel.py` launches a fine-tuning run with
a batch's rows split over the ranks and one master in host RAM.
"""
