"""MegaSlide: serve and fine-tune very large video diffusion transformers on one workstation."""

__version__ = "0.1.0"
