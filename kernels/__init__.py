"""Triton kernels, one file per op: the @triton.jit kernels, their launchers, block-size tables
and compile_configs(). Imports triton and torch only; the ops around them are fastattn.ops."""
