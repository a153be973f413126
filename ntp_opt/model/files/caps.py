"""The caps on what an instance or plan file may hold (``docs/safety.md``).

Every reader looks them up here at each load, so that a caller (the
service, a test) can lower them by setting the attributes of this module
(``ntp_opt.model.files`` re-exports their values, read-only in effect).
"""

from __future__ import annotations

#: Largest number of cluster nodes a file may declare (about 900k GPUs).
MAX_NODES = 1_000_000
#: Largest file accepted, in bytes, uncompressed (a pretty-printed file takes
#: about 330 bytes per node).
MAX_FILE_BYTES = 512 * 1024**2
#: JSON values (counted as ``,``, ``{`` and ``[`` bytes) allowed per node of
#: :data:`MAX_NODES`: real instances have about 10.
TOKENS_PER_NODE = 12
#: JSON values allowed on top of ``TOKENS_PER_NODE * MAX_NODES``.
TOKENS_EXTRA = 100_000
#: Longest string (raw bytes between two quotes) accepted anywhere in a file.
MAX_STRING_BYTES = 1 << 20
