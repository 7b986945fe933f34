"""The name under which a transformers model takes its KV cache, and returns it.

transformers 5.24 renamed `past_key_values` to `cache`, the forward keyword and the output field alike, and warns
on the old name (until 5.40 drops it); the versions before know only `past_key_values`. The project supports both
(`transformers>=5.14`), so every forward that passes a cache says it with this name.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

CACHE = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"
"""the forward's keyword for the KV cache, and the output's field that holds it"""
