"""The machinery every patch goes through: declarations, the version gate, and the patcher.

``versions`` holds the supported range and the bands, ``spec`` how a patch
declares its vLLM contacts, ``rules`` how a contact is judged, ``gate`` the
check of all of them before the first change, and ``apply`` the
:class:`~kvelastic.patching.apply.Patcher` that makes and undoes every change.
The patch points themselves live in ``patches/`` (the ``kvelastic.patches``
package); the release list and the static matrix check live in
``kvelastic_dev/``, outside the shipped package.
"""
