"""dflash-train: a Hydra-configured framework for training DFlash block-diffusion drafters."""

__all__ = ["__version__"]
__version__ = "0.1.0"
