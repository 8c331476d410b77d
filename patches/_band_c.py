"""Version ranges of vLLM 0.29-0.33 (band C), for the patch modules written for them.

Not yet part of ``kvelastic.patching.versions.BANDS``: the gate still refuses
0.29+ until these patches are registered (see docs/vllm-0.29.md, "Remaining
integration").
"""

from __future__ import annotations

from kvelastic.patching.versions import VersionRange

BAND_C = VersionRange.of("0.29", "0.34")
FROM_0_30 = VersionRange.of("0.30", "0.34")  # HiSparse (vllm.v1.hisparse) exists
BEFORE_0_33 = VersionRange.of("0.29", "0.33")
FROM_0_33 = VersionRange.of("0.33", "0.34")
