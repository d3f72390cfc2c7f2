"""Fused ops. One file per op: autograd.Function + torch.library op + device dispatch
(Triton on CUDA, C++ on CPU, plain-PyTorch reference fallback). ``reference.py`` is the ground truth."""
