"""MegaSlide's own video DiT as a model family.

`config.py` (no torch) holds its architecture and presets; `dit.py` the transformer as plain
math, `text.py` and `tokens.py` the built-in text encoder, `autoencoder.py` the autoencoders;
`family.py` ties them into the family interface the loader and the server use, and
`checkpoint.py` reads and writes its model directories. `world.py` is the procedural video world
the packaged model was trained on.
"""
