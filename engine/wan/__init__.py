"""Wan (Wan2.1 / Wan2.2, diffusers format) as a MegaSlide model family.

`config.py` reads a pipeline directory without torch (what the server and request validation
need); `family.py` builds its modules from diffusers' and transformers' own classes and samples
them step-wise; `attention.py` is the 3D-DSA attention processor for Wan's self-attention.
"""
