"""kvelastic: an elastic KV cache for vLLM.

Importing this package is cheap on purpose: it runs from a ``.pth`` hook in
every Python process where the package is installed, so it imports neither
torch nor vLLM nor the CUDA driver. Subpackages pull those in when used.
"""

__version__ = "0.1.0"
