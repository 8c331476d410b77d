"""Development tools for kvelastic, not shipped in the wheel: the version matrix's machinery.

``releases`` lists the supported vLLM releases; ``vllm_source`` (with
``remote_zip``) fetches each one's Python source from PyPI into a cache;
``static_check`` checks every declared contact against a release's source with
the gate's own rules, without importing vLLM. Only ``tests/`` and CI use them;
the running plugin needs none of them.
"""
