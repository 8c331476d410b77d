"""The machinery every patch goes through: declarations, the version gate, and the patcher.

``versions`` holds the supported range and the bands, ``spec`` how a patch
declares its vLLM contacts, ``rules`` how a contact is judged, ``source`` and
``gate`` how it is looked up (from source files, or imported), ``on_import``
when each patch is applied (as vLLM imports its module), and ``apply`` the
:class:`~kvelastic.patching.apply.Patcher` that makes and undoes every change.
The patch points themselves live in ``patches/`` (the ``kvelastic.patches``
package); the release list and the source fetching for the version matrix live
in ``kvelastic_dev/``, outside the shipped package.
"""
