"""Files that several kvelastic processes share, kept where only trusted processes can touch them.

Everything kvelastic writes for other processes (the GPUs' accounts and the
metrics snapshots) lives in one directory
per *scope*: the user running kvelastic, or the group named by
``KVELASTIC_SHARED_GROUP`` (:mod:`.scope`). Every file in it is opened through
:class:`~kvelastic.shared.files.SafeDir`, which refuses symlinks, FIFOs and
files of untrusted owners, and bounds what it reads; data read back is parsed
with :mod:`.bounded_json` or fixed-size ``struct`` records, never pickle. Locks
are taken with a deadline (:mod:`.locks`), and the files of dead processes are
removed by :mod:`.sweep`. The trust model is written down in
``docs/security.md``.
"""
