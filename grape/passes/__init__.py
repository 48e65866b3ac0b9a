"""Backend-neutral passes: plain functions over :class:`grape.ir.KernelGraph`.

Grouping shapes into families by fingerprint, parameter deltas and their compression, alias
plans and predication rewrites live here, run without a GPU and are tested without one; the
backends only apply their results.
"""
