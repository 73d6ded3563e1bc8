"""Triton kernels, one file per op: the kernels, their launchers, autograd and torch.library
registration, and the PyTorch reference each is tested against. Public entry points are
re-exported by fastattn.ops."""
