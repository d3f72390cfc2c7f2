"""Fused ops. One file per op: autograd.Function + torch.library op + device dispatch
(Triton on CUDA, C++ on CPU, plain-PyTorch reference fallback). ``reference.py`` is the ground truth."""
from .contrastive_loss import contrastive_loss  # noqa: E402,F401
from .prefix_attention import prefix_attention  # noqa: E402,F401
