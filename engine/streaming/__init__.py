"""Weights in host memory, on the device one block at a time, each copy hidden under compute.

`streamer.py` is the transform: `stream_module` turns a built module's blocks into slots that a
block's weights are copied into just before it runs (`StreamHandle`). The rest are the parts it
stands on: `host_store.py` (one aligned host buffer per block, shared between processes),
`weight_formats.py` (the bytes a block keeps in RAM and sends over the bus: raw, lossless, fp8),
`fp8_matmul.py` (with fp8, linears that multiply by the payload's fp8 bytes instead of a decode),
`disk_store.py` (the disk tier: blocks read from the model's files through a bounded ring) and
`ordering.py` (the streams and events that order copies against compute).
"""
