"""CPU offload of KV blocks: which blocks stay in host memory, and for how long.

The replacement policies (:mod:`kvelastic.offload.policy`, :mod:`.arc`,
:mod:`.lru`) are pure Python and know nothing about tensors, so they can be
tested and compared on synthetic traces without vLLM or a GPU. This package
file stays empty on purpose: importing it must not pull in torch.
"""
